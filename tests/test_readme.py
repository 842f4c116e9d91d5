"""The README's examples run as written (on the GPU when there is one, else on the CPU), in order."""

from __future__ import annotations

import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_examples_run():
    with open(README, encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) >= 6, "the README lost its examples"
    scope: dict = {}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), scope)
        except Exception as e:  # noqa: BLE001 - name the block that failed
            raise AssertionError(f"README.md python block {i} failed: {type(e).__name__}: {e}\n{block}") from e

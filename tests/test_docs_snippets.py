"""The ```python blocks of docs/serving.md, docs/training.md and docs/fla.md run as written.

Each page's blocks run in order in one namespace (later blocks use earlier names), exactly as a reader
would paste them. A block whose first line is ``# requires: cuda`` runs only where CUDA is available
(``# requires: cuda, fla.models``: and where the listed modules import);
every other block runs on CPU at the CPU sizes the page picks (``device = "cuda" if ... else "cpu"``).
docs/fla.md needs fla-core (its block installs kda_ops into fla's dispatcher; undone afterwards).

``torch.compile`` in a page runs with the "aot_eager" backend here: Dynamo (fullgraph) and AOTAutograd
trace the layer through the op's fake kernels and autograd formula exactly as with inductor, without
inductor's C++ code generation (~1-2 min on a 2-core CI machine; tests/test_compile.py covers inductor
with the op). KDA_DOCS_INDUCTOR=1 keeps the page's own backend.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def _requirements_met(code: str) -> bool:
    """A block's first line ``# requires: cuda, fla.models`` lists what it needs: "cuda" (a CUDA device) and
    importable modules; the block runs only where all are present."""
    first = code.lstrip().split("\n", 1)[0]
    if not first.startswith("# requires:"):
        return True
    import importlib.util

    for need in (x.strip() for x in first[len("# requires:") :].split(",")):
        if need == "cuda":
            if not torch.cuda.is_available():
                return False
        elif need:
            try:
                if importlib.util.find_spec(need) is None:
                    return False
            except ModuleNotFoundError:
                return False
    return True


def python_blocks(page: str) -> list[str]:
    with open(os.path.join(DOCS, page)) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


@pytest.mark.parametrize("page", ["serving.md", "training.md", "fla.md"])
def test_doc_snippets_run(page: str, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks(page)
    assert blocks, f"docs/{page} has no python blocks (the extraction pattern no longer matches the page)"
    if page == "fla.md":
        pytest.importorskip("fla.ops.kda", reason="docs/fla.md's block needs fla-core")
    if os.environ.get("KDA_DOCS_INDUCTOR") != "1":
        compile_ = torch.compile

        def cheap_compile(*args, **kwargs):
            kwargs.setdefault("backend", "aot_eager")
            return compile_(*args, **kwargs)

        monkeypatch.setattr(torch, "compile", cheap_compile)
    ns: dict = {"__name__": f"docs_{page.replace('.', '_')}"}
    ran = 0
    try:
        for i, code in enumerate(blocks):
            if not _requirements_met(code):
                continue
            exec(compile(code, f"docs/{page} (python block {i + 1})", "exec"), ns)
            ran += 1
    finally:
        if page == "fla.md":
            from kda_ops import fla as kf

            kf.uninstall()
        if page == "training.md":
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    assert ran > 0

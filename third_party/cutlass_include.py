"""Locate the CUTLASS/CuTe headers without vendoring them.

Order: ``$CUTLASS_HOME/include`` if set, else the ``cutlass_library/source/include`` folder of the
pinned ``nvidia-cutlass`` wheel (found with ``importlib.util.find_spec``, so the package's Python
code is never imported). Run as a script it prints the folder, or exits 1 with what to install.
"""

from __future__ import annotations

import importlib.util
import os
import sys

CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"
_HINT = (
    "CUTLASS/CuTe headers not found. Install them with "
    f"`pip install --no-deps {CUTLASS_PIN}` or set CUTLASS_HOME to a CUTLASS checkout "
    "(the folder that holds include/cute and include/cutlass)."
)


def _has_headers(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "cute", "tensor.hpp")) and os.path.isfile(
        os.path.join(path, "cutlass", "cutlass.h")
    )


def find_cutlass_include() -> str:
    """Return the CUTLASS include folder; raise RuntimeError naming the fix when absent."""
    home = os.environ.get("CUTLASS_HOME")
    if home:
        inc = os.path.join(home, "include")
        if _has_headers(inc):
            return inc
        raise RuntimeError(f"CUTLASS_HOME={home!r} has no include/cute/tensor.hpp. " + _HINT)
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            inc = os.path.join(loc, "source", "include")
            if _has_headers(inc):
                return inc
    raise RuntimeError(_HINT)


if __name__ == "__main__":
    try:
        print(find_cutlass_include())
    except RuntimeError as e:
        print(e, file=sys.stderr)
        sys.exit(1)

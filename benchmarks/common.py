"""Shared benchmark plumbing: CUDA-event timing, peer imports, markdown/JSON/PNG output.

Every benchmark measures ours and the peers in ONE process (fla's Triton kernels autotune once per
shape), prints a markdown table with ratios, and writes <name>.json / <name>.md / <name>.png to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch


def parse_args(name: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=f"kda_ops {name} benchmark")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--no-peers", action="store_true", help="skip the peers (fla, flash_kda, cudnn)")
    if extra:
        extra(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"kda_ops {name} benchmark: needs a CUDA GPU (none visible); it times the CUDA kernels")
    os.makedirs(args.out, exist_ok=True)
    return args


def add_cases_arg(ap: argparse.ArgumentParser) -> None:
    """``--cases``: a comma list of indices into the benchmark's CASES (see chosen_cases)."""
    ap.add_argument("--cases", default="", help="comma list of case indices (default: all)")


def chosen_cases(cases: list, spec: str, default: list | None = None, first: int = 0) -> list:
    """The cases a ``--cases`` value names (indices counted from `first`), or `default` (all when None)."""
    if spec:
        return [cases[int(i) - first] for i in spec.split(",")]
    return list(cases) if default is None else default


def cuda_time_ms(fn: Callable[[], Any], warmup: int = 3, rep: int = 10) -> float:
    """Median wall time of fn() in ms, CUDA events around each call, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def try_call(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(result, None) or (None, short error) — a missing kernel is reported, not fatal."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - any failure of a peer or an unimplemented path is data
        msg = f"{type(e).__name__}: {e}".splitlines()[0]
        return None, msg[:160]


def import_fla_kda():
    """fla's KDA module (chunk_kda, fused_recurrent_kda) or None."""
    try:
        import fla.ops.kda as m  # type: ignore

        return m
    except Exception as e:  # noqa: BLE001
        print(f"[peers] fla not importable: {type(e).__name__}: {e}")
        return None


def import_cudnn_kda():  # type: ignore[no-untyped-def]
    """cuDNN Frontend's kimi_delta_attention or None."""
    try:
        from cudnn.linear_attention import kimi_delta_attention  # type: ignore

        return kimi_delta_attention
    except Exception as e:  # noqa: BLE001
        print(f"[peers] cuDNN Frontend not importable: {type(e).__name__}: {e}")
        return None


def import_flash_kda():
    try:
        import flash_kda  # type: ignore

        return flash_kda
    except Exception:  # noqa: BLE001
        return None


def fmt(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def ratio(peer: float | None, ours: float | None) -> str:
    """peer time / our time (> 1 means we are faster)."""
    if peer is None or ours is None or ours <= 0:
        return "n/a"
    return f"{peer / ours:.2f}x"


def write_results(
    out_dir: str,
    name: str,
    header: list[str],
    rows: list[list[str]],
    records: list[dict],
    notes: list[str],
    device: str | None = None,
) -> str:
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(notes + [""] + md) + "\n"
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        dev = device if device is not None else torch.cuda.get_device_name()
        json.dump({"device": dev, "records": records, "notes": notes}, f, indent=1)
    print(text, flush=True)
    return text


def bar_plot(out_dir: str, name: str, labels: list[str], series: dict[str, list[float | None]], ylabel: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        print("[plot] matplotlib missing, no PNG")
        return
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 1.2), 4))
    width = 0.8 / max(1, len(series))
    for i, (sname, vals) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [0 if v is None else v for v in vals], width, label=sname)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=120)
    plt.close(fig)

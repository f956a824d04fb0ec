"""Issue #42's CPU cell: one Wan 2.1 1.3B-width block (``WanTransformer3DModel`` at the released config, one of its
30 blocks, random weights, float32) at 480x832 px and 81 frames: 21 latent frames, 32,760 tokens, batch 1, with
umT5's 512 text tokens. Whole model calls (the patch embedding and output layer are a small share), each method
against the unpatched call of the same round, methods alternating in forward and backward order; then each
method's peak memory: the rise of the resident set over one call, in a fresh process per method (a process's
high-water mark never falls).

    python docs/results/cpu_wan_block.py [--size 480p|720p] [--rounds R] [--threads T] [--methods M ...] [--no-memory]
    # rows to $OUT/cpu_wan_block.json (720p: cpu_wan_block_720p.json)

Methods: ``default`` (``patch(model)``: each token compared with the destinations of its own and the neighbouring
latent frames, ``frame_window=1``), ``frame_window=None`` (the default's arrangement searching the whole clip, the
default before), ``oracle of default`` (free removal of the tokens the default removes:
``tome_tools.oracle.attach_oracle``), ``prefer="speed"``, ``local_window=1`` (the default's arrangement, each
source compared with the destinations of its own and the 8 neighbouring cells only), and keys and values merged
inside the attention kernel after the rotary positions (``mode="kv"``: in 2x1 or 2x2 cells, one token drawn per
cell, or a half or three quarters of them by similarity, size-aware); ``--methods`` picks some. About 6 minutes a round and 6 for the memory on a 2-core CPU.
``--size 720p``: 720x1280 px, 81 frames (75,600 tokens), about 10 minutes a round for the unpatched call, the
default, its oracle and ``prefer="speed"`` (``--no-memory``: no resident-set rows, each another call per method;
``cpu_wan_memory.py`` counts the memory exactly).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import diffusers
import torch

import tome_core.torch as tome
from tome_tools.bench_core import _peak_kb, _restart_peak_kb
from tome_tools.diffusers_bench import hook_default_oracle
from tome_tools.presets import VIDEO_TRANSFORMERS


def tokens_of(latent: Tuple[int, ...]) -> int:
    """Wan's tokens for a latent ``(B, C, F, H, W)``: 1 x 2 x 2 patches."""
    return latent[2] * (latent[3] // 2) * (latent[4] // 2)


LATENT = (1, 16, 21, 60, 104)  # 81 frames at 480x832: (81 - 1) / 4 + 1 latent frames, 8x smaller sides
SIZES = {"480p": LATENT, "720p": (1, 16, 21, 90, 160)}  # 720p: 720x1280, 75,600 tokens
TOKENS = tokens_of(LATENT)
# keys and values merged inside the attention kernel (mode="kv", after Wan's rotary positions): in cells, one token
# drawn per cell, or by similarity (size-aware)
KV = {
    "kv 2x1 cells": dict(matching="cell", sx=2, sy=1, cell_pool="sample"),
    "kv 2x2 cells": dict(matching="cell", sx=2, sy=2, cell_pool="sample"),
    "kv 0.5": dict(ratio=0.5),
    "kv 0.75": dict(ratio=0.75),
}
METHODS = ("unpatched", "default", "frame_window=None", "oracle of default", 'prefer="speed"', "local_window=1", *KV)


def build(latent: Tuple[int, ...] = LATENT) -> Callable[[], torch.Tensor]:
    """The one-block model's call on a seeded ``latent`` (``call.model``: the model)."""
    torch.manual_seed(0)
    name, config = VIDEO_TRANSFORMERS["wan-1.3b"]
    model = getattr(diffusers, name)(**{**config, "num_layers": 1}).eval()
    x, text, t = torch.randn(latent), torch.randn(1, 512, 4096), torch.tensor([500])

    def call() -> torch.Tensor:
        with torch.inference_mode():
            return model(x, t, text, return_dict=False)[0]

    call.model = model  # type: ignore[attr-defined]
    return call


def use(model: Any, method: str) -> Callable[[], None]:
    """Patch ``model`` for ``method``; returns what removes it."""
    if method == "unpatched":
        return lambda: None
    if method == "oracle of default":
        return hook_default_oracle(model)
    options = {
        "default": {}, "frame_window=None": {"frame_window": None}, 'prefer="speed"': {"prefer": "speed"},
        "local_window=1": {"local_window": 1},
    }.get(method)
    if options is None:
        options = dict(mode="kv", **KV[method])
    tome.patch(model, **options)
    return lambda: tome.remove(model)


def peak_rise_mb(method: str, threads: int, size: str = "480p") -> float:
    """The resident set's rise over one call of ``method`` at ``size``, in a fresh process."""
    out = subprocess.run([sys.executable, __file__, "--peak", method, "--threads", str(threads), "--size", size],
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="480p")
    parser.add_argument("--no-memory", action="store_true", help="no peak memory rows")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--peak", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--memory-only", action="store_true", help="only the peak memory rows")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS, help="these (unpatched always)")
    args = parser.parse_args()
    methods = ("unpatched", *(m for m in args.methods if m != "unpatched"))
    torch.set_num_threads(args.threads)
    latent = SIZES[args.size]
    call = build(latent)
    if args.peak:
        undo = use(call.model, args.peak)
        before = _restart_peak_kb()  # VmHWM: ru_maxrss would count the parent's size at the fork
        call()
        print((_peak_kb() - before) / 1024)
        undo()
        return
    if args.memory_only:
        for method in methods:
            print(f"{method:<20} peak rise {peak_rise_mb(method, args.threads, args.size):7.0f} MB", flush=True)
        return
    times: Dict[str, List[float]] = {m: [] for m in methods}
    outputs: Dict[str, torch.Tensor] = {}
    for r in range(args.rounds):
        for method in (methods if r % 2 == 0 else methods[::-1]):
            undo = use(call.model, method)
            start = time.perf_counter()
            outputs[method] = call()
            times[method].append(time.perf_counter() - start)
            undo()
            print(f"round {r} {method:<20} {times[method][-1]:7.1f} s", flush=True)
    rows = []
    for method in methods:
        ratios = [u / m for u, m in zip(times["unpatched"], times[method])]
        fid = float((outputs[method] - outputs["unpatched"]).norm() / outputs["unpatched"].norm())
        rows.append(dict(method=method, s=times[method], speedup=statistics.median(ratios), speedups=ratios, fid=fid))
    for row in rows:
        row["peak_rise_mb"] = None if args.no_memory else peak_rise_mb(row["method"], args.threads, args.size)
        peak = "" if args.no_memory else f"  peak rise {row['peak_rise_mb']:7.0f} MB"
        print(f"{row['method']:<20} {row['speedup']:5.2f}x  fid {row['fid']:.4f}{peak}", flush=True)
    name = "cpu_wan_block.json" if args.size == "480p" else f"cpu_wan_block_{args.size}.json"
    out = os.path.join(os.environ.get("OUT", "/tmp"), name)
    with open(out, "w") as f:
        json.dump(dict(latent=latent, tokens=tokens_of(latent), threads=args.threads, torch=torch.__version__,
                       cpu=os.cpu_count(), rows=rows), f, indent=1)
    print(f"rows in {out}")


if __name__ == "__main__":
    main()

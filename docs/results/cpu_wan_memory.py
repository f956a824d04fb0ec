"""Issue #42's memory cell, exactly: the peak tensor memory of one Wan 2.1 1.3B-width block (the model of
``cpu_wan_block.py``: one of its 30 blocks at the released width, random weights, float32, batch 1, 512 text
tokens) at 480x832 px, per method against unpatched, at 6, 12 and 21 latent frames (9,360, 18,720 and 32,760
tokens; 21 frames is Wan's released 81-frame video).

Each method runs in a fresh process (nothing cached from another method): a first call, then a second. The peak
is ``tome_tools.diffusers_bench.tensor_peak_mib``'s, from the profiler's allocation events (what CUDA's
``max_memory_allocated`` counts on a GPU): over the two calls, the larger of the first call's peak and what the
first call left allocated (caches) plus the second's peak. ``excess``: MiB above the same size's unpatched peak.

    PYTHONPATH=.:src python docs/results/cpu_wan_memory.py [--frames F ...] [--methods M ...] [--json PATH]

About 12 minutes on a 2-core CPU (``--frames 21`` alone, 2 calls per method: ~3 minutes a method).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_wan_block as block  # noqa: E402

SEVERAL = ("unpatched", "default", "oracle of default", 'prefer="speed"', "kv 2x2 cells")
SIZES = {6: SEVERAL, 12: SEVERAL, 21: ("unpatched", "default")}  # latent frames: the methods run there


def latent(frames: int) -> tuple:
    """``cpu_wan_block.LATENT`` with ``frames`` latent frames."""
    return (*block.LATENT[:2], frames, *block.LATENT[3:])


def tokens(frames: int) -> int:
    """Wan's tokens for ``frames`` latent frames (``cpu_wan_block.tokens_of``)."""
    return block.tokens_of(latent(frames))


def measure(frames: int, method: str) -> Dict[str, float]:
    """In this process: the method's two calls at ``frames`` latent frames."""
    from tome_tools.diffusers_bench import tensor_peak_mib

    call = block.build(latent(frames))
    block.use(call.model, method)

    def once() -> None:  # the output is dropped inside the profiled call: it is not a cache
        call()

    first, cached = tensor_peak_mib(once)
    second, _ = tensor_peak_mib(once)
    return dict(first_mib=first, cached_mib=cached, second_mib=second, peak_mib=max(first, cached + second))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", choices=sorted(SIZES), default=sorted(SIZES))
    parser.add_argument("--methods", nargs="+", choices=block.METHODS, help="these at every size (unpatched always)")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "cpu_wan_memory.json"))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(int(args.child[0]), args.child[1])))
        return
    rows = []
    for frames in args.frames:
        methods = ("unpatched", *(m for m in (args.methods or SIZES[frames]) if m != "unpatched"))
        for method in methods:
            out = subprocess.run([sys.executable, __file__, "--child", str(frames), method], check=True,
                                 capture_output=True, text=True).stdout
            row = dict(frames=frames, tokens=tokens(frames), method=method, **json.loads(out.strip().splitlines()[-1]))
            base = next(r for r in rows + [row] if r["frames"] == frames and r["method"] == "unpatched")
            row["excess_mib"] = row["peak_mib"] - base["peak_mib"]
            rows.append(row)
            print(f"{row['tokens']:>6} tokens  {method:<18} peak {row['peak_mib']:8.1f} MiB  excess {row['excess_mib']:+7.2f}"
                  f"  (first {row['first_mib']:.1f}, cached {row['cached_mib']:.2f}, second {row['second_mib']:.1f})", flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(model="Wan 2.1 1.3B width, one block, float32, batch 1, 480x832", torch=torch.__version__,
                       threads=torch.get_num_threads(), rows=rows), f, indent=1)
    print(f"rows in {args.json}")


if __name__ == "__main__":
    main()

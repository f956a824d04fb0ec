"""Memory and time of one block's match (ToMe for SD: 2x2 cells, ratio 0.5, sources 3/4 of the tokens) at Wan
1.3B width (1536 channels, batch 1, float32, torch on the CPU), with the similarity search in one product and in
chunks of at most ``block`` entries (``tome_core.algorithm.match.SIMILARITY_BLOCK``).

Peak memory: the rise of the peak resident set (VmHWM, reset through /proc/self/clear_refs) over the resident
set before the match, in a fresh process per configuration. Time: medians of paired runs in one process, the
configurations alternating within each pair; ratios are chunked / one product. Usage (about 15 minutes here):

    PYTHONPATH=src:. python docs/results/match_memory.py --json docs/results/match_memory.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

WIDTH, CELL_ROWS, FRAME_TOKENS = 1536, 30, 1560  # a 480x832 latent frame: 30 x 52 tokens
WHOLE = 2**62  # a block no input reaches: one product


def run_match(frames: int, block: int):
    """One block's match of ``frames`` latent frames (a ``30 * frames x 52`` grid) with ``block``."""
    import torch

    from tome_core import load_backend
    from tome_core.algorithm import match as match_module
    torch.manual_seed(0)
    tokens = FRAME_TOKENS * frames
    metric = torch.randn(1, tokens, WIDTH)
    match_module.SIMILARITY_BLOCK = block
    ops = load_backend("torch")
    return lambda: match_module.bipartite_matches(ops, metric, CELL_ROWS * frames, 52, 2, 2, [tokens // 2], None)


def resident(key: str) -> float:
    """``VmRSS`` or ``VmHWM`` of this process in MiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith(key + ":"))


def child(frames: int, block: int) -> None:
    """In a fresh process: print the peak resident memory the match adds, in MiB."""
    match = run_match(frames, block)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak resident set restarts from the current one
    before = resident("VmRSS")
    match()
    print(json.dumps(resident("VmHWM") - before))


def peak(frames: int, block: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", str(frames), str(block)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def paired_times(frames: int, blocks: list, pairs: int) -> dict:
    """Seconds of each block's match, ``pairs`` rounds alternating the blocks (one warm-up round first)."""
    runs = {block: run_match(frames, block) for block in blocks}
    from tome_core.algorithm import match as match_module
    seconds = {block: [] for block in blocks}
    for round_ in range(pairs + 1):
        for block in blocks if round_ % 2 else blocks[::-1]:
            match_module.SIMILARITY_BLOCK = block
            start = time.perf_counter()
            runs[block]()
            if round_:
                seconds[block].append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=2, type=int)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    from tome_core.algorithm.match import SIMILARITY_BLOCK

    result = {"width": WIDTH, "batch": 1, "dtype": "float32", "backend": "torch, 2 threads", "default_block": SIMILARITY_BLOCK, "sizes": []}
    # Timed: every block at 9,360 tokens; at 32,760 (~40 s a run) only the default against one product.
    for frames, blocks, timed, pairs in ((6, [WHOLE, 2**24, 2**22, 2**20], 4, 7), (21, [WHOLE, 2**24, 2**22], 2, 4)):
        tokens = FRAME_TOKENS * frames
        sources, destinations = tokens - tokens // 4, tokens // 4
        seconds = paired_times(frames, blocks[:timed], pairs)
        row = {"tokens": tokens, "sources": sources, "destinations": destinations, "pairs": pairs, "blocks": []}
        for block in blocks:
            rows = min(sources, max(1, block // destinations))
            chunks = -(-sources // rows)
            largest = -(-sources // chunks) * destinations
            row["blocks"].append({
                "block": "one product" if block == WHOLE else block, "chunks": chunks,
                "largest_block_entries": largest, "largest_block_mib": largest * 4 / 2**20,
                "peak_rss_rise_mib": peak(frames, block),
            })
            if block in seconds:
                row["blocks"][-1].update(
                    median_s=statistics.median(seconds[block]),
                    median_ratio_to_one_product=statistics.median(t / w for t, w in zip(seconds[block], seconds[WHOLE])),
                )
            print(json.dumps(row["blocks"][-1]), file=sys.stderr)
        result["sizes"].append(row)
    sources, destinations = 119_000 - 119_000 // 4, 119_000 // 4  # HunyuanVideo 720p, analytic
    rows = SIMILARITY_BLOCK // destinations
    result["analytic_119000_tokens"] = {
        "one_product_entries": sources * destinations, "one_product_gib": sources * destinations * 4 / 2**30,
        "chunked_largest_entries": -(-sources // -(-sources // rows)) * destinations,
        "chunked_chunks": -(-sources // rows),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()

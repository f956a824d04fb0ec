"""One spatial self-attention of a video UNet block, per frame vs across frames: the match, and merge +
attention + unmerge, on 8 correlated frames of a 48x48 latent (2304 tokens, 320 channels, 5 heads of 64),
one thread, medians of alternating rounds. Run: ``python docs/results/video_block_costs.py`` (torch).

Where docs/results/video_block_costs.txt comes from: it shows what a full-UNet run on a CPU cannot separate (the
cross-frame similarity search against the attention it saves)."""

import statistics
import time

import torch
import torch.nn.functional as F

from tome_core.config import ToMeConfig
from tome_core.algorithm.merge import merge, unmerge
from tome_core.hooks.call import CallFacts
from tome_core.hooks.state import ToMeState

torch.set_num_threads(1)
FRAMES, H, W, C = 8, 48, 48, 320
x = torch.randn(FRAMES, H * W, C, generator=torch.Generator().manual_seed(0))
x = x + 3 * torch.randn(1, H * W, C, generator=torch.Generator().manual_seed(1))  # frames that share content
CONFIGS = {
    "unpatched": dict(ratio=0.0),
    "per frame, ratio 0.5": dict(ratio=0.5),
    "chunks of 4": dict(ratio=0.5, frames_per_chunk=4),
    "chunks of 4, local_window=1": dict(ratio=0.5, frames_per_chunk=4, local_window=1),
    "chunks of 8": dict(ratio=0.5, frames_per_chunk=8),
    "chunks of 8, local_window=1": dict(ratio=0.5, frames_per_chunk=8, local_window=1),
}


def run(options):
    state = ToMeState(config=ToMeConfig(**options))
    state.begin_call(CallFacts((H, W), 500, videos=1 if options.get("frames_per_chunk") else None))
    start = time.perf_counter()
    match = state.block_matches(x, 0)["attn"]
    matched = time.perf_counter()
    merged = merge(x, match)
    q = merged.view(merged.shape[0], merged.shape[1], 5, 64).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(merged.shape)
    unmerge(out, match)
    return matched - start, time.perf_counter() - matched, match.kept


times = {name: [] for name in CONFIGS}
for _ in range(5):
    for name, options in CONFIGS.items():
        times[name].append(run(options))
base = statistics.median(a + b for a, b, _ in times["unpatched"])
print(f"{'':30} {'match s':>8} {'attn s':>8} {'total s':>8} {'speedup':>8} {'tokens/attention':>17}")
for name, rows in times.items():
    match, attn = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
    total = statistics.median(a + b for a, b, _ in rows)
    print(f"{name:30} {match:8.3f} {attn:8.3f} {total:8.3f} {base / total:8.2f}x {rows[0][2]:>17}")

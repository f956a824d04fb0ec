"""Where the GPU time of one Wan 2.1 1.3B-width block's match goes at 480x832, 81 frames (32,760 tokens, ToMe for
SD at 0.5 in 2x2 cells, the default's arrangement there), and what the size bias costs its attention: the pieces
of the match timed alone in CUDA graphs (the similarity in chunks as the library takes it and in one product, the
ranking, the assignment), the profiler's kernels of one match, and self-attention at the merged size plainly, with
the size bias as an additive mask (what diffusers' processors get), with the bias folded into the values (an
exact rewrite that keeps a bias-free kernel) and into one more query and key channel (the same, the head padded
from 128 to 136 channels, which the flash kernels take), on the kernels SDPA picks and on cuDNN's and the memory-efficient
one. Needs CUDA; rows to ``$OUT/gpu_match_costs_CASE.json`` (kept as ``docs/results/gpu_h200_match_costs.json``).

    python docs/results/gpu_match_costs.py [--case flux1024]

``--case flux1024``: the same at Flux's width and 1024 px (4,096 image tokens on a 64 x 64 grid, 3,072 channels,
24 heads; its self-attention also attends to the 512 text tokens), where the match is small kernels rather than
one product.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Callable, Dict

import torch
import torch.nn.functional as F

import gpu_timing as gt
from tome_core.algorithm import match as match_module
from tome_core.algorithm.backend import get_ops
from tome_core.algorithm.match import best_destinations, bipartite_matches, rank_sources
from tome_core.algorithm.partition import random_offsets, split

CASES = {  # frames, grid height and width, channels, heads, text tokens beside the image in self-attention
    "wan480": (21, 30, 52, 1536, 12, 0),
    "flux1024": (1, 64, 64, 3072, 24, 512),
}


def timed(fns: Dict[str, Callable[[], object]], rounds: int = 15, reps: int = 5) -> Dict[str, float]:
    """Median ms per call of each function, replayed from a CUDA graph, the functions alternating."""
    replays = {name: gt.capture(fn)[0] for name, fn in fns.items()}
    return {name: statistics.median(t) for name, t in gt.time_rounds(replays, rounds, reps).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), default="wan480")
    case = parser.parse_args().case
    frames, rows_per_frame, w, channels, heads, text = CASES[case]
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    tokens = frames * rows_per_frame * w
    metric = torch.randn(1, tokens, channels, device=device, dtype=dtype)
    ops = get_ops(metric)
    h = frames * rows_per_frame  # frames stacked along the height: 2x2 cells never cross a frame (rows_per_frame is even)
    offsets = random_offsets(ops, metric, h, w, 2, 2, 0, 999, 0)
    dst, src = split(ops, metric, h, w, 2, 2, offsets)
    merged, num_dst = tokens // 2, int(dst.shape[0])
    rows: Dict[str, object] = {"case": case, "tokens": tokens, "sources": int(src.shape[0]), "destinations": num_dst,
                               "width": channels, "dtype": str(dtype), "device": torch.cuda.get_device_name()}
    with torch.no_grad():
        best, which = best_destinations(ops, metric, src, dst)
        unit = metric / metric.norm(dim=-1, keepdim=True)
        unit_src, unit_dst = unit[:, src], unit[:, dst]
        product = torch.bmm(unit_src, unit_dst.transpose(-1, -2).contiguous())
        padded = F.pad(unit_dst.transpose(-1, -2), (0, -num_dst % 8))
        padded_product = torch.bmm(unit_src, padded)
        pieces = {
            "match (the library's, shared)": lambda: bipartite_matches(ops, metric, h, w, 2, 2, [merged], offsets, shared=True),
            "similarity, chunks of 2**24": lambda: best_destinations(ops, metric, src, dst),
            "similarity, one product": lambda: best_destinations(ops, metric, src, dst, block=2**31),
            "similarity, float32 one product": lambda: best_destinations(ops, metric.float(), src, dst, block=2**31),
            "product, the destinations as they are": lambda: torch.bmm(unit_src, unit_dst.transpose(-1, -2)),
            "product, padded to a multiple of 8 columns": lambda: torch.bmm(unit_src, F.pad(unit_dst.transpose(-1, -2), (0, -num_dst % 8))),
            "product, the backend's aligned columns": lambda: ops.matmul(
                unit_src, ops.aligned_columns(ops.matrix_transpose(unit_dst)))[..., :num_dst],
            "max and argmax alone": lambda: product.max(dim=-1),
            "max and argmax alone, sliced rows": lambda: padded_product[..., :num_dst].max(dim=-1),
            "normalize": lambda: metric / metric.norm(dim=-1, keepdim=True),
            "rank (argsort)": lambda: rank_sources(ops, best),
            "assign": lambda: match_module.assign(ops, rank_sources(ops, best), which, src, dst, merged, metric),
        }
        rows["pieces_ms"] = timed(pieces)
        for name, ms in rows["pieces_ms"].items():
            print(f"{name:<40} {ms:8.3f} ms", flush=True)

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                bipartite_matches(ops, metric, h, w, 2, 2, [merged], offsets, shared=True)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=110)
        print(table, flush=True)
        rows["profile"] = table

        kept = tokens - merged + text
        q, k, v = (torch.randn(1, heads, kept, channels // heads, device=device, dtype=dtype) for _ in range(3))
        sizes = torch.randint(1, 5, (1, 1, 1, kept), device=device).to(dtype)
        sizes[..., :text] = 1
        bias = sizes.log()

        def folded():
            # softmax(l + log s) v = (sum_j e^l_j s_j v_j) / (sum_j e^l_j s_j): the values scaled by size, their
            # sum of sizes as one more value channel, the plain kernel's output divided by it
            s = sizes.transpose(-1, -2)
            pad = torch.zeros(*v.shape[:-1], 7, device=device, dtype=dtype)
            out = F.scaled_dot_product_attention(q, k, torch.cat([v * s, s.expand(*v.shape[:-1], 1), pad], -1))
            return out[..., :-8] / out[..., -8:-7]

        head = channels // heads

        def folded_keys():
            # q.k scale + log s = [q, 1/scale].[k, log s] scale: one more query and key channel (its query side
            # constant), padded with the values to a multiple of 8 channels so that the flash kernels take it
            pad = torch.zeros(*q.shape[:-1], 7, device=device, dtype=dtype)
            query = torch.cat([q, torch.full_like(q[..., :1], head ** 0.5), pad], -1)
            key = torch.cat([k, bias.transpose(-1, -2).expand(*k.shape[:-1], 1), pad], -1)
            value = torch.cat([v, pad, pad[..., :1]], -1)
            return F.scaled_dot_product_attention(query, key, value, scale=head ** -0.5)[..., :head]

        attention = {
            "attention plain": lambda: F.scaled_dot_product_attention(q, k, v),
            "attention, size bias as mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
            "attention, size bias folded into values": folded,
            "attention, size bias folded into queries and keys": folded_keys,
        }
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def on(backend, fn):
            def run():
                with sdpa_kernel([backend]):
                    return fn()
            return run

        for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            for what in ("attention plain", "attention, size bias as mask", "attention, size bias folded into queries and keys"):
                try:
                    on(backend, attention[what])()
                    attention[f"{what}, {name} kernel"] = on(backend, attention[what])
                except Exception as error:  # a kernel that refuses these inputs
                    print(f"{what}, {name} kernel: {type(error).__name__}: {str(error)[:200]}", flush=True)
        rows["attention_ms"] = timed(attention)
        for name, ms in rows["attention_ms"].items():
            print(f"{name:<40} {ms:8.3f} ms", flush=True)
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias.float())
        rows["folded_error"] = float((folded().float() - exact).norm() / exact.norm())
        rows["folded_keys_error"] = float((folded_keys().float() - exact).norm() / exact.norm())
        rows["mask_error"] = float((attention["attention, size bias as mask"]().float() - exact).norm() / exact.norm())
        print("relative error to float32: folded", rows["folded_error"], "folded into keys", rows["folded_keys_error"],
              "mask", rows["mask_error"], flush=True)
    out = os.path.join(os.environ.get("OUT", "/tmp"), f"gpu_match_costs_{case}.json")
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

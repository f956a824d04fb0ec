"""The size bias on the GPU: SDPA with the bias as an additive mask (which moves the call off the flash kernels)
against the bias folded into one more head dimension (``tome_core.adapters.diffusers.sdpa_with_key_bias``, what
size-aware attention runs on CUDA in half precision), and plain SDPA without it, at the merged sizes of
``gpu_speed.py``'s cases; with the largest difference between the two biased results.

    python docs/results/gpu_key_bias.py              # rows to $OUT/gpu_key_bias.json (~20 s on an H100)
    python docs/results/gpu_key_bias.py --dry-run    # the same code on the CPU, small shapes
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F

import gpu_timing as gt
from tome_core.adapters.diffusers import sdpa_with_key_bias

# name: (batch, heads, queries, keys, head width): self-attention of a merged block (keys merged; queries too
# where the arrangement merges them)
CASES = {
    "SD 1.5 1024 px, kv (16,384 queries, 1,024 keys)": (2, 8, 16384, 1024, 40),
    "Flux width 1024 px, tokens (2,048 + 512 text)": (1, 24, 2560, 2560, 128),
    "Wan 1.3B width 480p 81 frames, tokens (16,380)": (1, 12, 16380, 16380, 128),
    "Wan 1.3B width 720p 81 frames, tokens (37,800)": (1, 12, 37800, 37800, 128),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the CPU, float32, shapes cut 16-fold")
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    record = gt.Recorder(os.path.join(os.environ.get("OUT", "/tmp"), "gpu_key_bias.json"),
                         device=gt.device_name(device), torch=torch.__version__, dtype=str(dtype))
    generator = torch.Generator(device).manual_seed(0)
    for name, (batch, heads, queries, keys, width) in CASES.items():
        if args.dry_run:
            queries, keys = max(queries // 16, 8), max(keys // 16, 8)
        draw = lambda *shape: torch.randn(*shape, generator=generator, device=device, dtype=dtype)  # noqa: E731
        q, k, v = draw(batch, heads, queries, width), draw(batch, heads, keys, width), draw(batch, heads, keys, width)
        sizes = torch.randint(1, 5, (batch, 1, keys), generator=generator, device=device)
        bias = torch.log(sizes.to(dtype))[:, None]
        fns = {
            "mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
            "folded": lambda: sdpa_with_key_bias(F.scaled_dot_product_attention, (q, k, v), {}, bias),
            "plain": lambda: F.scaled_dot_product_attention(q, k, v),
        }
        masked, folded = fns["mask"]().float(), fns["folded"]().float()
        difference = ((masked - folded).abs().max() / masked.abs().max()).item()
        times = gt.time_rounds(fns, 1 if args.dry_run else 5, 1 if args.dry_run else 5, device)
        ms = {key: statistics.median(value) for key, value in times.items()}
        record(case=name, shape=[batch, heads, queries, keys, width], ms=ms, mask_over_folded=ms["mask"] / ms["folded"],
               folded_over_plain=ms["folded"] / ms["plain"], max_difference=difference)
        print(f"{name}: mask {ms['mask']:.3f} ms, folded {ms['folded']:.3f} ms, plain {ms['plain']:.3f} ms; "
              f"largest difference {difference:.2e} of the largest output", flush=True)


if __name__ == "__main__":
    main()

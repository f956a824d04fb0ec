"""Paired timing of one ppdiffusers UNet: unpatched vs tome_core vs ppdiffusers' built-in ToMe port.

Runs the three variants in rotating order (A B C, B C A, C A B, ...) on the same model and inputs, so drift
and background load hit all alike, and reports medians and ratios. Random weights, nothing downloaded.

    python -m examples.paddle_benchmark                       # sd15-small, 64x64 latents, batch 2, 3 rounds
    python -m examples.paddle_benchmark --preset tiny --latent 32 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import paddle

import tome_core.paddle as tome
from tome_tools.ppdiffusers_models import build_unet
from tome_tools.presets import unet_config


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sd15-small")
    parser.add_argument("--latent", type=int, default=64, help="latent height and width")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    unet = build_unet(args.preset)
    rng = np.random.default_rng(0)
    sample = paddle.to_tensor(rng.standard_normal((args.batch, 4, args.latent, args.latent)).astype(np.float32))
    width = unet_config(args.preset)["cross_attention_dim"]
    text = paddle.to_tensor(rng.standard_normal((args.batch, 77, width)).astype(np.float32))
    timestep = paddle.to_tensor(500)

    # Both ToMe variants in tomesd's configuration: max_downsample=1, sx=sy=2, use_rand=True, attention only,
    # plain softmax (proportional_attn=False).
    variants = {
        "unpatched": lambda: tome.remove(unet),
        "tome_core": lambda: tome.patch(unet, ratio=args.ratio, max_downsample=1, proportional_attn=False),
        "ppdiffusers": lambda: (tome.remove(unet), tome.PPDIFFUSERS_APPLY_TOME(unet, ratio=args.ratio)),
    }
    names = list(variants)
    times = {name: [] for name in names}

    def run() -> float:
        with paddle.no_grad():
            start = time.perf_counter()
            unet(sample, timestep, text).sample.numpy()
            return time.perf_counter() - start

    load_before = os.getloadavg()[0]
    for name in names:  # warm-up, untimed
        variants[name]()
        run()
    for index in range(args.rounds):
        order = names[index % 3 :] + names[: index % 3]
        for name in order:
            variants[name]()
            times[name].append(run())
    tome.remove(unet)
    load_after = os.getloadavg()[0]

    base = statistics.median(times["unpatched"])
    print(f"{args.preset} UNet, latent {args.latent}x{args.latent}, batch {args.batch}, ratio {args.ratio}, "
          f"{args.rounds} rounds (load average {load_before:.1f} before, {load_after:.1f} after)")
    print("| variant | median s | min s | max s | speedup vs unpatched |")
    print("|---|---|---|---|---|")
    for name in names:
        median = statistics.median(times[name])
        print(f"| {name} | {median:.2f} | {min(times[name]):.2f} | {max(times[name]):.2f} | {base / median:.2f}x |")
    ratio = statistics.median(times["ppdiffusers"]) / statistics.median(times["tome_core"])
    print(f"tome_core vs ppdiffusers built-in: {ratio:.2f}x (>1 means tome_core is faster)")
    return times


if __name__ == "__main__":
    main()

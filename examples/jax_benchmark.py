"""Paired timing of a jitted Flax UNet call with and without ToMe on an SD-shaped UNet (random weights).

Both calls are compiled first; then unpatched (A) and ToMe (B) calls alternate A B A B ..., and the table
shows every pair, the medians and their ratio. Parameters are filled from ``jax.eval_shape`` shapes, so
nothing is downloaded and no slow init runs.

    python -m examples.jax_benchmark                                 # sd15-small, 64x64 latents, batch 2
    python -m examples.jax_benchmark --preset sd15 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import diffusers
import jax
import jax.numpy as jnp
import numpy as np

import tome_core.jax as tome
from tome_tools.flax_models import build_unet

diffusers.utils.logging.set_verbosity_error()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sd15-small")
    parser.add_argument("--size", type=int, default=64, help="latent height and width")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    unet, params = build_unet(args.preset, seed=0)
    rng = np.random.default_rng(0)
    sample = jnp.asarray(rng.standard_normal((args.batch, unet.in_channels, args.size, args.size)), jnp.float32)
    context = jnp.asarray(rng.standard_normal((args.batch, 77, unet.cross_attention_dim)), jnp.float32)
    timesteps = jnp.full((args.batch,), 500, jnp.int32)
    fns, compile_s = {}, {}
    for name, model in (("unpatched", unet), ("ToMe", tome.patch(unet, ratio=args.ratio))):
        fns[name] = jax.jit(lambda p, x, t, c, model=model: model.apply({"params": p}, x, t, c).sample)
        start = time.perf_counter()
        jax.block_until_ready(fns[name](params, sample, timesteps, context))
        compile_s[name] = time.perf_counter() - start

    times = {"unpatched": [], "ToMe": []}
    for _ in range(args.repeats):
        for name in ("unpatched", "ToMe"):
            start = time.perf_counter()
            jax.block_until_ready(fns[name](params, sample, timesteps, context))
            times[name].append(time.perf_counter() - start)

    print(f"{args.preset} UNet, {args.size}x{args.size} latents, batch {args.batch}, ToMe ratio {args.ratio}, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs")
    print(f"compile + first call: unpatched {compile_s['unpatched']:.1f}s, ToMe {compile_s['ToMe']:.1f}s")
    print("| pair | unpatched (s) | ToMe (s) | ratio |")
    print("|---:|---:|---:|---:|")
    for i, (a, b) in enumerate(zip(times["unpatched"], times["ToMe"]), 1):
        print(f"| {i} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
    a, b = statistics.median(times["unpatched"]), statistics.median(times["ToMe"])
    print(f"| median | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
    return {"times": times, "speedup": a / b}


if __name__ == "__main__":
    main()

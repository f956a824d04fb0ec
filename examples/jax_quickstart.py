"""Run a Flax UNet with and without ToMe under jax.jit and print what ToMe did.

Runs anywhere, offline: the UNet has a preset architecture with random weights ("tiny" by default; "sd15" and
"sd15-small" are SD 1.5-shaped), parameters are filled from ``jax.eval_shape`` shapes (no slow init), so the
output is noise but the work is real. Prints the blocks patched, the tokens each level merged, the jitted
call time (after compilation, alternating runs, medians) and how much the output changed.

    python -m examples.jax_quickstart                                   # tiny UNet, 32x32 latents
    python -m examples.jax_quickstart --preset sd15-small --size 64     # SD-shaped, 512x512 images
"""

from __future__ import annotations

import argparse
import statistics
import time

import diffusers
import jax
import jax.numpy as jnp
import numpy as np

import tome_core.jax as tome
from tome_tools.flax_models import build_unet

diffusers.utils.logging.set_verbosity_error()  # diffusers 0.39 warns that its Flax classes are deprecated


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="UNet architecture (tome_tools.presets.UNETS)")
    parser.add_argument("--size", type=int, default=32, help="latent height and width (image size / 8)")
    parser.add_argument("--batch", type=int, default=2, help="batch (2 = one prompt with classifier-free guidance)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3, help="paired timed runs (medians)")
    args = parser.parse_args(argv)

    unet, params = build_unet(args.preset, seed=0)
    patched = tome.patch(unet, ratio=args.ratio)  # a new module; the same params
    rng = np.random.default_rng(0)
    sample = jnp.asarray(rng.standard_normal((args.batch, unet.in_channels, args.size, args.size)), jnp.float32)
    context = jnp.asarray(rng.standard_normal((args.batch, 77, unet.cross_attention_dim)), jnp.float32)
    timesteps = jnp.full((args.batch,), 500, jnp.int32)

    def call(model):
        return jax.jit(lambda p, x, t, c: model.apply({"params": p}, x, t, c).sample)

    plain_fn, tome_fn = call(unet), call(patched)
    with tome.record() as traced:  # stats are collected while jax traces the patched call
        start = time.perf_counter()
        merged = np.asarray(tome_fn(params, sample, timesteps, context))
        compile_tome = time.perf_counter() - start
    start = time.perf_counter()
    plain = np.asarray(plain_fn(params, sample, timesteps, context))
    compile_plain = time.perf_counter() - start

    plain_times, tome_times = [], []
    for _ in range(args.repeats):  # alternate A B A B so drift hits both alike
        plain_times.append(timed(plain_fn, params, sample, timesteps, context))
        tome_times.append(timed(tome_fn, params, sample, timesteps, context))

    blocks = len(tome.block_paths(params))
    [(name, state)] = traced
    print(f"ToMe ratio={args.ratio} on a {args.preset} UNet, {args.size}x{args.size} latents, batch {args.batch}")
    print(f"{name}: {blocks} transformer blocks hooked; in each call these run on fewer tokens:")
    print(state.summary())
    plain_s, tome_s = statistics.median(plain_times), statistics.median(tome_times)
    speedup = plain_s / tome_s
    change = float(np.linalg.norm(merged - plain) / np.linalg.norm(plain))
    print(f"compile: unpatched {compile_plain:.1f}s, ToMe {compile_tome:.1f}s")
    print(f"jitted UNet call: unpatched {plain_s * 1000:.1f} ms, ToMe {tome_s * 1000:.1f} ms"
          f" (median of {args.repeats}) -> speedup {speedup:.2f}x")
    print(f"output change vs unpatched: relative L2 {change:.4f}")
    return {"speedup": speedup, "change": change, "blocks": blocks, "state": state,
            "plain_times": plain_times, "tome_times": tome_times}


if __name__ == "__main__":
    main()

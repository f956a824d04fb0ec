"""Generate with and without ToMe on a ppdiffusers Stable Diffusion pipeline and print what ToMe did.

Runs anywhere, offline: the pipeline has the SD 1.5 UNet architecture at half width ("sd15-small") with
random weights, a narrow VAE and a tiny text encoder, so the image is noise but the work is real. Point
``--model`` at a local ppdiffusers folder to use real weights instead.

    python -m examples.paddle_quickstart               # 512x512, ratio 0.5, 2 steps
    python -m examples.paddle_quickstart --size 256 --steps 4 --preset tiny

After ``import tome_core.paddle``, ``pipe.apply_tome(ratio=0.5)`` / ``pipe.remove_tome()`` run the same code
as ``tome_core.paddle.patch`` / ``remove`` used here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import paddle
from ppdiffusers.models.attention import BasicTransformerBlock

import tome_core.paddle as tome
from tome_tools.ppdiffusers_models import build_pipeline


def generate(pipe, args, steps=None) -> np.ndarray:
    return pipe(
        "a photo of an astronaut riding a horse",
        height=args.size,
        width=args.size,
        num_inference_steps=steps or args.steps,
        guidance_scale=7.5,
        output_type="np",
        generator=paddle.Generator().manual_seed(0),
    ).images


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local ppdiffusers pipeline folder (default: random weights)")
    parser.add_argument("--preset", default="sd15-small", help="UNet architecture when --model is not given")
    parser.add_argument("--size", type=int, default=512, help="image height and width")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=1, help="paired runs for the timing (medians)")
    args = parser.parse_args(argv)

    if args.model:
        from ppdiffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(args.model, local_files_only=True)
    else:
        pipe = build_pipeline("sd", preset=args.preset)
    pipe.set_progress_bar_config(disable=True)

    generate(pipe, args, steps=1)  # warm-up: first calls pay for allocation
    plain_times, tome_times = [], []
    for _ in range(args.repeats):  # alternate A B A B so drift hits both alike
        tome.remove(pipe)
        start = time.perf_counter()
        plain = generate(pipe, args)
        plain_times.append(time.perf_counter() - start)
        pipe.apply_tome(ratio=args.ratio)
        start = time.perf_counter()
        merged = generate(pipe, args)
        tome_times.append(time.perf_counter() - start)

    print(f"ToMe ratio={args.ratio} on a {args.size}x{args.size} ppdiffusers pipeline, {args.steps} steps")
    for model, state in tome.patched_models(pipe):
        blocks = sum(isinstance(m, BasicTransformerBlock) for m in model.sublayers())
        print(f"{type(model).__name__}: {blocks} transformer blocks hooked; in the last call these ran on fewer tokens:")
        print(state.summary())
    speedup = statistics.median(plain_times) / statistics.median(tome_times)
    change = float(np.linalg.norm(merged - plain) / np.linalg.norm(plain))
    print(f"pipeline time: unpatched {statistics.median(plain_times):.2f}s, ToMe {statistics.median(tome_times):.2f}s"
          f" (median of {args.repeats}) -> speedup {speedup:.2f}x")
    print(f"image change vs unpatched: relative L2 {change:.4f}")
    return {"speedup": speedup, "change": change, "models": tome.patched_models(pipe)}


if __name__ == "__main__":
    main()

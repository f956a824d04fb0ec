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

import numpy as np
import paddle

import tome_core.paddle as tome
from tome_tools.ppdiffusers_models import build_pipeline
from tome_tools.paired_runs import paired_runs, print_report, quickstart_parser


def generate(pipe, args, steps=None) -> np.ndarray:
    return pipe("a photo of an astronaut riding a horse", height=args.size, width=args.size, guidance_scale=7.5,
                num_inference_steps=steps or args.steps, output_type="np", generator=paddle.Generator().manual_seed(0)).images


def main(argv=None) -> dict:
    args = quickstart_parser(__doc__, "ppdiffusers", steps=2, repeats=1, ratio=0.5).parse_args(argv)

    if args.model:
        from ppdiffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(args.model, local_files_only=True)
    else:
        pipe = build_pipeline("sd", preset=args.preset)
    pipe.set_progress_bar_config(disable=True)

    generate(pipe, args, steps=1)  # warm-up: first calls pay for allocation
    result = paired_runs(lambda: generate(pipe, args), lambda: pipe.apply_tome(ratio=args.ratio), lambda: tome.remove(pipe), args.repeats)
    title = f"ToMe ratio={args.ratio} on a {args.size}x{args.size} ppdiffusers pipeline, {args.steps} steps"
    print_report(title, tome.patched_models(pipe), result)
    return {**result, "models": tome.patched_models(pipe)}


if __name__ == "__main__":
    main()

"""Generate with and without ToMe on a Stable Diffusion pipeline and print what ToMe did.

Runs anywhere, offline: the pipeline has the SD 1.5 UNet architecture at half width ("sd15-small") with
random weights, a narrow VAE and a tiny text encoder, so the image is noise but the work is real. Point
``--model`` at a local diffusers folder to use real weights instead.

    python -m examples.torch_quickstart                # 512x512, patch(pipe) (the default), 4 steps
    python -m examples.torch_quickstart --ratio 0.5    # ToMe for SD's arrangement (tomesd's), at ratio 0.5
    python -m examples.torch_quickstart --size 256 --steps 2 --preset tiny
"""

from __future__ import annotations

from tome_tools.console import quiet_known_notices

quiet_known_notices()  # before diffusers is imported

import numpy as np
import torch

import tome_core.torch as tome
from tome_tools.diffusers_models import build_pipeline
from tome_tools.paired_runs import paired_runs, print_report, quickstart_parser


def generate(pipe, args, steps=None) -> np.ndarray:
    return pipe("a photo of an astronaut riding a horse", height=args.size, width=args.size, guidance_scale=7.5,
                num_inference_steps=steps or args.steps, output_type="np", generator=torch.Generator().manual_seed(0)).images


def main(argv=None) -> dict:
    ratio_help = "ToMe for SD at this ratio (default: patch(pipe), what users get)"
    args = quickstart_parser(__doc__, "diffusers", steps=4, repeats=3, ratio_help=ratio_help).parse_args(argv)

    if args.model:
        from diffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(args.model, local_files_only=True)
    else:
        pipe = build_pipeline("sd", preset=args.preset)
    pipe.set_progress_bar_config(disable=True)

    generate(pipe, args, steps=1)  # warm-up: first calls pay for allocation
    options = {} if args.ratio is None else {"ratio": args.ratio}
    result = paired_runs(lambda: generate(pipe, args), lambda: tome.patch(pipe, **options), lambda: tome.remove(pipe), args.repeats)
    how = "patch(pipe) (the default)" if args.ratio is None else f"ratio={args.ratio}"
    title = f"ToMe {how} on a {args.size}x{args.size} pipeline, {args.steps} steps"
    print_report(title, tome.patched_models(pipe), result)
    return {**result, "models": tome.patched_models(pipe)}


if __name__ == "__main__":
    main()

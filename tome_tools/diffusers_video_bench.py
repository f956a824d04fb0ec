"""The torch side of the bench's video presets (:mod:`tome_tools.bench_video`): AnimateDiff's UNetMotionModel,
SVD's UNetSpatioTemporalConditionModel and Wan's WanTransformer3DModel built from
:data:`tome_tools.presets.VIDEO_PRESETS`.

Everything but building the model and calling a UNet is shared: the video inputs and metrics are
:class:`tome_tools.bench_video.VideoBench`'s, the methods, the oracle, the timing and a transformer's call
:class:`tome_tools.diffusers_bench.Runner`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from tome_tools.diffusers_bench import Runner as ImageRunner
from tome_tools.diffusers_models import build_video_preset, build_video_transformer
from tome_tools.bench_core import serve_peak_request
from tome_tools.bench_video import VideoBench
from tome_tools.presets import VIDEO_PRESETS


class Runner(VideoBench, ImageRunner):
    """A video UNet or video transformer with random weights (the oracle, the library's own hooks, leaves a
    UNet's temporal blocks alone as the patch does)."""

    def load_unet(self) -> torch.nn.Module:
        """The preset's model: a VIDEO_TRANSFORMERS entry (Wan; zero-initialised output layers given small random
        values, as for the transformer presets) or a video UNet."""
        transformer = VIDEO_PRESETS[self.args.preset].get("transformer")
        if transformer is not None:
            return build_video_transformer(transformer)
        return build_video_preset(self.args.preset)

    def unet_call(self, sample: torch.Tensor, timestep: Any) -> torch.Tensor:
        with torch.no_grad():
            return self.unet(**self.video_kwargs(sample, timestep)).sample


if __name__ == "__main__":
    serve_peak_request(Runner)

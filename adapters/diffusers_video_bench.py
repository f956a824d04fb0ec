"""The torch side of the bench's video presets (:mod:`tome_core.bench_video`): AnimateDiff's UNetMotionModel
and SVD's UNetSpatioTemporalConditionModel built from :data:`tome_core.presets.VIDEO_PRESETS`.

Everything but building the model and calling it is shared: the video inputs and metrics are
:class:`tome_core.bench_video.VideoBench`'s, the methods, the oracle and the timing
:class:`tome_core.adapters.diffusers_bench.Runner`'s.
"""

from __future__ import annotations

from typing import Any, List

import torch

from tome_core import driver
from tome_core.adapters.diffusers import FRAMEWORK
from tome_core.adapters.diffusers_bench import Runner as ImageRunner
from tome_core.adapters.diffusers_models import build_video_preset
from tome_core.bench import serve_peak_request
from tome_core.bench_video import VideoBench


class Runner(VideoBench, ImageRunner):
    """A video UNet with random weights; the oracle slices the spatial blocks only (per frame)."""

    def load_unet(self) -> torch.nn.Module:
        return build_video_preset(self.args.preset)

    def unet_call(self, sample: torch.Tensor, timestep: Any) -> torch.Tensor:
        with torch.no_grad():
            return self.unet(**self.video_kwargs(sample, timestep)).sample

    def oracle_blocks(self) -> List[torch.nn.Module]:
        """The spatial blocks 'ours' merges: temporal blocks (motion modules, SVD's temporal blocks) are left
        out, as the patch leaves them."""
        return [block for block, _ in driver.blocks_of(FRAMEWORK, self.unet)]


if __name__ == "__main__":
    serve_peak_request(Runner)

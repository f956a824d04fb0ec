"""Video UNets (ppdiffusers 0.29): AnimateDiff's UNetMotionModel, SVD's UNetSpatioTemporalConditionModel and the
text-to-video UNet3DConditionModel, and their pipelines, on the tiny random-weight configs of the torch tests.

Spatial transformer blocks merge per frame on their real grid, or across the frames of a chunk
(``frames_per_chunk``); temporal blocks (tokens = frames) are never merged and get no hook. Oracles: the unpatched model, and token counts from the grid (what each attention
layer really receives, recorded by forward pre-hooks that run after ToMe's). The checks themselves are
framework-free and shared with the torch suite (tests/conftest.py ``VideoChecks``).
"""

from __future__ import annotations

import warnings

import numpy as np
import paddle
import pytest

import ppdiffusers
import tome_core.paddle as tome
from tome_core.models import families
from tome_core.adapters.ppdiffusers import FRAMEWORK
from tome_tools.ppdiffusers_models import (
    VIDEO_PIPELINES,
    VIDEO_UNETS,
    build_video_pipeline,
    build_video_unet,
    video_unet_inputs,
)
from tome_tools.presets import video_unet_config


def call(model, frames=4, height=8, width=8, batch=2, seed=1) -> paddle.Tensor:
    with paddle.no_grad():
        return model(**video_unet_inputs(model, frames, height, width, batch=batch, seed=seed)).sample


def hooked(layer) -> bool:
    return bool(layer._forward_pre_hooks or layer._forward_post_hooks)


@pytest.fixture(scope="module")
def checks(video_checks):
    return video_checks(tome, call, lambda model: model.named_sublayers(), hooked, FRAMEWORK)


@pytest.fixture(scope="module", params=VIDEO_UNETS)
def video(request):
    return request.param, build_video_unet(request.param, seed=0)


def test_temporal_table_names_ppdiffusers_classes():
    """ppdiffusers' temporal classes are in the table: its AnimateDiff motion modules and UNet3D's temporal
    transformers are TransformerTemporalModel, SVD's are TransformerSpatioTemporalModel's temporal blocks."""
    from ppdiffusers.models.attention import BasicTransformerBlock, TemporalBasicTransformerBlock
    from ppdiffusers.models.transformer_temporal import TransformerSpatioTemporalModel, TransformerTemporalModel

    for cls in (TransformerTemporalModel, TransformerSpatioTemporalModel, TemporalBasicTransformerBlock):
        assert families.temporal(cls) is not None, cls
    assert families.temporal(TransformerSpatioTemporalModel).children == ("temporal_transformer_blocks",)
    assert families.temporal(ppdiffusers.Transformer2DModel) is None
    assert families.temporal(BasicTransformerBlock) is None
    assert {ppdiffusers.Transformer2DModel.__name__, TransformerSpatioTemporalModel.__name__} <= set(families.GRID_CONTAINERS)


def test_only_spatial_blocks_are_found(video, checks):
    checks.check_blocks_found(video[1])


def test_ratio_zero_is_exact(video):
    kind, model = video
    plain = call(model).numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "merges no tokens"
        tome.patch(model, ratio=0.0)
    try:
        np.testing.assert_array_equal(call(model).numpy(), plain)
    finally:
        tome.remove(model)


@pytest.mark.parametrize("options", [{}, dict(frames_per_chunk=2, frame_ratio=0.5)], ids=["per-frame", "across-frames"])
def test_patch_changes_output_and_remove_is_exact(video, options):
    kind, model = video
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    plain = call(model).numpy()
    tome.patch(model, ratio=0.5, **options)
    try:
        patched = call(model).numpy()
        np.testing.assert_array_equal(call(model).numpy(), patched)
    finally:
        tome.remove(model)
    assert np.isfinite(patched).all()
    assert np.abs(patched - plain).max() > 1e-4
    np.testing.assert_array_equal(call(model).numpy(), plain)
    assert all(np.array_equal(state[k], v.numpy()) for k, v in model.state_dict().items())
    assert not any(hooked(m) for m in model.sublayers(include_self=True))


@pytest.mark.parametrize("max_downsample", [1, 2])
def test_token_counts_spatial_merged_temporal_unchanged(video, checks, max_downsample):
    checks.check_token_counts(video[1], max_downsample)


def test_temporal_blocks_never_merged_when_frames_equal_level_tokens(video, checks):
    checks.check_frames_equal_level_tokens(video[1])


def test_spatial_blocks_get_their_container_grid(video, checks):
    """On a 7x5 latent; SVD on 6x10 (3x5 at level 2): ppdiffusers' UNetSpatioTemporalConditionModel cannot run
    a latent that its downsampling does not divide (it passes no upsample size, unlike diffusers)."""
    kind, model = video
    checks.check_container_grids(model, height=6 if kind == "svd" else 7, width=10 if kind == "svd" else 5)


def test_block_indices_count_spatial_blocks(video, checks):
    checks.check_block_indices(video[1])


def test_animatediff_without_attention_at_full_resolution(checks):
    """AnimateDiff on an SDXL-like UNet (the tiny one with its attention moved to level 2): merged at its
    finest attention level, 2."""
    paddle.seed(0)
    unet = ppdiffusers.UNet2DConditionModel(**video_unet_config(
        "tiny-video-sd", down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    )[1])  # fmt: skip
    model = ppdiffusers.UNetMotionModel.from_unet2d(unet, ppdiffusers.MotionAdapter(**video_unet_config("tiny-animatediff")[1]))
    model.eval()
    checks.check_finest_level_two(model)


def test_motion_adapter_alone_is_refused():
    adapter = ppdiffusers.MotionAdapter(**video_unet_config("tiny-animatediff")[1])
    with pytest.raises(ValueError, match="MotionAdapter: holds only AnimateDiff.s motion modules"):
        tome.patch(adapter, ratio=0.5)


def run_pipeline(pipe, kwargs) -> np.ndarray:
    # ppdiffusers' paddle.Generator().manual_seed re-seeds the global generator it draws from: same noise every run.
    out = pipe(**kwargs, num_frames=4, num_inference_steps=2, output_type="np", generator=paddle.Generator().manual_seed(0))
    return np.asarray(out.frames, dtype=np.float64)  # TextToVideoSDPipeline's "np" frames are uint8


@pytest.mark.parametrize("kind", VIDEO_PIPELINES)
def test_pipeline_end_to_end(kind, checks):
    pipe, kwargs = build_video_pipeline(kind)
    pipe.set_progress_bar_config(disable=True)
    checks.check_pipeline(pipe, lambda pipe: run_pipeline(pipe, kwargs))


# ---------------------------------------------------------------------------------------------------------
# Merging across frames (frames_per_chunk); tests/paddle/test_torch_parity.py checks its outputs against torch's


@pytest.mark.parametrize("frames_per_chunk", [2, 4])
def test_cross_frame_token_counts(video, checks, frames_per_chunk):
    checks.check_cross_frame_token_counts(video[1], frames_per_chunk)


def test_cross_frame_count_must_divide_the_frames(video):
    kind, model = video
    tome.patch(model, ratio=0.5, frames_per_chunk=4)
    try:
        with pytest.raises(ValueError, match="frames_per_chunk=4 must divide the number of frames, but this call has 6"):
            call(model, frames=6)
    finally:
        tome.remove(model)


def test_cross_frame_pipeline(checks):
    pipe, kwargs = build_video_pipeline("animatediff")
    pipe.set_progress_bar_config(disable=True)
    checks.check_pipeline(pipe, lambda pipe: run_pipeline(pipe, kwargs), frames_per_chunk=2)

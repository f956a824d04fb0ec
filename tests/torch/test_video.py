"""Video UNets (diffusers): AnimateDiff's UNetMotionModel, SVD's UNetSpatioTemporalConditionModel and the
text-to-video UNet3DConditionModel, and their pipelines, on tiny random-weight configs.

Spatial transformer blocks merge per frame on their real grid; temporal blocks (tokens = frames) are never
merged and get no hook. Oracles: the unpatched model, and token counts from the grid (what each attention
module really receives, recorded by forward pre-hooks that run after ToMe's)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import diffusers
import tome_core.torch as tome
from tome_core.models import families
from tome_core.adapters.diffusers import FRAMEWORK
from tome_tools.diffusers_models import (
    VIDEO_PIPELINES, VIDEO_UNETS, build_video_pipeline, build_video_transformer, build_video_unet, video_transformer_inputs,
    video_unet_inputs,
)
from tome_tools.presets import VIDEO_TRANSFORMERS, video_unet_config

def call(model, frames=4, height=8, width=8, batch=2, seed=1):
    with torch.no_grad():
        return model(**video_unet_inputs(model, frames, height, width, batch=batch, seed=seed)).sample


def hooked(module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks)


@pytest.fixture(scope="module")
def checks(video_checks):
    return video_checks(tome, call, lambda model: model.named_modules(), hooked, FRAMEWORK)


@pytest.fixture(scope="module", params=VIDEO_UNETS)
def video(request):
    return request.param, build_video_unet(request.param, seed=0)


def test_temporal_table_names_real_classes(checks):
    """The table names classes that exist in diffusers 0.42 (ppdiffusers' names are the same, checked in the
    paddle suite's environment); spatial containers give grids."""
    for name in ("TransformerTemporalModel", "TransformerSpatioTemporalModel"):
        assert families.temporal(getattr(diffusers.models.transformers.transformer_temporal, name)) is not None
    from diffusers.models.attention import FreeNoiseTransformerBlock, TemporalBasicTransformerBlock
    from diffusers.models.unets.unet_i2vgen_xl import I2VGenXLTransformerTemporalEncoder
    from diffusers.models.unets.unet_motion_model import AnimateDiffTransformer3D

    for cls in (AnimateDiffTransformer3D, TemporalBasicTransformerBlock, FreeNoiseTransformerBlock, I2VGenXLTransformerTemporalEncoder):
        assert families.temporal(cls) is not None
    assert families.temporal(diffusers.Transformer2DModel) is None
    assert families.temporal(diffusers.models.attention.BasicTransformerBlock) is None
    assert set(checks.SPATIAL_CONTAINERS) <= set(families.GRID_CONTAINERS)
    from diffusers.models.transformers import transformer_2d_dreamlite, transformer_temporal

    known = (diffusers.models, transformer_temporal, transformer_2d_dreamlite)
    assert all(any(isinstance(getattr(where, name, None), type) for where in known) for name in families.GRID_CONTAINERS)


def test_only_spatial_blocks_are_found(video, checks):
    checks.check_blocks_found(video[1])


def test_ratio_zero_is_exact(video):
    kind, model = video
    plain = call(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "merges no tokens"
        tome.patch(model, ratio=0.0)
    try:
        assert torch.equal(call(model), plain)
    finally:
        tome.remove(model)


def test_patch_changes_output_and_remove_is_exact(video):
    kind, model = video
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plain = call(model)
    tome.patch(model, ratio=0.5)
    try:
        patched = call(model)
        assert torch.equal(call(model), patched)
    finally:
        tome.remove(model)
    assert torch.isfinite(patched).all()
    assert (patched - plain).abs().max() > 1e-4
    assert torch.equal(call(model), plain)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("max_downsample", [1, 2])
def test_token_counts_spatial_merged_temporal_unchanged(video, checks, max_downsample):
    checks.check_token_counts(video[1], max_downsample)


def test_temporal_blocks_never_merged_when_frames_equal_level_tokens(video, checks):
    checks.check_frames_equal_level_tokens(video[1])


def test_spatial_blocks_get_their_container_grid(video, checks):
    checks.check_container_grids(video[1])


def test_block_indices_count_spatial_blocks(video, checks):
    checks.check_block_indices(video[1])


def test_animatediff_without_attention_at_full_resolution(checks):
    """AnimateDiff on an SDXL-like UNet (the tiny one with its attention moved to level 2): merged at its
    finest attention level, 2."""
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**video_unet_config(
        "tiny-video-sd", down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    )[1])  # fmt: skip
    model = diffusers.UNetMotionModel.from_unet2d(unet, diffusers.MotionAdapter(**video_unet_config("tiny-animatediff")[1]))
    checks.check_finest_level_two(model.eval())


def test_motion_adapter_alone_is_refused():
    adapter = diffusers.MotionAdapter(**video_unet_config("tiny-animatediff")[1])
    with pytest.raises(ValueError, match="MotionAdapter: holds only AnimateDiff's motion modules, whose tokens are frames"):
        tome.patch(adapter, ratio=0.5)


def run_pipeline(pipe, kwargs):
    out = pipe(**kwargs, num_frames=4, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0))
    return np.asarray(out.frames)


@pytest.mark.parametrize("kind", VIDEO_PIPELINES)
def test_pipeline_end_to_end(kind, checks):
    pipe, kwargs = build_video_pipeline(kind)
    pipe.set_progress_bar_config(disable=True)
    checks.check_pipeline(pipe, lambda pipe: run_pipeline(pipe, kwargs))


# ---------------------------------------------------------------------------------------------------------
# Merging across frames (frames_per_chunk; VidToMe's arrangement)


@pytest.mark.parametrize("frames_per_chunk", [2, 4])
def test_cross_frame_token_counts(video, checks, frames_per_chunk):
    checks.check_cross_frame_token_counts(video[1], frames_per_chunk)


def test_cross_frame_changes_output_remove_is_exact_and_nothing_merged_is_exact(video):
    kind, model = video
    plain = call(model)
    tome.patch(model, ratio=0.5)
    per_frame = call(model)
    tome.patch(model, ratio=0.5, frames_per_chunk=2, frame_ratio=0.5)
    try:
        across = call(model)
        assert torch.equal(call(model), across)
        assert "chunks of 2 frames" in tome.patched_models(model)[0].state.summary()
    finally:
        tome.remove(model)
    assert torch.isfinite(across).all()
    assert (across - plain).abs().max() > 1e-4 and (across - per_frame).abs().max() > 1e-4
    assert torch.equal(call(model), plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ratio 0 still merges across frames: no "merges no tokens" warning
        tome.patch(model, ratio=0.0, frames_per_chunk=2)
    tome.remove(model)
    with pytest.warns(UserWarning, match="merges no tokens"):
        tome.patch(model, ratio=0.0, frames_per_chunk=2, frame_ratio=0.0)
    try:
        assert torch.equal(call(model), plain)
    finally:
        tome.remove(model)


def test_identical_frames_give_each_frame_its_single_frame_output():
    """AnimateDiff with its motion modules reduced to the identity (output projections zeroed, so frames stay
    identical through the UNet): with every other-frame token merged, a video of 4 identical frames gives, in
    every frame, the output of that frame as a one-frame video merged on its own (same ratio and partition)."""
    model = build_video_unet("animatediff", seed=0)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("proj_out") and "motion_modules" in name:
                module.weight.zero_()
                module.bias.zero_()
    one = video_unet_inputs(model, 1, 8, 8, batch=2, seed=3)
    four = dict(one, sample=one["sample"].repeat(1, 1, 4, 1, 1), encoder_hidden_states=one["encoder_hidden_states"].repeat_interleave(4, dim=0))
    tome.patch(model, ratio=0.5)
    with torch.no_grad():
        single = model(**one).sample
    tome.patch(model, ratio=0.5, frames_per_chunk=4, frame_ratio=1.0)
    with torch.no_grad():
        video = model(**four).sample
        tome.remove(model)
        plain = model(**four).sample
    assert (video - plain).abs().max() > 1e-4  # it merged
    for frame in range(4):
        torch.testing.assert_close(video[:, :, frame], single[:, :, 0], rtol=1e-4, atol=1e-5)


def test_cross_frame_errors():
    """The frame count must split into chunks (said at the call: only calls know it); image UNets and options
    that cannot run across frames are refused at patch."""
    model = build_video_unet("animatediff", seed=0)
    tome.patch(model, ratio=0.5, frames_per_chunk=4)
    try:
        with pytest.raises(ValueError, match=r"frames_per_chunk=4 must divide the number of frames, but this call has 6 frames.*1, 2, 3, 6"):
            call(model, frames=6)
    finally:
        tome.remove(model)
    from tome_tools.diffusers_models import build_unet

    with pytest.raises(ValueError, match="frames_per_chunk=2 merges across the frames of a video model"):
        tome.patch(build_unet("tiny"), ratio=0.5, frames_per_chunk=2)
    with pytest.raises(ValueError, match="frames_per_chunk=2 cannot be combined with mode='kv'"):
        tome.patch(model, frames_per_chunk=2, mode="kv")
    assert not tome.patched_models(model)


def test_cross_frame_pipeline(checks):
    pipe, kwargs = build_video_pipeline("animatediff")
    pipe.set_progress_bar_config(disable=True)
    checks.check_pipeline(pipe, lambda pipe: run_pipeline(pipe, kwargs), frames_per_chunk=2)


@pytest.mark.parametrize("preset", [name for name in VIDEO_TRANSFORMERS if name.startswith("tiny-")])
def test_every_video_transformer_preset_gets_a_call_that_merges_and_removes_exactly(preset):
    """``video_transformer_inputs`` builds a valid call for every tiny video transformer (the benchmark's and
    the parallel tests' inputs): patched, its output changes a little and its summary counts merged tokens;
    removed, it is the unpatched output again."""
    model = build_video_transformer(preset)
    inputs = video_transformer_inputs(model, 2, 8, 8, batch=2)

    def call():
        with torch.no_grad():
            return model(**inputs, return_dict=False)[0]

    reference = call()
    tome.patch(model)
    merged = call()
    summary = tome.patched_models(model)[0].state.summary()
    tome.remove(model)
    assert "% merged" in summary, summary
    assert merged.shape == reference.shape and torch.isfinite(merged).all()
    assert 0 < float((merged - reference).norm() / reference.norm()) < 0.5
    torch.testing.assert_close(call(), reference, rtol=0, atol=0)

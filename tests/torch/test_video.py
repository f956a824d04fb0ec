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
from tome_core import driver, families
from tome_core.adapters.diffusers import FRAMEWORK, finest_level
from tome_core.adapters.diffusers_models import VIDEO_PIPELINES, VIDEO_UNETS, build_video_pipeline, build_video_unet, video_unet_inputs

# Where the temporal layers of these UNets live (module names): motion modules (AnimateDiff), temporal
# transformers (UNet3D), SVD's temporal blocks. Independent of the driver's class table.
TEMPORAL_NAMES = ("motion_modules", "temp_attentions", "transformer_in", "temporal_transformer_blocks")
SPATIAL_CONTAINERS = ("Transformer2DModel", "TransformerSpatioTemporalModel")


def is_temporal(name: str) -> bool:
    return any(part in TEMPORAL_NAMES for part in name.split("."))


@pytest.fixture(scope="module", params=VIDEO_UNETS)
def video(request):
    return request.param, build_video_unet(request.param, seed=0)


def call(model, frames=4, hw=8, batch=2, seed=1):
    with torch.no_grad():
        return model(**video_unet_inputs(model, frames, hw, hw, batch=batch, seed=seed)).sample


def record_attention(model):
    """``{name: [shape, ...]}`` of the hidden states every attention module (attn1/attn2) receives."""
    seen, handles = {}, []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("attn1", "attn2"):
            hook = lambda m, args, kwargs, name=name: seen.setdefault(name, []).append(
                tuple((args[0] if args else kwargs["hidden_states"]).shape)
            )
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


def observe(model, ratio, frames, hw, **options):
    """Shapes seen by each attention, unpatched and patched (the model is left unpatched)."""
    plain, handles = record_attention(model)
    try:
        call(model, frames, hw)
    finally:
        for handle in handles:
            handle.remove()
    tome.patch(model, ratio=ratio, **options)
    patched, handles = record_attention(model)  # after ToMe's hooks: they see the merged inputs
    try:
        call(model, frames, hw)
        stats = dict(tome.patched_models(model)[0].state.stats)
    finally:
        tome.remove(model)
        for handle in handles:
            handle.remove()
    return plain, patched, stats


def test_temporal_table_names_real_classes():
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
    assert set(families.GRID_CONTAINERS) == set(SPATIAL_CONTAINERS)


def test_only_spatial_blocks_are_found(video):
    kind, model = video
    names = {id(m): n for n, m in model.named_modules()}
    found = [names[id(block)] for block, _ in driver.blocks_of(FRAMEWORK, model)]
    spatial = [
        n for n, m in model.named_modules()
        if type(m).__name__ == "BasicTransformerBlock" and not is_temporal(n)
    ]
    assert found == spatial and len(spatial) == 4  # down, mid, 2 up at the attention levels
    temporal = [n for n, m in model.named_modules() if n.endswith("attn1") and is_temporal(n)]
    assert temporal  # the model has temporal attention, and none of it is in a found block
    assert not any(t.startswith(f + ".") for t in temporal for f in found)
    assert finest_level(model) == 1
    assert driver.find_models(FRAMEWORK, model) == [model]


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
def test_token_counts_spatial_merged_temporal_unchanged(video, max_downsample):
    """Spatial self-attention sees N - int(N * ratio) per frame at the merged levels (N from the grid the
    unpatched model gives it); every temporal attention sees exactly the frame count, as unpatched."""
    kind, model = video
    frames, hw, ratio = 4, 8, 0.5
    plain, patched, stats = observe(model, ratio, frames, hw, max_downsample=max_downsample)
    merged_levels = {1: 64, 2: 16}
    spatial_level_blocks = {}
    for name, shapes in plain.items():
        assert patched[name][0][0] == shapes[0][0]  # batch dims unchanged
        if is_temporal(name):
            assert all(shape[1] == frames for shape in shapes + patched[name]), name
            continue
        tokens = shapes[0][1]
        assert shapes[0][0] == 2 * frames  # (batch * frames) sequences, one per frame
        level = {64: 1, 16: 2}[tokens]
        if name.endswith("attn1") and level <= max_downsample:
            assert patched[name][0][1] == tokens - int(tokens * ratio), name
            spatial_level_blocks[level] = spatial_level_blocks.get(level, 0) + 1
        elif name.endswith("attn2"):
            assert patched[name][0][1] == tokens, name  # merge_crossattn=False by default
        else:
            assert patched[name][0][1] == tokens, name
    # stats count spatial blocks only
    assert {level: (s.blocks, s.tokens, s.kept) for level, s in stats.items()} == {
        level: (count, merged_levels[level], merged_levels[level] // 2) for level, count in spatial_level_blocks.items()
    }


def test_temporal_blocks_never_merged_when_frames_equal_level_tokens(video):
    """Regression: a 4x4 latent (16 tokens at level 1) with 16 frames (16 tokens per temporal sequence), and
    max_downsample=2 where the 2x2 level has 4 tokens: temporal attention stays at 16 frames."""
    kind, model = video
    frames, hw = 16, 4
    plain, patched, stats = observe(model, 0.5, frames, hw, max_downsample=2)
    temporal = [name for name in plain if is_temporal(name)]
    assert temporal
    for name in temporal:
        assert plain[name] == patched[name], name
        assert all(shape[1] == frames for shape in patched[name])
    for name in plain:
        if not is_temporal(name) and name.endswith("attn1"):
            tokens = plain[name][0][1]
            assert patched[name][0][1] == tokens - tokens // 2
    assert {level: s.blocks for level, s in stats.items()} == {1: 3, 2: 1}  # spatial blocks only
    # and the temporal blocks carry no hook while patched
    tome.patch(model, ratio=0.5, max_downsample=2)
    try:
        hooked = [n for n, m in model.named_modules() if is_temporal(n) and (m._forward_pre_hooks or m._forward_hooks)]
        assert hooked == []
    finally:
        tome.remove(model)


def test_spatial_blocks_get_their_container_grid(video):
    """Each spatial block's grid is its container's 4-D input (batch * frames, C, H, W), also on a
    non-square odd latent."""
    kind, model = video
    frames, hw = 3, 7
    tome.patch(model, ratio=0.5, max_downsample=2)
    state = tome.patched_models(model)[0].state
    last, seen, handles = {}, [], []
    try:
        for name, module in model.named_modules():
            if type(module).__name__ in SPATIAL_CONTAINERS:
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs: last.update(grid=tuple((args[0] if args else kwargs["hidden_states"]).shape[-2:]))
                    , with_kwargs=True))
            elif name.endswith("attn1") and not is_temporal(name):
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs: seen.append((state.grid_hw, last["grid"], args[0].shape[0]))
                    if args else None, with_kwargs=True))
        with torch.no_grad():
            model(**video_unet_inputs(model, frames, hw, 5, batch=1))
    finally:
        tome.remove(model)
        for handle in handles:
            handle.remove()
    assert len(seen) == 4
    assert all(grid == container for grid, container, _ in seen)
    assert {grid for grid, _, _ in seen} == {(7, 5), (4, 3)}
    assert all(rows == frames for _, _, rows in seen)


def test_block_indices_count_spatial_blocks(video):
    kind, model = video
    plain, patched, stats = observe(model, 0.5, 4, 8, blocks=[0])
    merged = [n for n in plain if n.endswith("attn1") and patched[n][0][1] != plain[n][0][1]]
    assert len(merged) == 1 and not is_temporal(merged[0])
    with pytest.raises(ValueError, match="index 4 is out of range"):
        tome.patch(model, ratio=0.5, blocks=[4])


def test_animatediff_without_attention_at_full_resolution():
    """AnimateDiff on an SDXL-like UNet (no spatial attention at full resolution, motion modules everywhere):
    the finest attention level is 2, so max_downsample=None merges there; motion modules do not count."""
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1, cross_attention_dim=32,
        attention_head_dim=8, sample_size=8,
    )
    adapter = diffusers.MotionAdapter(block_out_channels=(32, 64), motion_layers_per_block=1, motion_num_attention_heads=2)
    model = diffusers.UNetMotionModel.from_unet2d(unet, adapter).eval()
    assert finest_level(model) == 2
    plain, patched, stats = observe(model, 0.5, 16, 8, max_downsample=None)  # 16 frames = 16 tokens at level 2
    assert {level: (s.blocks, s.tokens, s.kept) for level, s in stats.items()} == {2: (4, 16, 8)}
    for name in plain:
        if is_temporal(name):
            assert plain[name] == patched[name]


def test_motion_adapter_alone_is_refused():
    adapter = diffusers.MotionAdapter(block_out_channels=(32, 64), motion_layers_per_block=1, motion_num_attention_heads=2)
    with pytest.raises(ValueError, match="temporal layers"):
        tome.patch(adapter, ratio=0.5)


def run_pipeline(pipe, kwargs):
    out = pipe(**kwargs, num_frames=4, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0))
    return np.asarray(out.frames)


@pytest.mark.parametrize("kind", VIDEO_PIPELINES)
def test_pipeline_end_to_end(kind):
    pipe, kwargs = build_video_pipeline(kind)
    pipe.set_progress_bar_config(disable=True)
    plain = run_pipeline(pipe, kwargs)
    tome.patch(pipe, ratio=0.5)
    assert [type(p.model).__name__ for p in tome.patched_models(pipe)] == [type(pipe.unet).__name__]  # not the MotionAdapter
    patched = run_pipeline(pipe, kwargs)
    assert np.isfinite(patched).all()
    assert np.abs(patched - plain).max() > 1e-4
    np.testing.assert_array_equal(run_pipeline(pipe, kwargs), patched)
    stats = tome.patched_models(pipe)[0].state.stats
    assert {level: (s.blocks, s.tokens, s.kept) for level, s in stats.items()} == {1: (3, 64, 32)}
    tome.remove(pipe)
    np.testing.assert_array_equal(run_pipeline(pipe, kwargs), plain)

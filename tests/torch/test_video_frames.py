"""Merging across frames in video UNets (``frames_per_chunk``, VidToMe's arrangement), on diffusers' tiny
random-weight video UNets and AnimateDiff's pipeline. Oracles: the unpatched model, per-frame merging, the
token counts a chunk must leave (what each attention module really receives), and a one-frame video merged on
its own for a video of identical frames."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import tome_core.torch as tome
from tome_core.adapters.diffusers_models import build_video_pipeline, build_video_unet, video_unet_inputs

from tome_core.adapters.diffusers_models import VIDEO_UNETS

TEMPORAL_NAMES = ("motion_modules", "temp_attentions", "transformer_in", "temporal_transformer_blocks")


def is_temporal(name: str) -> bool:
    return any(part in TEMPORAL_NAMES for part in name.split("."))


@pytest.fixture(scope="module", params=VIDEO_UNETS)
def video(request):
    return request.param, build_video_unet(request.param, seed=0)


def call(model, frames=4, hw=8, batch=2, seed=1):
    with torch.no_grad():
        return model(**video_unet_inputs(model, frames, hw, hw, batch=batch, seed=seed)).sample


def observe(model, ratio, frames, hw, **options):
    """Shapes of the hidden states each attention module receives, unpatched and patched (pre-hooks registered
    after ToMe's), and the patch's statistics; the model is left unpatched."""
    shapes = []
    for patched in (False, True):
        if patched:
            tome.patch(model, ratio=ratio, **options)
        seen, handles = {}, []
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("attn1", "attn2"):
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs, name=name: seen.setdefault(name, []).append(
                        tuple((args[0] if args else kwargs["hidden_states"]).shape)), with_kwargs=True))
        try:
            call(model, frames, hw)
            stats = dict(tome.patched_models(model)[0].state.stats) if patched else None
        finally:
            tome.remove(model)
            for handle in handles:
                handle.remove()
        shapes.append(seen)
    return shapes[0], shapes[1], stats


def run_pipeline(pipe, kwargs):
    out = pipe(**kwargs, num_frames=4, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0))
    return np.asarray(out.frames)


def chunk_tokens(frames_per_chunk, tokens, ratio, frame_ratio=0.9):
    """Tokens a chunk's self-attention sees: the other frames' unmerged tokens and the reference frame's."""
    other = (frames_per_chunk - 1) * tokens
    return other - int(other * frame_ratio) + tokens - int(tokens * ratio)


@pytest.mark.parametrize("frames_per_chunk", [2, 4])
def test_cross_frame_token_counts(video, frames_per_chunk):
    """Spatial self-attention runs once per chunk, on the merged tokens of its frames; cross-attention keeps
    one sequence per frame; temporal attention is untouched."""
    kind, model = video
    frames, hw, ratio = 4, 8, 0.5
    plain, patched, stats = observe(model, ratio, frames, hw, frames_per_chunk=frames_per_chunk)
    for name, shapes in plain.items():
        if is_temporal(name) or name.endswith("attn2") or shapes[0][1] != 64:
            assert patched[name] == shapes, name
        else:
            assert patched[name][0][:2] == (2 * frames // frames_per_chunk, chunk_tokens(frames_per_chunk, 64, ratio)), name
    kept = chunk_tokens(frames_per_chunk, 64, ratio)
    assert {level: (s.blocks, s.tokens, s.kept, s.frames) for level, s in stats.items()} == {1: (3, 64 * frames_per_chunk, kept, frames_per_chunk)}


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
    from tome_core.adapters.diffusers_models import build_unet

    with pytest.raises(ValueError, match="frames_per_chunk=2 merges across the frames of a video model"):
        tome.patch(build_unet("tiny"), ratio=0.5, frames_per_chunk=2)
    with pytest.raises(ValueError, match="frames_per_chunk=2 cannot be combined with mode='kv'"):
        tome.patch(model, frames_per_chunk=2, mode="kv")
    assert not tome.patched_models(model)


def test_cross_frame_pipeline():
    pipe, kwargs = build_video_pipeline("animatediff")
    pipe.set_progress_bar_config(disable=True)
    plain = run_pipeline(pipe, kwargs)
    tome.patch(pipe, ratio=0.5, frames_per_chunk=2)
    patched = run_pipeline(pipe, kwargs)
    assert np.isfinite(patched).all() and np.abs(patched - plain).max() > 1e-4
    np.testing.assert_array_equal(run_pipeline(pipe, kwargs), patched)
    tome.remove(pipe)
    np.testing.assert_array_equal(run_pipeline(pipe, kwargs), plain)

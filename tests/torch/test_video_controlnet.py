"""AnimateDiff with a ControlNet (diffusers' ``AnimateDiffControlNetPipeline``) and with SparseCtrl
(``AnimateDiffSparseControlNetPipeline``), on tiny random-weight models (8x8 latents, 4 frames, 2 steps).

``tome.patch(pipe)`` patches the motion UNet and the ControlNet. What each ControlNet is given decides how it
merges:

- the image ``ControlNetModel`` is called on the frames as a batch (a 4-D sample ``[batch * frames, C, H, W]``):
  it cannot know the frame count, so its spatial blocks merge per frame, also with ``frames_per_chunk``;
- ``SparseControlNetModel`` is called on the 5-D video latent ``[batch, C, frames, H, W]``: like the UNet, it
  merges per frame, or across chunks of frames with ``frames_per_chunk``; its motion modules (tokens = frames)
  are never merged and carry no hook.

Oracles: the unpatched pipeline, and the shapes every attention module receives (forward pre-hooks registered
after ToMe's, so they see the merged inputs) against the counts the 8x8 grid gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tome_core.torch as tome
from tome_tools.diffusers_models import VIDEO_CONTROLNET_PIPELINES, build_video_controlnet, build_video_controlnet_pipeline

FRAMES, TOKENS = 4, 64  # 16x16 pixels: an 8x8 latent, 64 tokens per frame at level 1
CONTROLNETS = {"animatediff-controlnet": "ControlNetModel", "animatediff-sparsectrl": "SparseControlNetModel"}
# how many consecutive frames one sequence of the ControlNet's spatial self-attention holds with frames_per_chunk
# (the image ControlNet gets a 4-D sample and merges per frame; SparseCtrl gets the 5-D video latent)
CONTROLNET_CHUNKS = {"animatediff-controlnet": lambda fpc: 1, "animatediff-sparsectrl": lambda fpc: fpc}


@pytest.fixture(scope="module", params=VIDEO_CONTROLNET_PIPELINES)
def pipeline(request):
    pipe, kwargs = build_video_controlnet_pipeline(request.param)
    pipe.set_progress_bar_config(disable=True)
    return request.param, pipe, kwargs


def run(pipe, kwargs):
    """The frames of a seeded 2-step call (numpy). SparseCtrl's pipeline samples its VAE-encoded key frames from
    torch's global generator: seeded here too."""
    torch.manual_seed(0)
    out = pipe(**kwargs, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0))
    return np.asarray(out.frames)


def hooked(module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks)


def record_attention(models):
    """``{(model index, name): [shape, ...]}`` of the hidden states every attention module (attn1/attn2) of
    ``models`` receives, and the hook handles."""
    seen, handles = {}, []
    for index, model in enumerate(models):
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("attn1", "attn2"):

                def hook(module, args, kwargs, key=(index, name)):
                    seen.setdefault(key, []).append(tuple((args[0] if args else kwargs["hidden_states"]).shape))

                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


def observe(pipe, kwargs, **options):
    """Shapes seen by every attention of the UNet and the ControlNet, unpatched and patched at ratio 0.5 (with
    ``options``), the patched models' stats by class name, and the modules of temporal layers that carried a
    hook while patched (the pipeline is left unpatched)."""
    models = [pipe.unet, pipe.controlnet]
    plain, handles = record_attention(models)
    try:
        run(pipe, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    tome.patch(pipe, ratio=0.5, **options)
    try:
        temporal_hooked = [
            name for model in models for name, module in model.named_modules() if is_temporal(name) and hooked(module)
        ]
        patched, handles = record_attention(models)  # after ToMe's hooks: they see the merged inputs
        try:
            run(pipe, kwargs)
        finally:
            for handle in handles:
                handle.remove()
        stats = {type(p.model).__name__: dict(p.state.ledger.stats) for p in tome.patched_models(pipe)}
    finally:
        tome.remove(pipe)
    return plain, patched, stats, temporal_hooked


def is_temporal(name: str) -> bool:
    return "motion_modules" in name.split(".")


def test_builders(pipeline):
    kind, pipe, kwargs = pipeline
    assert type(pipe).__name__ == {"animatediff-controlnet": "AnimateDiffControlNetPipeline", "animatediff-sparsectrl": "AnimateDiffSparseControlNetPipeline"}[kind]
    assert type(pipe.controlnet).__name__ == CONTROLNETS[kind]
    outputs = list(pipe.controlnet.controlnet_down_blocks) + [pipe.controlnet.controlnet_mid_block]
    assert all(conv.weight.abs().min() > 0 for conv in outputs)  # zero convolutions randomized
    temporal = [name for name, _ in pipe.controlnet.named_modules() if is_temporal(name) and name.endswith("attn1")]
    assert bool(temporal) == (kind == "animatediff-sparsectrl")  # SparseCtrl has motion modules
    with pytest.raises(ValueError, match="kind must be one of"):
        build_video_controlnet("controlnet")


def test_patch_finds_unet_and_controlnet(pipeline):
    kind, pipe, _ = pipeline
    tome.patch(pipe, ratio=0.5)
    try:
        patched = tome.patched_models(pipe)
        assert [p.model for p in patched] == [pipe.unet, pipe.controlnet]
        assert [type(p.model).__name__ for p in patched] == ["UNetMotionModel", CONTROLNETS[kind]]
    finally:
        tome.remove(pipe)
    assert not tome.patched_models(pipe)


def test_patched_pipeline_changes_output_and_remove_is_exact(pipeline):
    kind, pipe, kwargs = pipeline
    state = {k: v.clone() for k, v in pipe.controlnet.state_dict().items()}
    plain = run(pipe, kwargs)
    np.testing.assert_array_equal(run(pipe, kwargs), plain)  # the pipeline repeats itself unpatched
    tome.patch(pipe, ratio=0.5)
    try:
        patched = run(pipe, kwargs)
        np.testing.assert_array_equal(run(pipe, kwargs), patched)
    finally:
        tome.remove(pipe)
    assert np.isfinite(patched).all()
    assert np.abs(patched - plain).max() > 1e-4
    np.testing.assert_array_equal(run(pipe, kwargs), plain)
    assert all(torch.equal(state[k], v) for k, v in pipe.controlnet.state_dict().items())
    assert not any(hooked(m) for model in (pipe.unet, pipe.controlnet) for m in model.modules())


def test_merging_in_the_controlnet_alone_reaches_the_video(pipeline):
    """Only the ControlNet patched: its merged blocks change the video (its output convolutions are not zero)."""
    kind, pipe, kwargs = pipeline
    plain = run(pipe, kwargs)
    tome.patch(pipe.controlnet, ratio=0.5)
    try:
        assert [type(p.model).__name__ for p in tome.patched_models(pipe)] == [CONTROLNETS[kind]]
        patched = run(pipe, kwargs)
    finally:
        tome.remove(pipe)
    assert np.isfinite(patched).all() and np.abs(patched - plain).max() > 1e-4
    np.testing.assert_array_equal(run(pipe, kwargs), plain)


@pytest.mark.parametrize("frames_per_chunk", [1, 2, 4])
def test_token_counts(pipeline, video_checks, frames_per_chunk):
    """Spatial self-attention at level 1 (64 tokens per frame) sees per frame 32 tokens, or per chunk of frames
    the chunk's merged tokens; the image ControlNet always merges per frame (its sample is 4-D), SparseCtrl like
    the UNet. Cross-attention, level 2 (the ControlNet's mid block, 16 tokens) and every temporal attention (4
    frames) see what they see unpatched; temporal layers carry no hook. Stats: per patched model, level 1 only."""
    kind, pipe, kwargs = pipeline
    options = {"frames_per_chunk": frames_per_chunk} if frames_per_chunk > 1 else {}
    plain, patched, stats, temporal_hooked = observe(pipe, kwargs, **options)
    chunks = [frames_per_chunk, CONTROLNET_CHUNKS[kind](frames_per_chunk)]  # UNet, ControlNet
    assert temporal_hooked == []
    merged = [0, 0]
    for (index, name), shapes in plain.items():
        chunk = chunks[index]
        if is_temporal(name):
            assert all(shape[1] == FRAMES for shape in shapes), name
        elif name.endswith("attn1") and shapes[0][1] == TOKENS:
            assert shapes[0][0] == 2 * FRAMES  # (CFG batch * frames) sequences, one per frame
            kept = video_checks.chunk_tokens(chunk, TOKENS, 0.5) if chunk > 1 else TOKENS // 2
            assert all(shape[:2] == (2 * FRAMES // chunk, kept) for shape in patched[(index, name)]), (index, name)
            merged[index] += 1
            continue
        assert patched[(index, name)] == shapes, (index, name)
    temporal = [name for index, name in plain if index == 1 and is_temporal(name)]
    assert bool(temporal) == (kind == "animatediff-sparsectrl")
    assert merged == [3, 1]  # the UNet's three level-1 blocks, the ControlNet's one (down block 0)

    def level_stats(blocks, chunk):
        kept = video_checks.chunk_tokens(chunk, TOKENS, 0.5) if chunk > 1 else TOKENS // 2
        return {1: (blocks, TOKENS * chunk, kept, chunk)}

    as_tuples = {model: {level: (s.blocks, s.tokens, s.kept, s.frames) for level, s in levels.items()} for model, levels in stats.items()}
    assert as_tuples == {"UNetMotionModel": level_stats(3, chunks[0]), CONTROLNETS[kind]: level_stats(1, chunks[1])}


def test_cross_frame_pipeline(pipeline):
    """frames_per_chunk=2: finite, differs from unpatched and from per-frame merging, repeats, remove exact; the
    ControlNet's summary says whether it merged across frames."""
    kind, pipe, kwargs = pipeline
    plain = run(pipe, kwargs)
    tome.patch(pipe, ratio=0.5)
    per_frame = run(pipe, kwargs)
    tome.patch(pipe, ratio=0.5, frames_per_chunk=2)
    try:
        across = run(pipe, kwargs)
        np.testing.assert_array_equal(run(pipe, kwargs), across)
        summaries = [p.state.summary() for p in tome.patched_models(pipe)]
    finally:
        tome.remove(pipe)
    assert "chunks of 2 frames" in summaries[0]
    assert ("chunks of 2 frames" in summaries[1]) == (kind == "animatediff-sparsectrl")
    assert np.isfinite(across).all()
    assert np.abs(across - plain).max() > 1e-4 and np.abs(across - per_frame).max() > 1e-4
    np.testing.assert_array_equal(run(pipe, kwargs), plain)


def test_controlnet_patched_alone_with_frames_per_chunk(pipeline):
    """Patched on its own, the image ControlNet (no temporal layers) refuses frames_per_chunk; SparseCtrl takes
    it; a frame count that the chunks do not divide is refused at the call."""
    kind, pipe, kwargs = pipeline
    if kind == "animatediff-controlnet":
        with pytest.raises(ValueError, match="frames_per_chunk=2 merges across the frames of a video model, but ControlNetModel holds no video UNet"):
            tome.patch(pipe.controlnet, ratio=0.5, frames_per_chunk=2)
        assert not tome.patched_models(pipe)
        return
    tome.patch(pipe.controlnet, ratio=0.5, frames_per_chunk=3)
    try:
        with pytest.raises(ValueError, match="frames_per_chunk=3 must divide the number of frames, but this call has 4 frames"):
            run(pipe, kwargs)
    finally:
        tome.remove(pipe)


def sparsectrl_call(model, frames, height, width, batch, seed=1):
    """One seeded call of a SparseControlNetModel on a video latent, key frames at the first and last frame."""
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator)
    config = model.config
    mask = torch.zeros(batch, 1, frames, height, width)
    mask[:, :, [0, frames - 1]] = 1
    with torch.no_grad():
        return model(
            sample=randn(batch, config.in_channels, frames, height, width),
            timestep=torch.tensor(500),
            encoder_hidden_states=randn(batch * frames, 7, config.cross_attention_dim),
            controlnet_cond=randn(batch, config.conditioning_channels, frames, height, width) * mask,
            conditioning_mask=mask,
            return_dict=False,
        )


def test_sparsectrl_temporal_never_merged_when_frames_equal_level_tokens(video_checks):
    """SparseCtrl alone on a 4x4 latent with 16 frames (16 tokens at level 1, 16 frames per motion-module
    sequence) and max_downsample=2 (the mid block's 2x2 level has 4 tokens): motion modules stay at 16 frames
    and carry no hook; the spatial blocks merge (down block 0 and the mid block)."""

    checks = video_checks(tome, sparsectrl_call, lambda model: model.named_modules(), hooked, None)
    model = build_video_controlnet("animatediff-sparsectrl", seed=0)
    frames, hw = 16, 4
    plain, patched, stats = checks.observe(model, 0.5, frames, hw, max_downsample=2)
    temporal = [name for name in plain if is_temporal(name)]
    assert temporal
    for name in temporal:
        assert plain[name] == patched[name] and all(shape[1] == frames for shape in patched[name]), name
    spatial = [name for name in plain if not is_temporal(name) and name.endswith("attn1")]
    assert len(spatial) == 2
    for name in spatial:
        tokens = plain[name][0][1]
        assert patched[name][0][1] == tokens - tokens // 2, name
    assert {level: (s.blocks, s.tokens, s.kept) for level, s in stats.items()} == {1: (1, 16, 8), 2: (1, 4, 2)}
    tome.patch(model, ratio=0.5, max_downsample=2)
    try:
        assert [n for n, m in model.named_modules() if is_temporal(n) and hooked(m)] == []
    finally:
        tome.remove(model)


def test_multi_controlnet(video_checks):
    """Two image ControlNets (diffusers wraps them in a MultiControlNetModel): ToMe patches the UNet and both
    nets; with frames_per_chunk=2 the UNet merges across frames, each ControlNet per frame; remove is exact."""
    import diffusers

    pipe, kwargs = build_video_controlnet_pipeline("animatediff-controlnet")
    parts = {k: v for k, v in pipe.components.items() if k not in ("feature_extractor", "image_encoder")}
    parts["controlnet"] = [pipe.controlnet, build_video_controlnet("animatediff-controlnet", seed=9)]
    multi = diffusers.AnimateDiffControlNetPipeline(**parts)
    multi.set_progress_bar_config(disable=True)
    kwargs = dict(kwargs, conditioning_frames=[kwargs["conditioning_frames"]] * 2, controlnet_conditioning_scale=[1.0, 0.5])
    plain = run(multi, kwargs)
    tome.patch(multi, ratio=0.5, frames_per_chunk=2)
    try:
        across = run(multi, kwargs)
        patched = tome.patched_models(multi)
        assert [p.model for p in patched] == [multi.unet, *multi.controlnet.nets]
        stats = [{level: (s.blocks, s.tokens, s.kept, s.frames) for level, s in p.state.ledger.stats.items()} for p in patched]
    finally:
        tome.remove(multi)
    chunk_kept = video_checks.chunk_tokens(2, TOKENS, 0.5)
    assert stats == [{1: (3, 2 * TOKENS, chunk_kept, 2)}, {1: (1, TOKENS, TOKENS // 2, 1)}, {1: (1, TOKENS, TOKENS // 2, 1)}]
    assert np.isfinite(across).all() and np.abs(across - plain).max() > 1e-4
    np.testing.assert_array_equal(run(multi, kwargs), plain)

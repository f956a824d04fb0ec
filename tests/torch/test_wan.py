"""Wan's video transformer (``WanTransformer3DModel``, diffusers) and ``WanPipeline``, on a tiny random-weight
config: one sequence of frames x height x width tokens with 3-D rotary positions.

ToMe reads the sequence as the frames' token grids stacked in rows (``frames * height`` by ``width``): every
2x2 cell lies in one frame, and a token may merge into a destination of its own frame or the next ones
(``frame_window``, 1 by default; ``None``: the bipartite search spans the clip). Merged tokens take their destination's rotary position. Oracles: the unpatched model, the token
counts each sub-layer receives, the rotary table of the unmerged sequence, and numpy bipartite matching."""

from __future__ import annotations

import copy
import gc
import warnings

import numpy as np
import pytest
import torch

import tome_core.torch as tome
from tome_core import bipartite_match, get_ops
from tome_core.algorithm.match import Match, assign, batch_as_channels, rank_sources
from tome_core.algorithm.partition import split
from tome_tools.diffusers_models import build_video_transformer, build_wan_pipeline

FRAMES, HEIGHT, WIDTH = 3, 8, 12  # latent: 3 frames of 4x6 tokens after the (1, 2, 2) patch
TOKENS = FRAMES * (HEIGHT // 2) * (WIDTH // 2)


@pytest.fixture(scope="module")
def wan():
    return build_video_transformer("tiny-wan")


@pytest.fixture(scope="module")
def inputs():
    generator = torch.Generator().manual_seed(3)
    return dict(
        hidden_states=torch.randn(2, 4, FRAMES, HEIGHT, WIDTH, generator=generator),
        timestep=torch.tensor([500, 500]),
        encoder_hidden_states=torch.randn(2, 5, 16, generator=generator),
    )


def call(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def seen_by(model, child):
    """``[(tokens, rotary table)]`` that each block's ``child`` sub-layer receives (hooks run after ToMe's)."""
    seen = []
    for block in model.blocks:
        module = getattr(block, child)
        module.register_forward_pre_hook(
            lambda m, a, k: seen.append((a[0].shape[1], a[3] if len(a) > 3 else None)), with_kwargs=True
        )
    return seen


def test_ratio_zero_is_exact_and_remove_restores_the_model(wan, inputs):
    plain = call(wan, inputs)
    model = copy.deepcopy(wan)
    with pytest.warns(UserWarning, match="merges no tokens"):
        tome.patch(model, ratio=0.0)
    assert torch.equal(call(model, inputs), plain)
    tome.patch(model, ratio=0.5)
    merged = call(model, inputs)
    assert torch.isfinite(merged).all() and not torch.allclose(merged, plain, atol=1e-3)
    tome.remove(model)
    assert torch.equal(call(model, inputs), plain)


@pytest.mark.parametrize("options, attn, cross, ffn", [
    (dict(ratio=0.5), TOKENS // 2, TOKENS, TOKENS),
    (dict(ratio=0.5, merge_crossattn=True, merge_mlp=True, mlp_ratio=0.25), TOKENS // 2, TOKENS // 2, TOKENS * 3 // 4),
    ({}, TOKENS // 2, TOKENS, TOKENS),  # mode "auto": ToMe for SD's arrangement (Wan's keys carry rotary positions)
])
def test_token_counts_seen_by_each_sublayer(wan, inputs, options, attn, cross, ffn):
    model = tome.patch(copy.deepcopy(wan), **options)
    counts = {child: seen_by(model, child) for child in ("attn1", "attn2", "ffn")}
    call(model, inputs)
    assert [n for n, _ in counts["attn1"]] == [attn] * 2
    assert [n for n, _ in counts["attn2"]] == [cross] * 2
    assert [n for n, _ in counts["ffn"]] == [ffn] * 2
    [(_, state)] = tome.patched_models(model)
    assert f"{TOKENS} -> {attn} tokens" in state.summary()


def _rotary_and_input(wan, inputs, **options):
    """The rotary table block 0's self-attention receives, and the block's input, patched with ``options``."""
    model = tome.patch(copy.deepcopy(wan), ratio=0.5, use_rand=False, **options)
    block = model.blocks[0]
    captured = {}
    block.attn1.register_forward_pre_hook(lambda m, a, k: captured.update(rotary=a[3]), with_kwargs=True)
    block.register_forward_pre_hook(lambda m, a, k: captured.update(x=a[0]), with_kwargs=True)
    call(model, inputs)
    return captured["rotary"][0], captured["x"].numpy()


def test_merged_tokens_carry_their_destinations_rotary_position(wan, inputs):
    """The rotary rows given to self-attention are the full table's rows at the match's destinations, which
    numpy bipartite matching of the block's input finds (use_rand=False, shared by the batch; ``frame_window=None``:
    every source compared with every destination of the clip)."""
    cos, x = _rotary_and_input(wan, inputs, frame_window=None)
    full_cos, _ = wan.rope(inputs["hidden_states"])
    assert cos.shape == (1, TOKENS // 2, 1, full_cos.shape[-1])
    # the match is computed from the block input, read as a (frames * 4) x 6 grid, batch items side by side
    ops = get_ops(x)
    match = bipartite_match(ops, batch_as_channels(ops, x), FRAMES * HEIGHT // 2, WIDTH // 2, 2, 2, TOKENS // 2, None)
    kept = np.asarray(match.representatives)[0]
    torch.testing.assert_close(cos[0, :, 0], full_cos[0, torch.from_numpy(kept), 0])


def test_by_default_a_token_merges_within_its_own_and_the_next_frames(wan, inputs):
    """The default ``frame_window=1``: the destinations kept are those a brute force finds when each source may
    merge only into a destination of its own frame or the frames before and after it (the full similarity with
    every other destination masked; numpy), and they differ from the whole clip's search (3 frames: the first and
    last frames do not meet)."""
    cos, x = _rotary_and_input(wan, inputs)
    full_cos, _ = wan.rope(inputs["hidden_states"])
    ops = get_ops(x)
    rows, cols = FRAMES * HEIGHT // 2, WIDTH // 2
    src, dst = (np.asarray(a) for a in split(ops, x, rows, cols, 2, 2, None)[::-1])
    metric = np.asarray(batch_as_channels(ops, x))[0]
    unit = metric / np.linalg.norm(metric, axis=-1, keepdims=True)
    scores = unit[src] @ unit[dst].T
    frame = lambda token: token // cols // (HEIGHT // 2)  # noqa: E731
    scores[np.abs(frame(src)[:, None] - frame(dst)[None, :]) > 1] = -np.inf
    best, best_dst = scores.max(-1)[None], scores.argmax(-1)[None]
    match = assign(ops, rank_sources(ops, best), best_dst, src, dst, TOKENS // 2, metric)
    kept = np.asarray(match.representatives)[0]
    torch.testing.assert_close(cos[0, :, 0], full_cos[0, torch.from_numpy(kept), 0])
    whole, _ = _rotary_and_input(wan, inputs, frame_window=None)
    assert not torch.equal(whole, cos)


def test_a_window_that_spans_the_clip_is_the_whole_search(wan, inputs):
    """Two frames: the default window meets every destination, so the call equals ``frame_window=None``'s, and
    ``summary()`` names the window only where it limits the search."""
    two = dict(inputs, hidden_states=inputs["hidden_states"][:, :, :2])
    models = [tome.patch(copy.deepcopy(wan), ratio=0.5, frame_window=window) for window in (1, None)]
    outputs = [call(model, two) for model in models]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    assert "frame" not in tome.patched_models(models[0])[0].state.summary()
    call(models[0], inputs)
    assert "(a token meets the destinations within 1 frame of its own, of 3)" in tome.patched_models(models[0])[0].state.summary()
    call(models[1], inputs)
    assert "frame" not in tome.patched_models(models[1])[0].state.summary()
    local = tome.patch(copy.deepcopy(wan), ratio=0.5, local_window=1)  # its own local search, not the window's
    call(local, inputs)
    assert "frame" not in tome.patched_models(local)[0].state.summary()


def test_frames_per_chunk_is_refused_on_wan(wan):
    with pytest.raises(ValueError, match="frames_per_chunk"):
        tome.patch(copy.deepcopy(wan), frames_per_chunk=2)


def test_wan_pipeline_merges_and_remove_is_exact():
    pipe, call_kwargs = build_wan_pipeline()
    run = lambda: pipe(
        height=16, width=16, num_frames=3, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
        output_type="latent", **call_kwargs,
    ).frames
    plain = run()
    tome.patch(pipe, ratio=0.5)
    seen = seen_by(pipe.transformer, "attn1")
    merged = run()
    assert torch.isfinite(merged).all() and not torch.allclose(merged, plain, atol=1e-4)
    tokens = plain.shape[2] * (plain.shape[3] // 2) * (plain.shape[4] // 2)
    assert {n for n, _ in seen} == {tokens // 2}
    tome.remove(pipe)
    assert torch.equal(run(), plain)


def _matches():
    """Every match with index arrays that anything holds (brute force over ``gc``: by ``type``, since ``isinstance``
    raises on a ``weakref.proxy`` to a dead object, and ``getattr``, since a match built without its fields turned
    up too: pytest-xdist's workers held both in CI)."""
    return [o for o in gc.get_objects() if type(o) is Match and getattr(o, "rows", None) is not None]


def _live_matches(found, before):
    """Pre-hook: count the matches held now that were not held ``before`` (caches of shape-only matches that
    earlier tests filled, held on to here so that no new match takes their ids)."""
    old = {id(match) for match in before}

    def hook(module, args):
        found.append(sum(1 for match in _matches() if id(match) not in old))

    return hook


@pytest.mark.parametrize("merge_mlp", [False, True])
def test_a_block_lets_go_of_its_match_before_an_unmerged_feed_forward(wan, inputs, merge_mlp):
    """The feed-forward, where a DiT block's call peaks in memory, runs with no match alive unless it merges
    itself; the oracle: every object ``gc`` tracks, and the tokens each sub-layer receives."""
    model = copy.deepcopy(wan)
    live, before = [], _matches()
    for block in model.blocks:
        block.ffn.register_forward_pre_hook(_live_matches(live, before))
    tome.patch(model, ratio=0.5, merge_mlp=merge_mlp)
    attn, ffn = seen_by(model, "attn1"), seen_by(model, "ffn")
    call(model, inputs)
    assert [tokens for tokens, _ in attn] == [TOKENS // 2] * len(model.blocks)
    assert [tokens for tokens, _ in ffn] == [TOKENS // 2 if merge_mlp else TOKENS] * len(model.blocks)
    assert live == [1 if merge_mlp else 0] * len(model.blocks)


def test_a_window_on_a_model_without_frames_is_said_to_change_nothing(wan, inputs):
    """A UNet's calls hold one frame a sequence: a window other than the default warns that it changes nothing
    there, and the merged output is the default's (which differs from unpatched); on Wan it acts, and nothing is
    said."""
    from tome_tools.diffusers_models import build_unet

    unet = build_unet("tiny").eval()
    args = (torch.randn(2, 4, 16, 16), torch.tensor(500), torch.randn(2, 7, 32))
    with torch.no_grad():
        plain = unet(*args).sample
        default = tome.patch(copy.deepcopy(unet), min_tokens=0)(*args).sample
        windowed = tome.patch(copy.deepcopy(unet), min_tokens=0, frame_window=2)
        with pytest.warns(UserWarning, match=r"frame_window=2 sets how many frames .* changes nothing here"):
            out = windowed(*args).sample
    assert not torch.equal(default, plain)
    torch.testing.assert_close(out, default, rtol=0, atol=0)
    model = tome.patch(copy.deepcopy(wan), ratio=0.5, frame_window=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(model, inputs)



def test_the_one_frame_warning_speaks_of_that_call_not_of_every_call(wan):
    """Edges round three, 10: a one-frame call of Wan with frame_window given warned, once per patch, that "this
    model's calls hold one frame a sequence", which its later calls of several frames, where the window acts,
    belied. The warning now speaks of the call, and says the window acts in calls of several frames."""
    model = tome.patch(copy.deepcopy(wan), ratio=0.5, frame_window=0)
    generator = torch.Generator().manual_seed(4)
    one = dict(
        hidden_states=torch.randn(1, 4, 1, HEIGHT, WIDTH, generator=generator), timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 5, 16, generator=generator),
    )
    with pytest.warns(UserWarning) as said:
        call(model, one)
    message = " ".join(str(w.message) for w in said if "frame_window" in str(w.message))
    assert "this model's calls hold" not in message and "calls of several frames" in message, message

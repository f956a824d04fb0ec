"""Options beyond tomesd on paddle: per-sub-layer and per-level ratios, match reuse, local matching, size-aware
attention. Oracles: the unpatched model, a fresh patch, token counts seen inside, ppdiffusers' own Attention."""

from __future__ import annotations

import copy

import numpy as np
import paddle
import pytest

import tome_core.paddle as tome
from tome_core import bipartite_match, get_ops, merge, unmerge
from tome_core.algorithm.merge import size_bias
from tome_tools.oracle import CountedMatcher


def token_counts(model, names=("attn1", "attn2", "ff")):
    """Tokens each sub-layer receives, by sub-layer name (hooks added after ToMe's see merged inputs)."""
    seen = {name: [] for name in names}
    for path, layer in model.named_sublayers():
        leaf = path.rsplit(".", 1)[-1]
        if leaf in seen and "transformer_blocks" in path:
            layer.register_forward_pre_hook(lambda m, a, leaf=leaf: seen[leaf].append(a[0].shape[1]))
    return seen


def at(inputs, timestep):
    return inputs[0], paddle.to_tensor(timestep), inputs[2]


def test_sublayer_and_level_ratios_set_the_token_counts(unet, inputs, call):
    tome.patch(
        unet, ratio=0.5, max_downsample=2, merge_crossattn=True, merge_mlp=True,
        crossattn_ratio=0.25, level_ratios={2: 0.75},
    )  # fmt: skip
    seen = token_counts(unet)
    call(unet, inputs)
    # 16x16 latent: level 1 has 256 tokens, level 2 has 64; the mid block (level 4) is not merged.
    assert set(seen["attn1"]) == {128, 16}  # 256 * (1 - 0.5) and 64 * (1 - 0.75); mid block 16 unmerged
    assert set(seen["attn2"]) == {192, 48, 16}  # crossattn_ratio 0.25 wins at every merged level
    assert set(seen["ff"]) == {128, 16}


def test_reuse_level_computes_one_match_per_level(unet, tiny_unet, inputs, call):
    tome.patch(unet, ratio=0.5, max_downsample=2, reuse_level=True)
    [(_, state)] = tome.patched_models(unet)
    state.matching.matcher = counted = CountedMatcher()  # ToMe's own, counting its calls by grid
    reused = call(unet, inputs)
    # one per merged level (16x16 and 8x8 tokens), not one per block; the mid block (above max_downsample) none
    assert sorted(counted.grids) == [(8, 8), (16, 16)]
    assert state.ledger.stats[1].blocks == 3 and state.ledger.stats[2].blocks == 3
    fresh = call(tome.patch(copy.deepcopy(tiny_unet), ratio=0.5, max_downsample=2), inputs)
    assert np.abs(reused - fresh).max() > 1e-6


def test_reuse_steps_keeps_matches_for_k_calls(tiny_unet, inputs, call):
    model = tome.patch(copy.deepcopy(tiny_unet), ratio=0.5, reuse_steps=2)
    fresh = tome.patch(copy.deepcopy(tiny_unet), ratio=0.5)
    np.testing.assert_array_equal(call(model, at(inputs, 700)), call(fresh, at(inputs, 700)))
    # The second call reuses the timestep-700 partition: equal to a fresh model only at timestep 700.
    reused = call(model, at(inputs, 300))
    assert np.abs(reused - call(fresh, at(inputs, 300))).max() > 1e-6
    # The third call starts a new window: a fresh match again.
    np.testing.assert_array_equal(call(model, at(inputs, 300)), call(fresh, at(inputs, 300)))


def test_reuse_steps_gives_the_same_output_in_every_generation(tiny_unet, inputs, call):
    """Issue 35, as on torch: a timestep above the previous call's starts a new generation."""
    model = tome.patch(copy.deepcopy(tiny_unet), ratio=0.5, reuse_steps=2)
    generation = lambda: [call(model, at(inputs, t)) for t in (900, 500, 100)]  # noqa: E731
    for first, second in zip(generation(), generation()):
        np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("options, message", [
    ({"blocks": [-1]}, "blocks names block -1 of UNet2DConditionModel, which runs at 1/4 scale and never merges"),
    ({"block_ratios": {0: 0.3, -7: 0.6}}, r"block_ratios names block 0 of UNet2DConditionModel twice"),
    ({"ratio": 0.5, "timestep_range": (2000, 3000)}, "whose timesteps run from 0 to 1000"),
])
def test_options_that_cannot_act_are_refused(tiny_unet, options, message):
    with pytest.raises(ValueError, match=message):
        tome.patch(copy.deepcopy(tiny_unet), **options)


def test_numpy_timesteps_and_seeds_past_the_hash_prime(tiny_unet, inputs, call):
    model = tome.patch(copy.deepcopy(tiny_unet), ratio=0.5)
    np.testing.assert_array_equal(call(model, (inputs[0], np.int64(500), inputs[2])), call(model, at(inputs, 500)))
    other = tome.patch(copy.deepcopy(tiny_unet), ratio=0.5, seed=32749)
    assert np.abs(call(model, at(inputs, 500)) - call(other, at(inputs, 500))).max() > 1e-6


def test_local_window_covering_the_grid_equals_global_matching_and_a_narrow_one_stays_local():
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((2, 12 * 10, 16)).astype(np.float32))
    ops = get_ops(x)
    everywhere = bipartite_match(ops, x, 12, 10, 2, 2, 50, None)
    local = bipartite_match(ops, x, 12, 10, 2, 2, 50, None, window=6)  # 6 cells reach across the 6x5 cell grid
    np.testing.assert_array_equal(local.rows.numpy(), everywhere.rows.numpy())
    slot = bipartite_match(ops, x, 12, 10, 2, 2, 50, None, window=1).slot.numpy()[0]
    cell_of = lambda token: ((token // 10) // 2, (token % 10) // 2)  # noqa: E731
    dst_slots = {int(slot[t]): t for t in range(120) if (t // 10) % 2 == 0 and (t % 10) % 2 == 0}
    for token in range(120):
        target = dst_slots.get(int(slot[token]))
        if target is not None and target != token:
            (a, b), (c, d) = cell_of(token), cell_of(target)
            assert max(abs(a - c), abs(b - d)) <= 1


def test_size_bias_through_ppdiffusers_attention_equals_repeated_keys(tiny_unet):
    attn = next(m for n, m in tiny_unet.named_sublayers() if n.endswith("transformer_blocks.0.attn1"))
    x = paddle.to_tensor(np.random.default_rng(1).standard_normal((2, 256, attn.to_q.weight.shape[0])).astype(np.float32))
    match = bipartite_match(get_ops(x), x, 16, 16, 2, 2, 128, None)
    merged = merge(x, match)
    with paddle.no_grad():
        sized = attn(merged, attention_mask=size_bias(match, merged)).numpy()
        repeated = attn(merged, encoder_hidden_states=unmerge(merged, match)).numpy()
        plain = attn(merged).numpy()
    np.testing.assert_allclose(sized, repeated, rtol=1e-4, atol=1e-5)
    assert not np.allclose(plain, repeated, atol=1e-4)


def test_proportional_attn_changes_the_output_is_exact_at_ratio_zero_and_removes_cleanly(unet, tiny_unet, inputs, call):
    plain = call(tiny_unet, inputs)
    with pytest.warns(UserWarning, match="merges no tokens"):
        tome.patch(unet, ratio=0.0, proportional_attn=True)
    np.testing.assert_array_equal(call(unet, inputs), plain)
    sized = call(tome.patch(unet, ratio=0.5, proportional_attn=True), inputs)
    flat = call(tome.patch(copy.deepcopy(tiny_unet), ratio=0.5, proportional_attn=False), inputs)
    assert np.isfinite(sized).all() and np.abs(sized - flat).max() > 1e-6
    tome.remove(unet)
    assert not any(getattr(m, "_forward_pre_hooks_with_kwargs_flag", None) for m in unet.sublayers(True))
    np.testing.assert_array_equal(call(unet, inputs), plain)


def test_proportional_attn_leaves_text_keys_unsized_under_only_cross_attention(inputs, call):
    """With only_cross_attention, attn1 attends to the text: its keys are not merged, so size-aware equals plain."""
    from tome_tools.ppdiffusers_models import build_unet

    unet = build_unet("tiny", seed=0, only_cross_attention=True)
    plain = call(unet, inputs)
    sized = call(tome.patch(copy.deepcopy(unet), ratio=0.5, proportional_attn=True), inputs)
    flat = call(tome.patch(copy.deepcopy(unet), ratio=0.5, proportional_attn=False), inputs)
    np.testing.assert_array_equal(sized, flat)
    assert np.abs(sized - plain).max() > 1e-5  # the queries were merged


def test_timestep_range_merges_inside_it_and_runs_the_unpatched_model_outside(tiny_unet, inputs, call):
    everywhere = tome.patch(copy.deepcopy(tiny_unet), ratio=0.5)
    ranged = tome.patch(copy.deepcopy(tiny_unet), ratio=0.5, timestep_range=(400, 1000))
    seen = token_counts(ranged, names=("attn1",))["attn1"]
    for t, inside in ((500, True), ([700, 600], True), (100, False), ([700, 100], False)):
        seen.clear()
        out = call(ranged, at(inputs, t))
        if inside:
            np.testing.assert_array_equal(out, call(everywhere, at(inputs, t)))
            assert 256 not in seen and 128 in seen  # 16x16 latent: 256 -> 128 tokens
        else:
            np.testing.assert_array_equal(out, call(tiny_unet, at(inputs, t)))
            assert 128 not in seen and 256 in seen

"""Options beyond tomesd: per-sub-layer and per-level ratios, match reuse, local matching, size-aware attention.
Oracles: the unpatched model, the reference configuration, token counts seen inside, diffusers' own Attention."""

from __future__ import annotations

import copy

import pytest
import torch

import tome_core.torch as tome
from tome_core import bipartite_match, get_ops, merge, unmerge
from tome_tools.diffusers_models import build_unet
from tome_tools.oracle import CountedMatcher
from tome_core.algorithm.merge import size_bias


def call(model, inputs, timestep=None):
    sample, t, text = inputs
    with torch.no_grad():
        return model(sample, t if timestep is None else timestep, text).sample


def token_counts(model, names=("attn1", "attn2", "ff")):
    """Tokens each sub-layer receives, by sub-layer name (hooks added after ToMe's see merged inputs)."""
    seen = {name: [] for name in names}
    for path, module in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if leaf in seen and "transformer_blocks" in path:
            module.register_forward_pre_hook(lambda m, a, k, leaf=leaf: seen[leaf].append(a[0].shape[1]), with_kwargs=True)
    return seen


def test_sublayer_and_level_ratios_set_the_token_counts(unet, inputs):
    model = tome.patch(
        copy.deepcopy(unet), ratio=0.5, max_downsample=2, merge_crossattn=True, merge_mlp=True,
        crossattn_ratio=0.25, level_ratios={2: 0.75},
    )
    seen = token_counts(model)
    call(model, inputs)
    # 16x16 latent: level 1 has 256 tokens, level 2 has 64; the mid block (level 4) is not merged.
    assert set(seen["attn1"]) == {128, 16}  # 256 * (1 - 0.5) and 64 * (1 - 0.75); mid block 16 unmerged
    assert set(seen["attn2"]) == {192, 48, 16}  # crossattn_ratio 0.25 wins at every merged level
    assert set(seen["ff"]) == {128, 16}


def test_reuse_level_computes_one_match_per_level(unet, inputs):
    model = tome.patch(copy.deepcopy(unet), ratio=0.5, max_downsample=2, reuse_level=True)
    [(_, state)] = tome.patched_models(model)
    state.matching.matcher = counted = CountedMatcher()  # ToMe's own, counting its calls by grid
    call(model, inputs)
    # one per merged level (16x16 and 8x8 tokens), not one per block; the mid block (above max_downsample) none
    assert sorted(counted.grids) == [(8, 8), (16, 16)]
    assert state.ledger.stats[1].blocks == 3 and state.ledger.stats[2].blocks == 3
    assert not torch.equal(call(model, inputs), call(tome.patch(copy.deepcopy(unet), ratio=0.5, max_downsample=2), inputs))


def test_reuse_steps_keeps_matches_for_k_calls(unet, inputs):
    model = tome.patch(copy.deepcopy(unet), ratio=0.5, reuse_steps=2)
    fresh = tome.patch(copy.deepcopy(unet), ratio=0.5)
    first = call(model, inputs, torch.tensor(700))
    torch.testing.assert_close(first, call(fresh, inputs, torch.tensor(700)), rtol=0, atol=0)
    # The second call reuses the timestep-700 partition: equal to a fresh model only at timestep 700.
    reused = call(model, inputs, torch.tensor(300))
    assert not torch.equal(reused, call(fresh, inputs, torch.tensor(300)))
    fixed = tome.patch(copy.deepcopy(unet), ratio=0.5, use_rand=False, reuse_steps=3)
    fixed_fresh = tome.patch(copy.deepcopy(unet), ratio=0.5, use_rand=False)
    call(fixed, inputs)
    shifted = (inputs[0] * 1.5, inputs[1], inputs[2])
    # Reused matches come from the first call's tokens, so a different input merges differently than fresh.
    assert not torch.equal(call(fixed, shifted), call(fixed_fresh, shifted))


def test_local_window_covering_the_grid_equals_global_matching():
    torch.manual_seed(0)
    x = torch.randn(2, 12 * 10, 16)
    ops = get_ops(x)
    everywhere = bipartite_match(ops, x, 12, 10, 2, 2, 50, None)
    local = bipartite_match(ops, x, 12, 10, 2, 2, 50, None, window=6)  # 6 cells reach across the 6x5 cell grid
    torch.testing.assert_close(local.rows, everywhere.rows, rtol=0, atol=0)
    narrow = bipartite_match(ops, x, 12, 10, 2, 2, 50, None, window=1)
    # Merged sources go to a destination at most one cell away.
    slot = narrow.slot[0]
    cell_of = lambda token: ((token // 10) // 2, (token % 10) // 2)
    dst_slots = {int(slot[t]): t for t in range(120) if (t // 10) % 2 == 0 and (t % 10) % 2 == 0}
    for token in range(120):
        target = dst_slots.get(int(slot[token]))
        if target is not None and target != token:
            (a, b), (c, d) = cell_of(token), cell_of(target)
            assert max(abs(a - c), abs(b - d)) <= 1


def test_local_window_patch_runs_on_the_same_token_counts(unet, inputs):
    model = tome.patch(copy.deepcopy(unet), ratio=0.5, local_window=1)
    seen = token_counts(model, ("attn1",))
    out = call(model, inputs)
    assert 128 in seen["attn1"] and torch.isfinite(out).all()
    assert not torch.equal(out, call(tome.patch(copy.deepcopy(unet), ratio=0.5), inputs))


def test_size_bias_through_diffusers_attention_equals_repeated_keys(unet):
    attn = next(m for n, m in unet.named_modules() if n.endswith("transformer_blocks.0.attn1"))
    torch.manual_seed(1)
    x = torch.randn(2, 256, attn.to_q.in_features)
    match = bipartite_match(get_ops(x), x, 16, 16, 2, 2, 128, None)
    merged = merge(x, match)
    with torch.no_grad():
        sized = attn(merged, attention_mask=size_bias(match, merged))
        repeated = attn(merged, encoder_hidden_states=unmerge(merged, match))
        plain = attn(merged)
    torch.testing.assert_close(sized, repeated, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(plain, repeated, atol=1e-4)


def test_proportional_attn_changes_the_output_and_is_exact_at_ratio_zero(unet, inputs):
    plain = call(unet, inputs)
    with pytest.warns(UserWarning, match="merges no tokens"):
        zero = tome.patch(copy.deepcopy(unet), ratio=0.0, proportional_attn=True)
    torch.testing.assert_close(call(zero, inputs), plain, rtol=0, atol=0)
    sized = call(tome.patch(copy.deepcopy(unet), ratio=0.5, proportional_attn=True), inputs)
    flat = call(tome.patch(copy.deepcopy(unet), ratio=0.5, proportional_attn=False), inputs)
    assert torch.isfinite(sized).all() and not torch.equal(sized, flat)


def test_proportional_attn_leaves_text_keys_unsized_under_only_cross_attention(inputs):
    """With only_cross_attention, attn1 attends to the text: its keys are not merged, so size-aware equals plain."""
    unet = build_unet("tiny", seed=0, only_cross_attention=True)
    plain = call(unet, inputs)
    sized = call(tome.patch(copy.deepcopy(unet), ratio=0.5, proportional_attn=True), inputs)
    flat = call(tome.patch(copy.deepcopy(unet), ratio=0.5, proportional_attn=False), inputs)
    torch.testing.assert_close(sized, flat, rtol=0, atol=0)
    assert not torch.allclose(sized, plain, atol=1e-5)  # the queries were merged


def test_timestep_range_merges_inside_it_and_runs_the_unpatched_model_outside(unet, inputs):
    plain = lambda t: call(unet, inputs, t)
    everywhere = tome.patch(copy.deepcopy(unet), ratio=0.5)
    ranged = tome.patch(copy.deepcopy(unet), ratio=0.5, timestep_range=(500, 1000))
    [(_, state)] = tome.patched_models(ranged)
    seen = token_counts(ranged, names=("attn1",))["attn1"]
    for t, inside in ((torch.tensor(700), True), (700, True), (torch.tensor([1000.0, 500.0]), True),
                      (torch.tensor(100), False), (torch.tensor([700, 100]), False), (499.5, False)):
        seen.clear()
        out = call(ranged, inputs, t)
        if inside:
            assert torch.equal(out, call(everywhere, inputs, t)) and not torch.equal(out, plain(t))
            assert 256 not in seen and 128 in seen and "merged" in state.summary()  # 16x16 latent: 256 -> 128
        else:
            assert torch.equal(out, plain(t)), t
            assert 128 not in seen and 256 in seen and "outside timestep_range=(500.0, 1000.0)" in state.summary()


def test_timestep_range_merges_the_first_steps_of_a_pipeline():
    from tome_tools.diffusers_models import build_pipeline

    pipe = build_pipeline("sd")
    tome.patch(pipe, ratio=0.5, timestep_range=(500, 1000))
    timesteps, smallest = [], []
    pipe.unet.register_forward_pre_hook(lambda m, a, k: timesteps.append(float(a[1])) or smallest.append([]), with_kwargs=True)
    for path, module in pipe.unet.named_modules():
        if path.endswith("attn1"):
            module.register_forward_pre_hook(lambda m, a, k: smallest[-1].append(a[0].shape[1]), with_kwargs=True)
    pipe("a prompt", num_inference_steps=4, guidance_scale=1.0, height=32, width=32, output_type="latent",
         generator=torch.Generator().manual_seed(0))
    full = max(max(call) for call in smallest)  # the finest level's token count, seen only unmerged
    merged = [full not in call for call in smallest]
    assert merged == [500 <= t <= 1000 for t in timesteps] and any(merged) and not all(merged)

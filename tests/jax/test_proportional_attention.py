"""Size-aware attention on Flax: diffusers' own FlaxAttention over every token, with each merged token
repeated once per token it stands for, is the oracle for the adapter's attention over the merged tokens."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from diffusers.models.attention_flax import FlaxAttention

import tome_core.jax as tome
from tome_core import bipartite_match, get_ops, merge, unmerge
from tome_core.adapters.flax import _size_aware_attention
from tome_core.hooks.attention_bias import SizeBias
from tome_core.models.families import TEXT_NONE
from tome_tools.flax_models import build_unet


def size_aware(attention, params, x, match):
    def run(module, hidden_states):
        return _size_aware_attention(module, hidden_states, SizeBias(match, TEXT_NONE, hidden_states), deterministic=True)

    return attention.apply(params, merge(x, match), method=run)


@pytest.mark.parametrize("memory_efficient, split_head_dim", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.75])
def test_size_aware_attention_equals_attention_over_repeated_tokens(rel, memory_efficient, split_head_dim, ratio):
    h, w, channels = 8, 6, 32
    attention = FlaxAttention(
        channels, heads=4, dim_head=8, use_memory_efficient_attention=memory_efficient, split_head_dim=split_head_dim
    )
    x = jax.random.normal(jax.random.key(0), (2, h * w, channels))
    params = attention.init(jax.random.key(1), x)
    match = bipartite_match(get_ops(x), x, h, w, 2, 2, int(h * w * ratio), None)
    repeated = unmerge(merge(x, match), match)  # every token holds its slot's value

    expected = attention.apply(params, repeated)  # the module's own attention over all N tokens
    got = unmerge(size_aware(attention, params, x, match), match)
    assert rel(np.asarray(got), np.asarray(expected)) < 1e-5
    # Plain attention over the merged tokens (tomesd's arithmetic) is not that oracle.
    plain = unmerge(attention.apply(params, merge(x, match)), match)
    assert rel(np.asarray(plain), np.asarray(expected)) > 1e-3


def test_size_aware_unet_at_ratio_zero_equals_unpatched(apply, rel, small, inputs):
    unet, params = small
    sample, timesteps, context = inputs
    plain = np.asarray(apply(unet, params, sample, timesteps, context))
    with pytest.warns(UserWarning, match="merges no tokens"):
        patched = tome.patch(unet, ratio=0.0, proportional_attn=True)
    np.testing.assert_array_equal(np.asarray(apply(patched, params, sample, timesteps, context)), plain)


def test_size_aware_differs_from_plain_and_is_closer_to_unpatched(apply, rel, small, inputs):
    unet, params = small
    sample, timesteps, context = inputs
    plain = np.asarray(apply(unet, params, sample, timesteps, context))
    merged = np.asarray(apply(tome.patch(unet, ratio=0.5, proportional_attn=False), params, sample, timesteps, context))
    sized = np.asarray(apply(tome.patch(unet, ratio=0.5, proportional_attn=True), params, sample, timesteps, context))
    assert rel(sized, merged) > 1e-4
    assert rel(sized, plain) < rel(merged, plain)


def test_size_aware_leaves_text_keys_unsized_under_only_cross_attention(apply, inputs):
    """With only_cross_attention, attn1 attends to the text: its keys are not merged, so size-aware equals plain."""
    from tome_tools.flax_models import TWO_LEVELS

    unet, params = build_unet("tiny", seed=0, only_cross_attention=True, **TWO_LEVELS)
    sample, timesteps, context = inputs
    plain = np.asarray(apply(unet, params, sample, timesteps, context))
    sized = np.asarray(apply(tome.patch(unet, ratio=0.5, proportional_attn=True), params, sample, timesteps, context))
    flat = np.asarray(apply(tome.patch(unet, ratio=0.5, proportional_attn=False), params, sample, timesteps, context))
    np.testing.assert_array_equal(sized, flat)
    assert np.abs(sized - plain).max() > 1e-5  # the queries were merged

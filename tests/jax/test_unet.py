"""Patched Flax UNets and ControlNets: what runs, on how many tokens, and what stays as it was.

Oracles: the unpatched module (exact equality where nothing may change), token counts computed from the
grid (N - int(N * ratio) at merged levels, N elsewhere), the eager call (for jit), the parameter tree.
"""

from __future__ import annotations

import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tome_core.jax as tome
from tome_tools.flax_models import build_unet, param_shapes


def expected_tokens(latent, levels_blocks, merged_levels, ratio=0.5):
    """``Counter`` of attn1 token counts: ``levels_blocks`` maps downsample factor -> number of blocks."""
    counts = Counter()
    for factor, blocks in levels_blocks.items():
        tokens = (latent[0] // factor) * (latent[1] // factor)
        counts[tokens - int(tokens * ratio) if factor in merged_levels else tokens] += blocks
    return counts


# The tiny preset: 3 blocks at 1/1 (down 0 and up 2 x2), 3 at 1/2 (down 1, up 1 x2), 1 at 1/4 (middle).
TINY_BLOCKS = {1: 3, 2: 3, 4: 1}


def seen_counts(attn1_tokens, model, params, sample, context):
    timesteps = jnp.ones((sample.shape[0],))
    return Counter(n for _, _, n in attn1_tokens(model.apply, {"params": params}, sample, timesteps, context))


@pytest.mark.parametrize(
    "options, latent, merged_levels",
    [
        ({"ratio": 0.5}, (16, 16), {1}),  # max_downsample=None: the finest level with attention (1 on SD)
        ({"ratio": 0.5, "max_downsample": 2}, (16, 24), {1, 2}),
        ({"max_downsample": 4, "ratio": 0.6}, (20, 28), {1, 2, 4}),  # 5x7 middle grid: leftover row and column
    ],
)
def test_merged_blocks_run_attention_on_fewer_tokens(tiny, attn1_tokens, options, latent, merged_levels):
    unet, params = tiny
    sample = jnp.zeros((2, 4) + latent)
    context = jnp.zeros((2, 7, 32))
    patched = tome.patch(unet, **options)
    expected = expected_tokens(latent, TINY_BLOCKS, merged_levels, options.get("ratio", 0.5))
    assert seen_counts(attn1_tokens, patched, params, sample, context) == expected
    assert seen_counts(attn1_tokens, unet, params, sample, context) == expected_tokens(latent, TINY_BLOCKS, set())


def test_sdxl_config_merges_its_finest_attention_level_by_default(attn1_tokens):
    unet, params = build_unet("tiny-xl", seed=1)
    added = {"text_embeds": jnp.zeros((2, 32)), "time_ids": jnp.zeros((2, 6))}
    sample, context = jnp.zeros((2, 4, 16, 16)), jnp.zeros((2, 7, 64))
    seen = attn1_tokens(tome.patch(unet, ratio=0.5).apply, {"params": params}, sample, jnp.ones((2,)), context, added)
    # No attention at 1/1; two blocks per transformer at 1/2 (down 1, up 1 x2) and 1/4 (down 2, up 0 x2, middle).
    assert Counter(n for _, _, n in seen) == Counter({32: 6, 16: 8})
    with pytest.warns(UserWarning, match="max_downsample=1 but the finest level with attention is downsampled 2x"):
        tome.patch(unet, max_downsample=1)


def test_patched_module_shares_params_config_and_class_name_and_remove_gives_the_original(tiny):
    unet, params = tiny
    patched = tome.patch(unet, ratio=0.4, merge_mlp=True)
    assert isinstance(patched, type(unet)) and type(patched).__name__ == type(unet).__name__
    assert patched.config == unet.config and dict(patched.config) == dict(unet.config)
    assert jax.tree_util.tree_structure(param_shapes(patched)) == jax.tree_util.tree_structure(params)
    same_shapes = jax.tree_util.tree_map(lambda a, b: a.shape == b.shape, param_shapes(patched), params)
    assert all(jax.tree_util.tree_leaves(same_shapes))
    assert tome.is_patched(patched) and not tome.is_patched(unet)
    assert tome.remove(patched) is unet and tome.remove(unet) is unet
    # Patching a patched module starts from the original: equal to patching once with the newer options.
    twice = tome.patch(tome.patch(unet, ratio=0.3, merge_mlp=True), ratio=0.6)
    assert twice == tome.patch(unet, ratio=0.6) and tome.remove(twice) is unet


def test_jit_equals_eager_and_does_not_retrace(small, inputs, apply, rel):
    unet, params = small
    patched = tome.patch(unet, ratio=0.5, seed=1)
    first = apply(patched, params, *inputs)
    size = apply._cache_size()
    # An equal patched module (same options), new values, same shapes: no retrace, and the same seed gives
    # the same output (nothing is carried from call to call).
    again = tome.patch(unet, ratio=0.5, seed=1)
    np.testing.assert_array_equal(np.asarray(apply(again, params, *inputs)), np.asarray(first))
    second = apply(again, params, inputs[0] + 1, jnp.array([20, 20], jnp.int32), inputs[2])
    assert apply._cache_size() == size
    assert rel(second, first) > 1e-3
    eager = patched.apply({"params": params}, *inputs).sample
    assert rel(first, eager) < 1e-5
    assert rel(first, apply(unet, params, *inputs)) > 1e-3  # and ToMe changed something


def test_ratio_zero_equals_unpatched_exactly_and_the_original_stays_unpatched(small, inputs, apply):
    unet, params = small
    plain = np.asarray(apply(unet, params, *inputs))
    with pytest.warns(UserWarning, match="merges no tokens: ratio=0"):
        zero = tome.patch(unet, ratio=0.0)
    np.testing.assert_array_equal(np.asarray(apply(zero, params, *inputs)), plain)
    # The original module is untouched by patching: still the unpatched output, bit for bit.
    tome.patch(unet, ratio=0.5)
    np.testing.assert_array_equal(np.asarray(apply(tome.remove(zero), params, *inputs)), plain)


def test_controlnet_blocks_are_merged_and_change_its_residuals(small_controlnet, inputs, attn1_tokens, rel):
    controlnet, params = small_controlnet
    sample, timesteps, context = inputs
    cond = jnp.asarray(np.random.default_rng(5).random((2, 3, 32, 32)), jnp.float32)
    patched = tome.patch(controlnet, ratio=0.5)
    seen = attn1_tokens(patched.apply, {"params": params}, sample, timesteps, context, cond)
    # ControlNet blocks: down 0 (1/1, merged) and the middle (1/2).
    assert Counter(n for _, _, n in seen) == Counter({128: 1, 64: 1})

    run = jax.jit(lambda model, p: model.apply({"params": p}, sample, timesteps, context, cond, return_dict=False),
                  static_argnums=0)
    (down_plain, mid_plain), (down_tome, mid_tome) = run(controlnet, params), run(patched, params)
    np.testing.assert_array_equal(np.asarray(down_tome[0]), np.asarray(down_plain[0]))  # before any block
    assert rel(down_tome[1], down_plain[1]) > 1e-3  # after the first (merged) transformer block
    assert all(np.isfinite(np.asarray(d)).all() for d in down_tome)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"ratio": 0.9}, ValueError, "at most 1 - 1/\\(sx\\*sy\\)"),
        ({"max_downsample": 3}, ValueError, "max_downsample must be one of"),
        ({"use_rand": 1}, TypeError, "use_rand must be True or False"),
        ({"ration": 0.5}, TypeError, "unknown ToMe option"),
        ({"reuse_steps": 2}, ValueError, "reuse_steps=2 is not supported on jax"),
        ({"timestep_range": (500, 1000)}, ValueError, r"timestep_range=\(500.0, 1000.0\) is not supported on jax"),
    ],
)
def test_bad_options_raise_clear_errors(tiny, options, error, message):
    with pytest.raises(error, match=message):
        tome.patch(tiny[0], **options)


def test_objects_without_a_unet_raise_naming_what_is_accepted(tiny):
    import flax.linen as nn

    with pytest.raises(TypeError, match=r"^ToMe patches a pipeline or a model; got str 'unet': .*FlaxStableDiffusionPipeline"
                                        r"\.from_pretrained\('unet'\).*It takes a diffusers Flax pipeline"):
        tome.patch("unet")
    with pytest.raises(TypeError, match="^ToMe patches a pipeline or a model; got flax.linen.*FlaxControlNetModel$"):
        tome.patch(nn.Dense(3))
    with pytest.raises(TypeError, match="^remove takes a patched pipeline or model; got int 42$"):
        tome.remove(42)


@pytest.mark.parametrize("batch", [1, 3])
def test_batch_one_and_odd_batches_merge_like_a_cfg_batch(tiny, attn1_tokens, batch):
    unet, params = tiny
    sample, context = jnp.zeros((batch, 4, 16, 16)), jnp.zeros((batch, 7, 32))
    assert seen_counts(attn1_tokens, tome.patch(unet, ratio=0.5), params, sample, context) == expected_tokens((16, 16), TINY_BLOCKS, {1})


def test_two_patched_models_traced_from_two_threads_keep_their_own_options(tiny, attn1_tokens):
    import threading

    unet, params = tiny
    sample, context = jnp.zeros((2, 4, 16, 16)), jnp.zeros((2, 7, 32))
    results = {}

    def trace(name, model):
        results[name] = [seen_counts(attn1_tokens, model, params, sample, context) for _ in range(2)]

    threads = [
        threading.Thread(target=trace, args=("half", tome.patch(unet, ratio=0.5))),
        threading.Thread(target=trace, args=("quarter", tome.patch(unet, ratio=0.25, max_downsample=2))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results["half"] == [expected_tokens((16, 16), TINY_BLOCKS, {1})] * 2
    assert results["quarter"] == [expected_tokens((16, 16), TINY_BLOCKS, {1, 2}, 0.25)] * 2


def test_bfloat16_model_runs_merged_and_finite_in_its_dtype(small, inputs, attn1_tokens, apply, rel):
    unet, params = small
    half = type(unet)(**{**{k: v for k, v in dict(unet.config).items() if not k.startswith("_")}, "dtype": jnp.bfloat16})
    patched = tome.patch(half, ratio=0.5, seed=1)
    sample, timesteps, context = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in inputs)
    seen = attn1_tokens(patched.apply, {"params": params}, sample, timesteps, context)
    assert Counter(n for _, _, n in seen) == Counter({128: 3, 64: 1})
    out = apply(patched, params, sample, timesteps, context)
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    # Oracle: the float32 model patched alike (compiled in test_jit_equals_eager_and_does_not_retrace).
    reference = apply(tome.patch(unet, ratio=0.5, seed=1), params, *inputs)
    merged_away = rel(reference, apply(unet, params, *inputs))
    assert rel(out, reference) < merged_away / 3  # rounding (~0.04) only: the same tokens merged


def test_seed_may_be_a_jax_random_key(tiny):
    unet, _ = tiny
    key = jax.random.key(7)
    expected = int(jax.random.randint(key, (), 0, 2**31 - 1))
    assert tome.patch(unet, seed=key).tome.seed == expected == tome.patch(unet, seed=jax.random.PRNGKey(7)).tome.seed
    assert tome.patch(unet, seed=jax.random.key(8)).tome.seed != expected
    with pytest.raises(TypeError, match="seed must be an int >= 0"):
        tome.patch(unet, seed=1.5)


def test_default_auto_pools_keys_and_values_by_the_latent_size(tiny):
    """mode="auto": 2x2 sampled cells below 128x128 finest-level tokens; the queries keep every token (checked against
    the explicit arrangement, which tests/jax/test_arrangements.py compares with numpy)."""
    unet, params = tiny
    sample, context = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 16, 16)), jnp.ones((2, 7, 32))
    with tome.record() as calls:
        auto = tome.patch(unet).apply({"params": params}, sample, jnp.ones((2,)), context).sample
    [(_, state)] = calls
    assert (state.active.mode, state.active.matching, state.active.sx, state.active.cell_pool) == ("kv", "cell", 2, "sample")
    assert {factor: (level.tokens, level.kept) for factor, level in state.ledger.stats.items()} == {1: (256, 64)}
    explicit = tome.patch(unet, mode="kv", matching="cell", cell_pool="sample").apply({"params": params}, sample, jnp.ones((2,)), context).sample
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(explicit))


def test_apply_tome_takes_the_ratio_positionally(tiny):
    unet, _ = tiny
    assert tome.apply_tome(unet, 0.3).tome.ratio == 0.3
    with pytest.raises(TypeError, match=r"apply_tome takes the ratio as its only positional argument, got 2"):
        tome.apply_tome(unet, 0.5, 2)

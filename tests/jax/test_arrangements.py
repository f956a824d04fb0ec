"""The three arrangements around Flax self-attention (``mode`` tokens / kv / queries) and cell matching.

Oracles: attention written out in numpy (float64) from the attn1 weights, on that attn1's own input: keys and
values average-pooled per cell by numpy (``matching="cell"``), or merged by the rows of a match computed by the
core in the same traced call (``matching="similarity"``, with log sizes on merged keys when size-aware); the
unpatched module (exact equality where nothing may change); token counts from the grid for what attn1's
query and key projections receive. A spy outside the adapter sees every attn1 as the block calls it: its
input and output always hold all N tokens, whatever happens inside.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from diffusers.models.attention_flax import FlaxAttention, FlaxBasicTransformerBlock

import tome_core.jax as tome
from tome_core import bipartite_match, get_ops, merge, unmerge
from tome_core.adapters.flax import _size_aware_attention, config_key
from tome_core.hooks.attention_bias import SizeBias
from tome_core.models.families import TEXT_NONE
from tome_tools.flax_models import TWO_LEVELS, build_pipeline, build_unet, random_params

LATENT = (16, 16)  # the small UNet: attn1 at 1/1 (down 0, up 1 x2: 256 tokens) and in the middle (1/2: 64)
HEADS = 8  # the tiny preset's attention_head_dim, which diffusers' Flax UNet uses as the number of heads


def _grid(tokens):
    for factor in (1, 2, 4, 8):
        h, w = LATENT[0] // factor, LATENT[1] // factor
        if h * w == tokens:
            return factor, (h, w)
    raise AssertionError(f"no level has {tokens} tokens")


def _capture(model, params, sample, timesteps, context, similarity=None):
    """Run ``model`` and return its output and, per transformer block, what its attn1 saw from outside:
    ``{path: {"x": attn1 input, "out": attn1 output[, "rows": match rows]}}``.

    ``similarity`` = (sx, sy, ratio): also compute, from each block's input, the core's bipartite match with
    the fixed partition in the same trace (the match the adapter computes there), and return its rows.
    """
    records = {}

    def spy(next_fun, args, kwargs, ctx):
        module = ctx.module
        if ctx.method_name != "__call__":
            return next_fun(*args, **kwargs)
        if isinstance(module, FlaxBasicTransformerBlock) and similarity is not None:
            x = args[0] if args else kwargs["hidden_states"]
            factor, (h, w) = _grid(x.shape[1])
            sx, sy, ratio = similarity
            match = bipartite_match(get_ops(x), x, h, w, sx, sy, int(x.shape[1] * ratio), None)
            if match.rows is not None:
                records.setdefault(tuple(module.path), {})["rows"] = match.rows
        if isinstance(module, FlaxAttention) and module.name == "attn1":
            out = next_fun(*args, **kwargs)
            records.setdefault(tuple(module.path[:-1]), {}).update(x=args[0] if args else kwargs["hidden_states"], out=out)
            return out
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(spy):  # entered before the patched call's own interceptor: it runs outside it
        out = model.apply({"params": params}, sample, timesteps, context).sample
    return out, records


captured = jax.jit(_capture, static_argnums=(0, 5))


# ---------------------------------------------------------------------------------------------------------
# numpy oracles (float64)


def attention(weights, queries, keys, bias=None):
    """diffusers' FlaxAttention: queries from ``queries``, keys and values from ``keys``; ``bias [B, K]`` added
    to every head's and query's logits."""
    f = lambda name: np.asarray(weights[name]["kernel"], np.float64)  # noqa: E731
    q, k, v = queries @ f("to_q"), keys @ f("to_k"), keys @ f("to_v")
    batch, n, inner = q.shape
    d = inner // HEADS
    q, k, v = (a.reshape(batch, a.shape[1], HEADS, d) for a in (q, k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
    if bias is not None:
        logits = logits + bias[:, None, None, :]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, n, inner)
    return out @ f("to_out_0") + np.asarray(weights["to_out_0"]["bias"], np.float64)


def pool(x, h, w, sx, sy):
    """Average of every full sx x sy cell (row-major), then the tokens of the leftover columns and rows."""
    batch, _, channels = x.shape
    grid = x.reshape(batch, h, w, channels)
    hc, wc = h // sy, w // sx
    cells = grid[:, : hc * sy, : wc * sx].reshape(batch, hc, sy, wc, sx, channels).mean(axis=(2, 4))
    parts = [cells.reshape(batch, hc * wc, channels), grid[:, : hc * sy, wc * sx :].reshape(batch, -1, channels),
             grid[:, hc * sy :].reshape(batch, -1, channels)]
    return np.concatenate(parts, axis=1)


def spread(y, h, w, sx, sy):
    """The inverse layout of :func:`pool`: every token of a cell takes its cell's value, leftovers their own."""
    batch, _, channels = y.shape
    hc, wc = h // sy, w // sx
    grid = np.zeros((batch, h, w, channels))
    cells = y[:, : hc * wc].reshape(batch, hc, 1, wc, 1, channels)
    grid[:, : hc * sy, : wc * sx] = np.broadcast_to(cells, (batch, hc, sy, wc, sx, channels)).reshape(batch, hc * sy, wc * sx, channels)
    right = hc * sy * (w - wc * sx)
    grid[:, : hc * sy, wc * sx :] = y[:, hc * wc : hc * wc + right].reshape(batch, hc * sy, w - wc * sx, channels)
    grid[:, hc * sy :] = y[:, hc * wc + right :].reshape(batch, h - hc * sy, w, channels)
    return grid.reshape(batch, h * w, channels)


def merge_by_rows(x, rows):
    """The merged tokens ``[B, K, C]`` of a match given by its rows (each slot the mean of its tokens), and
    the slot sizes ``[B, K]``."""
    batch, tokens, channels = x.shape
    sizes = np.bincount(rows)
    merged = np.zeros((len(sizes), channels))
    np.add.at(merged, rows, x.reshape(batch * tokens, channels))
    merged /= sizes[:, None]
    return merged.reshape(batch, -1, channels), sizes.reshape(batch, -1).astype(np.float64)


def expected_attn1(config, weights, x, rows):
    """What attn1 returns under ``config`` for input ``x``, by the numpy oracles; ``rows`` the block's
    similarity match (None when it merges nothing)."""
    factor, (h, w) = _grid(x.shape[1])
    max_downsample = config.max_downsample or 1
    if factor > max_downsample:
        return attention(weights, x, x)
    if config.matching == "cell":
        sx, sy = config.cell_at(factor)
        merged, sizes, unmerge_ = pool(x, h, w, sx, sy), None, lambda y: spread(y, h, w, sx, sy)
    else:
        assert rows is not None
        merged, sizes = merge_by_rows(x, rows)
        unmerge_ = lambda y: y.reshape(-1, y.shape[-1])[rows].reshape(x.shape)  # noqa: E731
    bias = np.log(sizes) if sizes is not None and config.proportional_attn else None
    if config.mode == "kv":
        return attention(weights, x, merged, bias)
    if config.mode == "queries":
        return unmerge_(attention(weights, merged, x))
    return unmerge_(attention(weights, merged, merged, bias))


def weights_at(params, path):
    tree = params
    for name in path + ("attn1",):
        tree = tree[name]
    return tree


# ---------------------------------------------------------------------------------------------------------


def kv_lengths(model, params, sample, timesteps, context, *extra):
    """``Counter`` of (query tokens, key tokens) that attn1's projections receive, traced abstractly."""
    seen = []

    def spy(next_fun, args, kwargs, ctx):
        module = ctx.module
        if ctx.method_name == "__call__" and module.name in ("to_q", "to_k") and module.parent.name == "attn1":
            seen.append((module.name, int(args[0].shape[1])))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(spy):
        jax.eval_shape(lambda: model.apply({"params": params}, sample, timesteps, context, *extra))
    pairs = [(q, k) for (a, q), (b, k) in zip(seen[::2], seen[1::2]) if (a, b) == ("to_q", "to_k")]
    assert len(pairs) * 2 == len(seen)
    return Counter(pairs)


@pytest.mark.parametrize(
    "options",
    [
        dict(mode="tokens", use_rand=False),  # size-aware: log sizes on merged keys
        dict(mode="kv", use_rand=False),  # size-aware keys, all queries
        dict(mode="kv", use_rand=False, proportional_attn=False, ratio=0.6),
        dict(mode="queries", use_rand=False),  # keys whole: no bias
        dict(mode="tokens", matching="cell"),  # equal cells: no bias
        dict(mode="kv", matching="cell"),  # ToDo: 2x2 pooled keys and values
        dict(mode="kv", matching="cell", sx=3, sy=3),  # 16x16 grid: a leftover row and column
        dict(mode="kv", matching="cell", level_cells={1: 4, 2: 2}, max_downsample=2),
        dict(mode="queries", matching="cell", sx=3, sy=2),  # a leftover column
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_attn1_equals_the_numpy_arrangement(small, inputs, options, rel):
    unet, params = small
    patched = tome.patch(unet, **options)
    config = patched.tome
    similarity = None if config.matching == "cell" else (config.sx, config.sy, config.ratio)
    out, records = captured(patched, params, *inputs, similarity)
    assert np.isfinite(np.asarray(out)).all()
    assert len(records) == 4  # down 0, up 1 x2 at 1/1; the middle at 1/2
    for path, record in records.items():
        x = np.asarray(record["x"], np.float64)
        got = np.asarray(record["out"], np.float64)
        assert got.shape == x.shape  # seen from the block: all N tokens in, all N out
        rows = np.asarray(record["rows"]) if "rows" in record else None
        expected = expected_attn1(config, weights_at(params, path), x, rows)
        assert rel(got, expected) < 1e-4, path


def test_kv_keys_and_values_are_pooled_while_queries_keep_every_token(small, small_controlnet, inputs):
    unet, params = small
    sample, timesteps, context = inputs
    plain = Counter({(256, 256): 3, (64, 64): 1})
    assert kv_lengths(unet, params, *inputs) == plain
    cases = [
        (dict(mode="kv", matching="cell"), {(256, 64): 3, (64, 64): 1}),  # N / (2*2)
        (dict(mode="kv", matching="cell", sx=4, sy=2), {(256, 32): 3, (64, 64): 1}),  # N / (4*2)
        (dict(mode="kv", matching="cell", level_cells={1: 4, 2: 2}, max_downsample=2), {(256, 16): 3, (64, 16): 1}),
        (dict(mode="kv", matching="cell", level_cells={1: 4, 2: 2}, max_downsample=2, cell_pool="sample"), {(256, 16): 3, (64, 16): 1}),
        (dict(mode="kv", ratio=0.5), {(256, 128): 3, (64, 64): 1}),
        (dict(prefer="fidelity"), {(256, 128): 3, (64, 64): 1}),  # the knob: 2x1 cells, drawn
        (dict(prefer="speed"), {(256, 16): 3, (64, 64): 1}),  # 4x4 cells
        (dict(mode="queries", matching="cell"), {(64, 256): 3, (64, 64): 1}),
        (dict(mode="queries", ratio=0.25), {(192, 256): 3, (64, 64): 1}),
        (dict(mode="tokens", matching="cell"), {(64, 64): 4}),
    ]
    for options, expected in cases:
        assert kv_lengths(tome.patch(unet, **options), params, *inputs) == Counter(expected), options
    # A ControlNet (down 0 at 1/1, the middle at 1/2) arranges its blocks alike.
    controlnet, control_params = small_controlnet
    cond = jnp.zeros((2, 3, 32, 32))
    patched = tome.patch(controlnet, mode="kv", matching="cell", level_cells={1: 4, 2: 2}, max_downsample=2)
    assert kv_lengths(patched, control_params, sample, timesteps, context, cond) == Counter({(256, 16): 1, (64, 16): 1})


def test_nothing_pooled_or_merged_equals_unpatched_exactly(small, inputs, apply):
    unet, params = small
    plain = np.asarray(apply(unet, params, *inputs))
    with pytest.warns(UserWarning, match="1x1 cells pools nothing"):
        one = tome.patch(unet, mode="kv", matching="cell", sx=1, sy=1)
    np.testing.assert_array_equal(np.asarray(apply(one, params, *inputs)), plain)
    with pytest.warns(UserWarning, match="merges no tokens: ratio=0"):
        zero = tome.patch(unet, mode="queries", ratio=0.0)
    np.testing.assert_array_equal(np.asarray(apply(zero, params, *inputs)), plain)
    # A 1x1 cell at the one merged level, 2x2 elsewhere (unmerged with max_downsample=1): nothing pools.
    with pytest.warns(UserWarning, match="pools nothing"):
        level = tome.patch(unet, mode="kv", matching="cell", level_cells={1: 1})
    assert kv_lengths(level, params, *inputs) == Counter({(256, 256): 3, (64, 64): 1})


def test_size_aware_kv_attention_equals_attention_over_repeated_keys(rel):
    """Queries from all N tokens, keys/values merged with log sizes = FlaxAttention with every merged key
    repeated once per token it stands for (the module's own ``context`` path)."""
    h, w, channels = 8, 6, 32
    attention_module = FlaxAttention(channels, heads=4, dim_head=8)
    x = jax.random.normal(jax.random.key(0), (2, h * w, channels))
    variables = random_params(jax.eval_shape(attention_module.init, jax.random.key(1), x), seed=1)

    @jax.jit
    def run(variables, x):
        match = bipartite_match(get_ops(x), x, h, w, 2, 2, int(h * w * 0.6), None)
        merged = merge(x, match)
        got = attention_module.apply(variables, x, method=lambda m, q: _size_aware_attention(m, q, SizeBias(match, TEXT_NONE, merged), True, keys=merged))
        expected = attention_module.apply(variables, x, unmerge(merged, match))  # context: each token's slot value
        plain = attention_module.apply(variables, x, merged)  # no bias: not that oracle
        return got, expected, plain

    got, expected, plain = run(variables, x)
    assert got.shape == x.shape
    assert rel(np.asarray(got), np.asarray(expected)) < 1e-5
    assert rel(np.asarray(plain), np.asarray(expected)) > 1e-3


def test_kv_under_jit_with_the_hashed_partition_does_not_retrace_for_equal_options(small, inputs, apply, rel):
    unet, params = small
    first = apply(tome.patch(unet, mode="kv", ratio=0.5, seed=1), params, *inputs)  # size-aware kv, use_rand
    size = apply._cache_size()
    # An equal patched module, new values, same shapes: no retrace; the same seed gives the same output.
    again = tome.patch(unet, mode="kv", ratio=0.5, seed=1)
    np.testing.assert_array_equal(np.asarray(apply(again, params, *inputs)), np.asarray(first))
    other_step = apply(again, params, inputs[0], jnp.array([20, 20], jnp.int32), inputs[2])
    assert apply._cache_size() == size
    assert rel(other_step, first) > 1e-3  # another timestep: another partition, another output
    assert rel(first, apply(unet, params, *inputs)) > 1e-3


def test_new_options_enter_the_module_hash_and_the_pipeline_key(small):
    unet, _ = small
    variants = [
        dict(),
        dict(mode="kv"),
        dict(mode="queries"),
        dict(matching="cell"),
        dict(mode="kv", matching="cell"),
        dict(mode="kv", matching="cell", level_cells={1: 4}),
        dict(mode="kv", matching="cell", level_cells={1: 4, 2: 2}, max_downsample=2),
        dict(mode="kv", matching="cell", level_cells={1: (4, 2)}),
    ]
    modules = [tome.patch(unet, **options) for options in variants]
    assert len({config_key(m.tome) for m in modules}) == len(variants)
    assert len({hash(m) for m in modules}) == len(variants)
    assert len(set(modules)) == len(variants)
    # Equal options, written differently (n or (n, n)), are one key and one compiled module.
    same = tome.patch(unet, mode="kv", matching="cell", level_cells={1: (4, 4)})
    assert same == modules[5] and hash(same) == hash(modules[5])
    fields = {name for name, _ in config_key(modules[0].tome)}
    assert {"mode", "matching", "level_cells"} <= fields == {f.name for f in dataclasses.fields(modules[0].tome)}


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(mode="kv", blocks=[0]), ValueError, "blocks is not supported on jax"),
        (dict(mode="kv", reuse_steps=2), ValueError, "reuse_steps=2 is not supported on jax"),
        (dict(mode="both"), ValueError, "mode must be one of"),
        (dict(matching="pool"), ValueError, "matching must be one of"),
        (dict(matching="cell", ratio=0.5), ValueError, "contradicts matching='cell'"),
        (dict(matching="cell", reuse_level=True), ValueError, "reuse_level reuses a similarity match"),
        (dict(mode="kv", merge_attn=False), ValueError, "merge_attn=False leaves it alone"),
        (dict(matching="cell", level_cells={3: 2}), ValueError, "level_cells keys must be levels"),
    ],
)
def test_bad_arrangement_options_raise_before_anything_is_patched(small, options, error, message):
    with pytest.raises(error, match=message):
        tome.patch(small[0], **options)


@pytest.mark.parametrize("mode", ["kv", "queries"])
def test_only_cross_attention_refuses_kv_and_queries_with_a_clear_error(inputs, mode):
    unet, params = build_unet("tiny", seed=0, only_cross_attention=True, **TWO_LEVELS)
    patched = tome.patch(unet, mode=mode, matching="cell")
    refusal = rf"mode='{mode}' needs self-attention .* FlaxBasicTransformerBlock.attn1 attends to the text \(only_cross_attention=True\)"
    with pytest.raises(ValueError, match=refusal):
        jax.eval_shape(lambda: patched.apply({"params": params}, *inputs))
    jax.eval_shape(lambda: tome.patch(unet, matching="cell").apply({"params": params}, *inputs))  # tokens: fine


def test_kv_pipeline_compiled_runs_pooled_and_remove_restores_exactly(rel):
    from flax.jax_utils import replicate
    from flax.training.common_utils import shard

    pipe, params = build_pipeline("sd", seed=0, **TWO_LEVELS)
    ids = pipe.prepare_inputs(["a tiny test"])
    replicated, rng = replicate(params), jax.random.PRNGKey(0)

    def run():
        images = pipe(prompt_ids=shard(ids), params=replicated, prng_seed=rng[None], num_inference_steps=2,
                      jit=True, height=64, width=64).images
        return np.asarray(images).reshape((-1,) + images.shape[2:])

    def lengths():
        generate = partial(pipe._generate, ids, params, rng, 2, 64, 64, jnp.array([7.5]))
        seen = []

        def spy(next_fun, args, kwargs, ctx):
            if ctx.method_name == "__call__" and ctx.module.name == "to_k" and ctx.module.parent.name == "attn1":
                seen.append(int(args[0].shape[1]))
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(spy):
            jax.eval_shape(generate)
        return Counter(seen)

    plain = run()  # compiled before patching
    tome.patch(pipe, mode="kv", matching="cell", level_cells={1: 4})
    assert lengths() == Counter({1024 // 16: 3, 256: 1})  # 32x32 latents: 4x4-pooled keys at 1/1
    patched = run()
    assert np.isfinite(patched).all() and rel(patched, plain) > 1e-3
    tome.remove(pipe)
    np.testing.assert_array_equal(run(), plain)

"""The three arrangements around self-attention (``mode``: tokens / kv / queries) and the two matchings
(``matching``: similarity / cell) on ppdiffusers.

Oracles: attention written out in numpy from each ``attn1``'s own weights, fed the tokens that reached it
(recorded by hooks registered before the patch) and pooled or merged here; the unpatched model; the key and
query lengths seen inside ``attn1`` (hooks registered after the patch).
"""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import paddle
import pytest
from ppdiffusers.models import attention_processor
from ppdiffusers.models.attention_processor import Attention

import tome_core.paddle as tome
from tome_core import bipartite_match, get_ops, merge, unmerge
from tome_core.adapters import ppdiffusers as adapter
from tome_tools.ppdiffusers_models import build_transformer, build_unet, transformer_inputs

LATENT = 16  # the conftest inputs: a 16x16 latent, batch 2; levels 1, 2, 4 have 16x16, 8x8 and 4x4 tokens


# ---------------------------------------------------------------------------------------------------------
# References


def linear(layer: paddle.nn.Linear, x: np.ndarray) -> np.ndarray:
    y = x @ layer.weight.numpy().astype(np.float64)  # paddle stores [in, out]
    return y if layer.bias is None else y + layer.bias.numpy()


def numpy_attention(attn: Attention, queries: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """ppdiffusers' ``Attention`` (no norms, no mask) in float64: queries from ``queries`` ``[B, L, C]``, keys
    and values from ``keys`` ``[B, K, C]``."""
    heads = attn.heads
    split = lambda t: t.reshape(t.shape[0], t.shape[1], heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = split(linear(attn.to_q, queries)), split(linear(attn.to_k, keys)), split(linear(attn.to_v, keys))
    scores = q @ k.transpose(0, 1, 3, 2) * attn.scale
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(queries.shape[0], queries.shape[1], -1)
    return linear(attn.to_out[0], out)


def cell_slots(h: int, w: int, sx: int, sy: int) -> np.ndarray:
    """The pooled slot of each token of an ``h x w`` grid (row-major): its ``sx x sy`` cell (cells row-major),
    or a slot of its own after the cells for tokens in leftover rows and columns."""
    slots = np.full((h, w), -1)
    rows, cols = h // sy * sy, w // sx * sx
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    slots[:rows, :cols] = (r // sy) * (w // sx) + c // sx
    leftover = slots < 0
    slots[leftover] = (h // sy) * (w // sx) + np.arange(leftover.sum())
    return slots.reshape(-1)


def cell_pool(x: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``[B, N, C]`` -> the mean of the tokens of each slot ``[B, slots, C]``."""
    count = slots.max() + 1
    onehot = np.zeros((count, len(slots)))
    onehot[slots, np.arange(len(slots))] = 1
    return (onehot / onehot.sum(1, keepdims=True)) @ x


def block_match(seen: dict, merged: int):
    """The similarity match of one recorded call (use_rand=False: each 2x2 cell's first token is its
    destination), computed by the core's numpy backend from the block's input."""
    side = math.isqrt(seen["block_input"].shape[1])
    return bipartite_match(get_ops(seen["block_input"]), seen["block_input"], side, side, 2, 2, merged, None)


def level_of(tokens: int) -> int:
    return LATENT // math.isqrt(tokens)


# ---------------------------------------------------------------------------------------------------------
# Recording what attn1 receives and returns


class Attn1Calls:
    """Every ``attn1`` call of a UNet: its block's input and its own input (hooks registered now, before any
    patch, see the unmerged tokens), and, from hooks registered by :meth:`after_patch`, the query and key
    lengths it computed with and its output (after ToMe's own post-hook)."""

    def __init__(self, model):
        self.calls = []
        self.handles = []
        for path, block in model.named_sublayers():
            if type(block).__name__ == "BasicTransformerBlock":
                self.handles.append(block.register_forward_pre_hook(self._block, with_kwargs=True))
                self.handles.append(block.attn1.register_forward_pre_hook(self._enter, with_kwargs=True))
        self.model = model
        self.block_input = None

    def _block(self, layer, args, kwargs):
        self.block_input = (args[0] if args else kwargs["hidden_states"]).numpy().astype(np.float64)

    def _enter(self, layer, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        self.calls.append(dict(attn=layer, block_input=self.block_input, x=x.numpy().astype(np.float64)))

    def after_patch(self):
        for path, block in self.model.named_sublayers():
            if type(block).__name__ == "BasicTransformerBlock":
                self.handles.append(block.attn1.register_forward_pre_hook(self._seen, with_kwargs=True))
                self.handles.append(block.attn1.register_forward_post_hook(self._leave, with_kwargs=True))
        return self

    def _seen(self, layer, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        kv = kwargs.get("encoder_hidden_states")
        self.calls[-1].update(queries=hidden.shape[1], keys=None if kv is None else kv.shape[1])

    def _leave(self, layer, args, kwargs, output):
        self.calls[-1]["output"] = output.numpy().astype(np.float64)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=2e-5)


def patched_state(model):
    [(_, state)] = tome.patched_models(model)
    return state


# ---------------------------------------------------------------------------------------------------------
# kv: queries keep every token, keys and values are reduced


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # 2x2 cells at level 1: a strided mean
        dict(sx=3, sy=3),  # 16x16 is not a multiple of 3: cells, then the leftover tokens as they are
        dict(sx=2, sy=1, max_downsample=2),
        dict(level_cells={1: 4, 2: 2}, max_downsample=2),
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "2x2",
)
def test_kv_cell_equals_numpy_attention_over_cell_pooled_keys(unet, inputs, call, options):
    calls = Attn1Calls(unet)
    tome.patch(unet, mode="kv", matching="cell", **options)
    calls.after_patch()
    call(unet, inputs)
    config, deepest = patched_state(unet).config, patched_state(unet).max_downsample
    assert len(calls.calls) == 7  # three blocks at level 1, three at level 2, the mid block
    pooled_levels = set()
    for seen in calls.calls:
        tokens = seen["x"].shape[1]
        level, side = level_of(tokens), math.isqrt(tokens)
        assert seen["queries"] == tokens
        if level > deepest:
            assert seen["keys"] is None
            keys = seen["x"]
        else:
            keys = cell_pool(seen["x"], cell_slots(side, side, *config.cell_at(level)))
            assert seen["keys"] == keys.shape[1] < tokens
            assert np.abs(numpy_attention(seen["attn"], seen["x"], seen["x"]) - seen["output"]).max() > 1e-4
            pooled_levels.add(level)
        assert_close(seen["output"], numpy_attention(seen["attn"], seen["x"], keys))
    assert pooled_levels == {level for level in (1, 2) if level <= deepest}


def test_kv_with_1x1_cells_equals_unpatched_exactly(unet, tiny_unet, inputs, call):
    plain = call(tiny_unet, inputs)
    for options in (dict(sx=1, sy=1), dict(level_cells={1: 1, 2: (1, 1)}, max_downsample=2)):
        with pytest.warns(UserWarning, match="1x1 cells pools nothing"):
            tome.patch(unet, mode="kv", matching="cell", **options)
        np.testing.assert_array_equal(call(unet, inputs), plain)


def test_kv_lengths_inside_attn1_follow_the_cell_of_each_level(unet, inputs, call):
    tome.patch(unet, mode="kv", matching="cell", level_cells={1: 4, 2: 2}, max_downsample=2)
    seen = []

    def lengths(layer, args, kwargs):
        kv = kwargs.get("encoder_hidden_states")
        seen.append(((args[0] if args else kwargs["hidden_states"]).shape[1], None if kv is None else kv.shape[1]))

    for path, layer in unet.named_sublayers():
        if path.endswith("attn1"):
            layer.register_forward_pre_hook(lengths, with_kwargs=True)
    call(unet, inputs)
    # queries N; keys N / (sx * sy): 256 / 16 at level 1 (4x4), 64 / 4 at level 2 (2x2); the mid block (4x4
    # tokens, level 4) is not reduced and attends to itself.
    assert sorted(seen, key=str) == sorted([(256, 16)] * 3 + [(64, 16)] * 3 + [(16, None)], key=str)
    stats = patched_state(unet).ledger.stats
    assert (stats[1].tokens, stats[1].kept, stats[2].tokens, stats[2].kept) == (256, 16, 64, 16)


@pytest.mark.parametrize("prefer, kept", [("fidelity", 128), ("balance", 64), ("speed", 16)])
def test_the_knob_pools_the_finest_level_in_its_cells(unet, inputs, call, prefer, kept):
    """``prefer`` (docs/fidelity.md, "One knob"): 2x1, 2x2, 4x4 cells of the 16x16 finest level, as on torch."""
    tome.patch(unet, prefer=prefer)
    call(unet, inputs)
    stats = patched_state(unet).ledger.stats
    assert (stats[1].tokens, stats[1].kept) == (256, kept) and set(stats) == {1}


# ---------------------------------------------------------------------------------------------------------
# kv with similarity matching: size-aware attention on each of its routes


ROUTES = [
    ("AttnProcessor", "mask"),  # the CPU default: the log sizes as attention_mask
    ("SlicedAttnProcessor", "mask"),
    ("XFormersAttnProcessor", "mask"),  # = AttnProcessor2_5: attention_mask, then scaled_dot_product_attention_
    ("XFormersAttnProcessor", "sdpa"),  # no mask: the wrapped scaled_dot_product_attention_ adds the sizes
]


@pytest.mark.parametrize("processor, route", ROUTES, ids=lambda v: str(v))
def test_kv_similarity_size_aware_equals_attention_over_keys_repeated_by_size(
    unet, inputs, call, sdpa_shim, monkeypatch, processor, route
):
    for path, layer in unet.named_sublayers():
        if path.endswith("attn1"):
            sliced = processor == "SlicedAttnProcessor"
            layer.set_processor(getattr(attention_processor, processor)(*((4,) if sliced else ())))
    if route == "sdpa":  # take the processor off the mask route: the sizes must come through the attention function
        monkeypatch.setattr(adapter, "MASK_PROCESSORS", adapter.MASK_PROCESSORS - {processor})
    wrapped, arm = [], adapter._SdpaWrapper.arm  # the calls that armed the wrapper
    monkeypatch.setattr(adapter._SdpaWrapper, "arm", lambda self, armed: wrapped.append(armed) or arm(self, armed))
    calls = Attn1Calls(unet)
    tome.patch(unet, mode="kv", ratio=0.5, use_rand=False, proportional_attn=True)
    calls.after_patch()
    call(unet, inputs)
    merged_calls = 0
    for seen in calls.calls:
        tokens = seen["x"].shape[1]
        assert seen["queries"] == tokens
        if level_of(tokens) > 1:
            assert seen["keys"] is None
            assert_close(seen["output"], numpy_attention(seen["attn"], seen["x"], seen["x"]))
            continue
        match = block_match(seen, tokens // 2)
        assert seen["keys"] == match.kept == tokens - tokens // 2
        repeated = unmerge(merge(seen["x"], match), match)  # each merged key once per token it stands for
        assert_close(seen["output"], numpy_attention(seen["attn"], seen["x"], repeated))
        plain = numpy_attention(seen["attn"], seen["x"], merge(seen["x"], match))
        assert np.abs(plain - seen["output"]).max() > 1e-4  # the sizes made a difference
        merged_calls += 1
    assert merged_calls == 3
    assert len(wrapped) == (merged_calls if route == "sdpa" else 0)
    assert paddle.nn.functional.scaled_dot_product_attention_ is sdpa_shim  # the wrapper is gone


def test_kv_similarity_without_size_aware_attends_to_the_merged_keys(unet, inputs, call):
    calls = Attn1Calls(unet)
    tome.patch(unet, mode="kv", ratio=0.75, use_rand=False, proportional_attn=False)
    calls.after_patch()
    call(unet, inputs)
    seen = next(c for c in calls.calls if c["x"].shape[1] == 256)
    match = block_match(seen, 192)
    assert seen["keys"] == 64
    assert_close(seen["output"], numpy_attention(seen["attn"], seen["x"], merge(seen["x"], match)))


# ---------------------------------------------------------------------------------------------------------
# queries: queries merged, keys and values keep every token, output unmerged


def test_queries_at_ratio_zero_is_exact(unet, tiny_unet, inputs, call):
    with pytest.warns(UserWarning, match="merges no tokens"):
        tome.patch(unet, mode="queries", ratio=0.0)
    np.testing.assert_array_equal(call(unet, inputs), call(tiny_unet, inputs))


@pytest.mark.parametrize("matching", ["cell", "similarity"])
def test_queries_equals_numpy_attention_of_merged_queries_over_every_token(unet, inputs, call, matching):
    calls = Attn1Calls(unet)
    tome.patch(unet, mode="queries", matching=matching, use_rand=False, max_downsample=2)
    calls.after_patch()
    call(unet, inputs)
    merged_calls = 0
    for seen in calls.calls:
        x, tokens = seen["x"], seen["x"].shape[1]
        if level_of(tokens) > 2:
            assert (seen["queries"], seen["keys"]) == (tokens, None)
            assert_close(seen["output"], numpy_attention(seen["attn"], x, x))
            continue
        side = math.isqrt(tokens)
        if matching == "cell":
            slots = cell_slots(side, side, 2, 2)
            queries, spread = cell_pool(x, slots), lambda y: y[:, slots]  # noqa: E731
        else:
            match = block_match(seen, tokens // 2)
            queries, spread = merge(x, match), lambda y: unmerge(y, match)  # noqa: E731
        assert (seen["queries"], seen["keys"]) == (queries.shape[1], tokens)
        assert seen["output"].shape == x.shape
        assert_close(seen["output"], spread(numpy_attention(seen["attn"], queries, x)))
        assert np.abs(numpy_attention(seen["attn"], x, x) - seen["output"]).max() > 1e-4
        merged_calls += 1
    assert merged_calls == 6


# ---------------------------------------------------------------------------------------------------------
# Every arrangement: patch, replace and remove


ARRANGEMENTS = [(mode, matching) for mode in ("tokens", "kv", "queries") for matching in ("similarity", "cell")]


@pytest.mark.parametrize("mode, matching", ARRANGEMENTS)
def test_every_arrangement_changes_the_output_keeps_keyword_calls_and_removes_exactly(
    unet, tiny_unet, inputs, call, mode, matching
):
    plain = call(tiny_unet, inputs)
    tome.patch(unet, mode=mode, matching=matching)
    patched = call(unet, inputs)
    assert np.isfinite(patched).all() and np.abs(patched - plain).max() > 1e-4
    np.testing.assert_array_equal(call(unet, inputs, keywords=True), patched)
    # Patching again with another arrangement replaces this one.
    other = dict(mode="kv" if mode != "kv" else "queries", matching=matching)
    np.testing.assert_array_equal(
        call(tome.patch(unet, **other), inputs), call(tome.patch(copy.deepcopy(tiny_unet), **other), inputs)
    )
    tome.remove(unet)
    assert tome.patched_models(unet) == []
    assert not any(m._forward_pre_hooks or m._forward_post_hooks for m in unet.sublayers(True))
    np.testing.assert_array_equal(call(unet, inputs), plain)


@pytest.mark.parametrize("mode, matching", [("kv", "cell"), ("kv", "similarity"), ("queries", "cell")])
def test_arrangements_run_in_a_patchified_dit_and_remove_exactly(mode, matching):
    """ppdiffusers' DiT (``Transformer2DModel`` with adaLN-zero blocks): 8x8 tokens, attn1 arranged alike."""
    model = build_transformer("tiny-dit")
    inputs = transformer_inputs(model, 16, 16, batch=2)
    run = lambda: model(**inputs).sample.numpy()  # noqa: E731
    with paddle.no_grad():
        plain = run()
        tome.patch(model, mode=mode, matching=matching)
        seen = []
        handle = model.transformer_blocks[0].attn1.register_forward_pre_hook(
            lambda layer, args, kwargs: seen.append((args[0].shape[1], kwargs["encoder_hidden_states"].shape[1])),
            with_kwargs=True,
        )
        patched = run()
        handle.remove()
        assert np.isfinite(patched).all() and np.abs(patched - plain).max() > 1e-4
        kept = 16 if matching == "cell" else 32
        assert seen == [(64, kept) if mode == "kv" else (kept, 64)]
        tome.remove(model)
        np.testing.assert_array_equal(run(), plain)


def test_kv_replaces_ppdiffusers_own_port_and_remove_undoes_both(unet, tiny_unet, inputs, call):
    plain = call(tiny_unet, inputs)
    tome.PPDIFFUSERS_APPLY_TOME(unet, ratio=0.5, use_rand=False)
    tome.patch(unet, mode="kv", matching="cell")
    fresh = tome.patch(copy.deepcopy(tiny_unet), mode="kv", matching="cell")
    np.testing.assert_array_equal(call(unet, inputs), call(fresh, inputs))
    tome.remove(unet)
    assert not any(type(m).__name__.startswith("ToMe") for m in unet.sublayers(True))
    np.testing.assert_array_equal(call(unet, inputs), plain)


# ---------------------------------------------------------------------------------------------------------
# Combinations that do not make sense


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(mode="kv", merge_attn=False), ValueError, "mode='kv' arranges self-attention, but merge_attn=False"),
        (dict(mode="queries", merge_attn=False, merge_mlp=True), ValueError, "merge_attn=False leaves it alone"),
        (dict(mode="values"), ValueError, "mode must be one of 'auto', 'tokens', 'kv', 'queries'"),
        (dict(matching="pool"), ValueError, "matching must be one of 'similarity', 'cell'"),
        (dict(matching="cell", ratio=0.5), ValueError, "contradicts matching='cell' with 2x2 cells"),
        (dict(matching="cell", level_ratios={1: 0.5}), ValueError, "level_ratios cannot be combined with matching="),
        (dict(matching="cell", reuse_steps=2), ValueError, "reuse_steps reuses a similarity match"),
        (dict(matching="cell", level_cells={1: 4, 2: 2}, ratio=0.75), ValueError, "level_cells of other sizes"),
        (dict(level_cells={3: 2}), ValueError, "level_cells keys must be levels"),
        (dict(level_cells={1: (2, 0)}), ValueError, r"level_cells\[1\] must be an int >= 1"),
    ],
)
def test_bad_combinations_raise_and_keep_the_earlier_patch(unet, options, error, message):
    tome.patch(unet, mode="kv", matching="cell")
    with pytest.raises(error, match=message):
        tome.patch(unet, **options)
    with pytest.raises(error, match=message):
        unet.apply_tome(**options)
    assert patched_state(unet).config.mode == "kv"


def test_queries_refuse_joint_attention_at_patch_time():
    """(``kv`` runs there, inside the attention function: test_kv_in_kernel.py.)"""
    model = build_transformer("tiny-sd3")
    with pytest.raises(ValueError, match="mode='queries' needs self-attention that takes keys and values apart"):
        tome.patch(model, mode="queries")
    assert tome.patched_models(model) == []


def test_kv_refuses_an_attn1_that_attends_to_text(inputs, call):
    """An explicit kv is refused by patch (issue 35); the default runs ToMe for SD's arrangement there."""
    unet = build_unet("tiny", seed=0, only_cross_attention=True)
    with pytest.raises(ValueError, match=r"mode='kv' needs .*\.attn1 attends to the text \(only_cross_attention=True\)"):
        tome.patch(unet, mode="kv", matching="cell")
    assert tome.patched_models(unet) == []
    tome.patch(unet, matching="cell")  # tokens: the queries merge, the text keys stay
    assert np.isfinite(call(unet, inputs)).all()
    tome.patch(unet)
    assert np.isfinite(call(unet, inputs)).all()
    assert "so ToMe for SD's arrangement runs there" in tome.patched_models(unet)[0][1].summary()


def test_kv_and_queries_refuse_a_processor_that_takes_no_separate_keys(unet, inputs, call):
    """Refused by patch when the processor is set (issue 35), by the first call when it is set after patch."""
    def set_processors():
        for path, layer in unet.named_sublayers():
            if path.endswith("attn1"):
                layer.set_processor(attention_processor.CustomDiffusionAttnProcessor(train_kv=False, train_q_out=False))

    for mode in ("kv", "queries"):
        tome.remove(unet)
        unet.set_attn_processor(attention_processor.AttnProcessor())
        tome.patch(unet, mode=mode)
        set_processors()
        message = f"mode='{mode}' needs self-attention that takes keys and values apart.*CustomDiffusionAttnProcessor"
        with pytest.raises(ValueError, match=message):
            call(unet, inputs)
        with pytest.raises(ValueError, match=message):
            tome.patch(unet, mode=mode)
    tome.remove(unet)
    assert np.isfinite(call(unet, inputs)).all()


def test_separate_kv_follows_the_processor_and_one_sided_norms():
    paddle.seed(0)
    plain = Attention(query_dim=32, heads=2, dim_head=16)
    assert adapter.FRAMEWORK.separate_kv(plain)
    for processor in (attention_processor.XFormersAttnProcessor(), attention_processor.SlicedAttnProcessor(2)):
        plain.set_processor(processor)
        assert adapter.FRAMEWORK.separate_kv(plain)
    plain.set_processor(attention_processor.AttnAddedKVProcessor())
    assert not adapter.FRAMEWORK.separate_kv(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grouped = Attention(query_dim=32, heads=2, dim_head=16, norm_num_groups=8)
    assert not adapter.FRAMEWORK.separate_kv(grouped)  # its group norm would reach the queries only

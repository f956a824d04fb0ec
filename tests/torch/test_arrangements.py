"""The three arrangements around self-attention (mode tokens / kv / queries) and the two matchings (similarity /
cell) on torch. Oracles: attention computed in numpy from the module's own weights over the tokens the
arrangement prescribes (merged by the numpy backend of the core), the unpatched model, and the token counts
each attention really receives."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

import tome_core.torch as tome
from tome_core import bipartite_match, load_backend, merge, unmerge
from tome_tools.diffusers_models import build_pipeline, build_transformer, build_unet, transformer_inputs

NUMPY = load_backend("numpy")


def call(model, inputs):
    sample, t, text = inputs
    with torch.no_grad():
        return model(sample, t, text).sample


def rel(a, b):
    return float((a - b).norm() / b.norm())


def numpy_attention(attn, queries, keys, bias=None):
    """diffusers' Attention computed in float64 numpy from its weights: ``queries [B, L, C]`` attend to
    ``keys [B, K, C]`` (keys and values from the same tokens); ``bias [B, 1, K]`` is added to the logits."""
    weight = lambda linear: linear.weight.detach().double().numpy()
    q, k, v = queries @ weight(attn.to_q).T, keys @ weight(attn.to_k).T, keys @ weight(attn.to_v).T
    heads = attn.heads
    split = lambda t: t.reshape(t.shape[0], t.shape[1], heads, -1).transpose(0, 2, 1, 3)
    q, k, v = split(q), split(k), split(v)
    logits = q @ k.transpose(0, 1, 3, 2) * q.shape[-1] ** -0.5
    if bias is not None:
        logits = logits + bias[:, None]
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1)
    return out @ weight(attn.to_out[0]).T + attn.to_out[0].bias.detach().double().numpy()


def recorded_attn1(model, patch_options, inputs):
    """Patch a copy of ``model`` and run it; for every merged-level block: the block input (the match's metric),
    attn1's unmerged input and attn1's output (after ToMe's unmerge)."""
    model = copy.deepcopy(model)
    records = []
    for name, block in model.named_modules():
        if type(block).__name__ == "BasicTransformerBlock":
            entry = {}
            records.append(entry)
            block.register_forward_pre_hook(lambda m, a, k, e=entry: e.update(metric=a[0] if a else k["hidden_states"]), with_kwargs=True)
            block.attn1.register_forward_pre_hook(lambda m, a, k, e=entry: e.update(h=a[0] if a else k["hidden_states"]), with_kwargs=True)
    tome.patch(model, **patch_options)
    for entry, block in zip(records, [b for b in model.modules() if type(b).__name__ == "BasicTransformerBlock"]):
        block.attn1.register_forward_hook(lambda m, a, k, out, e=entry, attn=block.attn1: e.update(out=out, attn=attn), with_kwargs=True)
    call(model, inputs)
    return [e for e in records if e["h"].shape[1] == 256]  # level 1 of the 16x16 latent


def as_numpy(t):
    return t.detach().double().numpy()


def pooled(h, size=2, grid=16):
    b, n, c = h.shape
    cells = h.reshape(b, grid // size, size, grid // size, size, c).mean(axis=(2, 4))
    return cells.reshape(b, -1, c)


def test_kv_with_cells_attends_to_pooled_keys_and_values(unet, inputs):
    records = recorded_attn1(unet, {"mode": "kv", "matching": "cell"}, inputs)
    assert len(records) == 3
    for entry in records:
        h = as_numpy(entry["h"])
        expected = numpy_attention(entry["attn"], h, pooled(h))
        np.testing.assert_allclose(as_numpy(entry["out"]), expected, rtol=1e-4, atol=1e-5)


def picked_in_cells(unet, options, inputs):
    """``[blocks, 64]``: for every level-1 attn1 of a patched copy, which token of each 2x2 cell (0-3) its keys
    are, found by brute force (each key must equal exactly one token of its own cell)."""
    model = tome.patch(copy.deepcopy(unet), **options)
    seen = []

    def hook(module, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"], kwargs.get("encoder_hidden_states")))

    for name, module in model.named_modules():
        if name.endswith("attn1"):
            module.register_forward_pre_hook(hook, with_kwargs=True)
    call(model, inputs)
    picks = []
    for h, keys in seen:
        if h.shape[1] != 256:
            continue
        cells = as_numpy(h).reshape(h.shape[0], 8, 2, 8, 2, -1).transpose(0, 1, 3, 2, 4, 5).reshape(h.shape[0], 64, 4, -1)
        equal = (cells == as_numpy(keys)[:, :, None]).all(-1)  # [B, 64 cells, 4 tokens]
        assert (equal.sum(-1) == 1).all() and (equal[0] == equal).all()  # one token per cell, the same in the batch
        picks.append(equal[0].argmax(-1))
    return np.stack(picks)


def test_kv_with_sampled_cells_attends_to_one_token_of_each_cell(unet, inputs):
    """use_rand=False: each cell's first token (strided downsampling; numpy oracle). use_rand: one token of each
    cell, drawn again for another timestep and in every block, and the same draw for the same call."""
    options = {"mode": "kv", "matching": "cell", "cell_pool": "sample"}
    for entry in recorded_attn1(unet, {**options, "use_rand": False}, inputs):
        h = as_numpy(entry["h"])
        strided = h.reshape(h.shape[0], 16, 16, -1)[:, ::2, ::2].reshape(h.shape[0], 64, -1)
        np.testing.assert_allclose(as_numpy(entry["out"]), numpy_attention(entry["attn"], h, strided), rtol=1e-4, atol=1e-5)
    sample, _, text = inputs
    drawn = [picked_in_cells(unet, options, (sample, torch.tensor(t), text)) for t in (500, 500, 499)]
    assert drawn[0].shape == (3, 64) and (drawn[0] == drawn[1]).all() and (drawn[0] != drawn[2]).mean() > 0.5
    assert (drawn[0][0] != drawn[0][1]).mean() > 0.5 and set(drawn[0].ravel()) == {0, 1, 2, 3}
    assert (picked_in_cells(unet, {**options, "use_rand": False}, inputs) == 0).all()


def test_kv_with_similarity_attends_to_merged_keys_weighted_by_their_sizes(unet, inputs):
    records = recorded_attn1(unet, {"mode": "kv", "ratio": 0.5, "use_rand": False}, inputs)
    for entry in records:
        h = as_numpy(entry["h"])
        match = bipartite_match(NUMPY, as_numpy(entry["metric"]), 16, 16, 2, 2, 128, None)
        keys = merge(h, match)
        expected = numpy_attention(entry["attn"], h, keys, bias=np.log(match.sizes).transpose(0, 2, 1))
        np.testing.assert_allclose(as_numpy(entry["out"]), expected, rtol=1e-4, atol=1e-5)
    plain = recorded_attn1(unet, {"mode": "kv", "ratio": 0.5, "use_rand": False, "proportional_attn": False}, inputs)
    for entry in plain:
        h = as_numpy(entry["h"])
        match = bipartite_match(NUMPY, as_numpy(entry["metric"]), 16, 16, 2, 2, 128, None)
        np.testing.assert_allclose(as_numpy(entry["out"]), numpy_attention(entry["attn"], h, merge(h, match)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("matching", ["similarity", "cell"])
def test_queries_merge_only_the_queries_and_unmerge_the_output(unet, inputs, matching):
    options = {"mode": "queries", "matching": matching, "use_rand": False}
    for entry in recorded_attn1(unet, options, inputs):
        h = as_numpy(entry["h"])
        if matching == "cell":
            from tome_core import cell_match

            match = cell_match(NUMPY, h, 2, 16, 16, 2, 2)
        else:
            match = bipartite_match(NUMPY, as_numpy(entry["metric"]), 16, 16, 2, 2, 128, None)
        expected = unmerge(numpy_attention(entry["attn"], merge(h, match), h), match)
        np.testing.assert_allclose(as_numpy(entry["out"]), expected, rtol=1e-4, atol=1e-5)


def test_nothing_reduced_is_exactly_unpatched(unet, inputs):
    reference = call(unet, inputs)
    for options in ({"mode": "kv", "matching": "cell", "sx": 1, "sy": 1}, {"mode": "queries", "ratio": 0.0}, {"mode": "kv", "ratio": 0.0}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tome.patch(copy.deepcopy(unet), **options)
        torch.testing.assert_close(call(model, inputs), reference, rtol=0, atol=0)


def lengths_seen(model, inputs):
    """``(query length, key/value length)`` of every attn1 call (hooks added after ToMe's see its arguments)."""
    seen = set()

    def hook(module, args, kwargs):
        queries = args[0] if args else kwargs["hidden_states"]
        keys = kwargs.get("encoder_hidden_states")
        seen.add((queries.shape[1], queries.shape[1] if keys is None else keys.shape[1]))

    for name, module in model.named_modules():
        if name.endswith("attn1"):
            module.register_forward_pre_hook(hook, with_kwargs=True)
    call(model, inputs)
    return seen


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"mode": "kv", "matching": "cell"}, {(256, 64), (64, 64), (16, 16)}),  # N -> N / (2*2) at level 1 only
        ({"mode": "kv", "matching": "cell", "sx": 4, "sy": 4}, {(256, 16), (64, 64), (16, 16)}),
        ({"mode": "kv", "matching": "cell", "level_cells": {1: 4, 2: 2}, "max_downsample": 2}, {(256, 16), (64, 16), (16, 16)}),
        ({"mode": "kv", "matching": "cell", "level_cells": {1: 4, 2: 2}, "max_downsample": 2, "cell_pool": "sample"}, {(256, 16), (64, 16), (16, 16)}),
        ({"mode": "tokens", "matching": "cell", "cell_pool": "sample"}, {(64, 64), (16, 16)}),
        ({"mode": "kv", "ratio": 0.75}, {(256, 64), (64, 64), (16, 16)}),
        ({"mode": "queries", "ratio": 0.5}, {(128, 256), (64, 64), (16, 16)}),
        ({"mode": "tokens", "matching": "cell"}, {(64, 64), (16, 16)}),
    ],
)
def test_lengths_attention_really_sees(unet, inputs, options, expected):
    assert lengths_seen(tome.patch(copy.deepcopy(unet), **options), inputs) == expected


def test_cells_on_grids_they_do_not_tile(unet):
    """A 12x20 latent: level 1 is 12x20 (15 full 4x4 cells), level 2 is 6x10 (2 full 4x4 cells and 28 leftover
    tokens that stay as they are)."""
    generator = torch.Generator().manual_seed(1)
    odd = torch.randn(1, 4, 12, 20, generator=generator), torch.tensor(500), torch.randn(1, 7, 32, generator=generator)
    model = tome.patch(copy.deepcopy(unet), mode="kv", matching="cell", sx=4, sy=4, max_downsample=2)
    assert lengths_seen(model, odd) == {(240, 15), (60, 2 + 28), (15, 15)}
    assert rel(call(model, odd), call(unet, odd)) < 0.2


def test_queries_refuse_joint_attention_at_patch():
    """(``kv`` runs there, inside the attention kernel: test_kv_in_kernel.py.)"""
    sd3 = build_transformer("tiny-sd3")
    with pytest.raises(ValueError, match=r"mode='queries' needs self-attention that takes keys and values apart.*JointTransformerBlock"):
        tome.patch(sd3, mode="queries")
    assert not tome.patched_models(sd3)
    pixart = build_transformer("tiny-pixart")  # BasicTransformerBlocks: every arrangement works
    inputs = transformer_inputs(pixart, 16, 16, batch=2)
    with torch.no_grad():
        reference = pixart(**inputs).sample
        tome.patch(pixart, mode="kv", matching="cell")
        assert 0 < rel(pixart(**inputs).sample, reference) < 0.2
        tome.remove(pixart)
        torch.testing.assert_close(pixart(**inputs).sample, reference, rtol=0, atol=0)


def test_a_processor_that_ignores_separate_keys_is_refused_by_name(unet, inputs):
    from diffusers.models.attention_processor import PAGIdentitySelfAttnProcessor2_0

    model = tome.patch(copy.deepcopy(unet), mode="kv", matching="cell")
    model.down_blocks[0].attentions[0].transformer_blocks[0].attn1.set_processor(PAGIdentitySelfAttnProcessor2_0())
    refusal = "mode='{}' needs self-attention that takes keys and values apart.*block 0 of UNet2DConditionModel.*{}"
    with pytest.raises(ValueError, match=refusal.format("kv", "PAGIdentitySelfAttnProcessor2_0")):
        call(model, inputs)
    with pytest.raises(ValueError, match=refusal.format("kv", "PAGIdentitySelfAttnProcessor2_0")):
        tome.patch(model, mode="kv", matching="cell")  # issue 35: refused at patch when the processor is set
    fused = tome.patch(copy.deepcopy(unet), mode="queries")
    fused.fuse_qkv_projections()  # one query-key-value projection: no separate keys and values
    with pytest.raises(ValueError, match=refusal.format("queries", "FusedAttnProcessor2_0.*fused projections")):
        call(fused, inputs)
    with pytest.raises(ValueError, match=refusal.format("queries", "FusedAttnProcessor2_0")):
        tome.patch(fused, mode="queries")


@pytest.mark.parametrize("processor", ["classic", "sliced"])
def test_kv_through_other_processors(unet, inputs, processor):
    from diffusers.models.attention_processor import AttnProcessor

    reference = tome.patch(copy.deepcopy(unet), mode="kv", ratio=0.5)
    model = copy.deepcopy(unet)
    if processor == "classic":
        model.set_attn_processor(AttnProcessor())
    else:
        model.set_attention_slice(1)
    tome.patch(model, mode="kv", ratio=0.5)
    torch.testing.assert_close(call(model, inputs), call(reference, inputs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", [{"mode": "kv", "matching": "cell"}, {"mode": "kv"}, {"mode": "queries"}, {"prefer": "fidelity"}])
def test_arrangements_trace_into_one_graph(unet, inputs, options):
    """fullgraph: a graph break raises. aot_eager traces what inductor would compile, without its codegen
    (tests/torch/test_transformers.py compiles with inductor once)."""
    model = tome.patch(copy.deepcopy(unet), **options)
    eager = call(model, inputs)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(call(compiled, inputs), eager, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["sd", "sdxl", "controlnet"])
def test_pipelines_run_in_kv_mode_and_remove_restores(kind):
    pipe = build_pipeline(kind)
    kwargs = dict(prompt="a photo", num_inference_steps=2, output_type="np", height=64, width=64)
    if kind == "controlnet":
        kwargs["image"] = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    run = lambda: pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    reference = run()
    tome.patch(pipe, mode="kv", matching="cell")
    merged = run()
    assert 0 < np.abs(merged - reference).max() < 0.5
    assert all(state.ledger.stats for _, state in tome.patched_models(pipe))
    tome.remove(pipe)
    np.testing.assert_array_equal(run(), reference)


# ------------------------------------------------------------------------------- the default per model kind
# Issue 32: chosen on the trained models (README, "Fidelity on small trained models"): where self-attention
# takes separate keys, keys/values in cells, each cell one token drawn per call and block; ToMe for SD at 0.5
# where it does not (joint attention, rotary keys).

DEFAULTS = {
    # model kind: (builder, what patch(model) runs: mode, matching, cell side, cell pool, ratio)
    "unet": (lambda: build_unet("tiny"), ("kv", "cell", 2, "sample", 0.75)),
    "pixart": (lambda: build_transformer("tiny-pixart"), ("kv", "cell", 2, "sample", 0.75)),
    "sd3": (lambda: build_transformer("tiny-sd3"), ("tokens", "similarity", 2, None, 0.5)),
    "flux": (lambda: build_transformer("tiny-flux"), ("tokens", "similarity", 2, None, 0.5)),
}


@pytest.mark.parametrize("kind", DEFAULTS)
def test_the_default_per_model_kind(kind):
    build, expected = DEFAULTS[kind]
    model = tome.patch(build())
    (_, state), = tome.patched_models(model)
    chosen = state.choices[-1][1]
    assert (chosen.mode, chosen.matching, chosen.sx, chosen.cell_pool, chosen.ratio) == expected
    if chosen.mode == "kv":  # 4x4 cells from 128x128 tokens at the finest merged level
        assert [(tokens, c.sx, c.cell_pool) for tokens, c in state.choices] == [(128 * 128, 4, "sample"), (0, 2, "sample")]


# The one knob (docs/fidelity.md, "One knob"): what each setting runs per model kind, ((fewest tokens, cell), ...)
# where keys and values pool, else ToMe for SD's ratio.
KNOB = {
    ("unet", "fidelity"): [(0, (2, 1))], ("unet", "speed"): [(0, (4, 4))],
    ("pixart", "fidelity"): [(0, (2, 1))], ("pixart", "speed"): [(128 * 128, (4, 4)), (0, (4, 2))],
    ("unet", "balance"): [(128 * 128, (4, 4)), (0, (2, 2))],
    ("sd3", "fidelity"): 0.25, ("sd3", "balance"): 0.5, ("sd3", "speed"): 0.75,
    ("flux", "fidelity"): 0.25, ("flux", "speed"): 0.75,
}


@pytest.mark.parametrize("kind, prefer", KNOB, ids=lambda v: str(v))
def test_the_knob_per_model_kind(kind, prefer):
    model = tome.patch(DEFAULTS[kind][0](), prefer=prefer)
    (_, state), = tome.patched_models(model)
    expected = KNOB[kind, prefer]
    if isinstance(expected, float):
        assert [(c.mode, c.matching, c.ratio) for _, c in state.choices] == [("tokens", "similarity", expected)]
    else:
        assert [(tokens, (c.sx, c.sy)) for tokens, c in state.choices] == expected
        assert {(c.mode, c.matching, c.cell_pool) for _, c in state.choices} == {("kv", "cell", "sample")}


def test_each_knob_setting_equals_its_explicit_options_and_attention_sees_its_keys(unet, inputs):
    seen = []
    explicit = {
        "fidelity": dict(mode="kv", matching="cell", cell_pool="sample", sx=2, sy=1),
        "balance": dict(mode="kv", matching="cell", cell_pool="sample"),
        "speed": dict(mode="kv", matching="cell", cell_pool="sample", sx=4, sy=4),
    }
    for prefer, options in explicit.items():
        model = tome.patch(copy.deepcopy(unet), prefer=prefer)
        attn = next(m for name, m in model.named_modules() if name.endswith("attn1"))
        attn.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["encoder_hidden_states"].shape[1]), with_kwargs=True)
        torch.testing.assert_close(call(model, inputs), call(tome.patch(copy.deepcopy(unet), **options), inputs), rtol=0, atol=0)
    tokens = inputs[0].shape[-2] * inputs[0].shape[-1]  # the finest level of the tiny UNet: the latent's grid
    assert seen == [tokens // 2, tokens // 4, tokens // 16]


def test_the_knob_on_joint_attention_equals_tome_for_sd_at_its_ratio():
    model = build_transformer("tiny-flux")
    x = transformer_inputs(model, 16, 16)
    with torch.no_grad():
        for prefer, ratio in (("fidelity", 0.25), ("speed", 0.75)):
            tome.patch(model, prefer=prefer)
            knob = model(**x).sample
            tome.patch(model, ratio=ratio)
            torch.testing.assert_close(knob, model(**x).sample, rtol=0, atol=0)
    tome.remove(model)


def test_the_default_equals_its_explicit_options_and_keeps_the_mean_when_asked(unet, inputs):
    auto = call(tome.patch(copy.deepcopy(unet)), inputs)
    explicit = call(tome.patch(copy.deepcopy(unet), mode="kv", matching="cell", cell_pool="sample"), inputs)
    torch.testing.assert_close(auto, explicit, rtol=0, atol=0)
    mean = call(tome.patch(copy.deepcopy(unet), cell_pool="mean"), inputs)
    torch.testing.assert_close(mean, call(tome.patch(copy.deepcopy(unet), mode="kv", matching="cell"), inputs), rtol=0, atol=0)
    assert not torch.equal(mean, auto)

"""Diffusion transformers on torch: SD3 (MM-DiT), Flux (double and single stream, rotary), PixArt, their
pipelines and ControlNets. Oracles: the unpatched model, attention over tokens repeated by their sizes, the
core's own match, token counts seen inside the attention modules."""

from __future__ import annotations

import warnings

import pytest
import torch

import tome_core.torch as tome
from tome_core.adapters.diffusers import FRAMEWORK
from tome_tools.diffusers_models import (
    TRANSFORMER_PIPELINES,
    build_transformer,
    build_transformer_pipeline,
    transformer_inputs,
)
from tome_core.hooks.attention_bias import SizeBias
from tome_core.hooks.block_hooks import merge_positions
from tome_core.models.families import TEXT_AFTER, TEXT_BEFORE, TEXT_NONE, TEXT_PREFIX
from tome_core.algorithm.backend import get_ops
from tome_core.algorithm.merge import merge, unmerge

PRESETS = ["tiny-sd3", "tiny-flux", "tiny-pixart"]
# Latent 16x12: a non-square grid (8x6 tokens after SD3's and PixArt's 2x2 patches and Flux's packing).
HEIGHT, WIDTH = 16, 12
TOKENS = 8 * 6
TEXT = 7


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=PRESETS)
def model_and_inputs(request):
    model = build_transformer(request.param)
    return model, transformer_inputs(model, HEIGHT, WIDTH, batch=2, text=TEXT)


def call(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def test_ratio_zero_remove_and_reproducibility(model_and_inputs):
    model, inputs = model_and_inputs
    reference = call(model, inputs)
    with pytest.warns(UserWarning, match="merges no tokens: ratio=0.0"):
        tome.patch(model, ratio=0.0)
    assert torch.equal(call(model, inputs), reference)
    tome.patch(model, ratio=0.5)
    first = call(model, inputs)
    assert torch.isfinite(first).all()
    assert rel(first, reference) > 1e-4
    assert torch.equal(call(model, inputs), first)  # same inputs and seed: the same output
    tome.remove(model)
    assert torch.equal(call(model, inputs), reference)
    assert not tome.patched_models(model)


@pytest.mark.parametrize("preset", ["tiny-sd35", "tiny-dit"])
def test_sd35_dual_attention_and_dit(preset):
    """SD3.5's second (image-only) self-attention merges too; DiT (class-conditional, square only)."""
    model = build_transformer(preset)
    inputs = transformer_inputs(model, 16, 16, batch=2)
    reference = call(model, inputs)
    tome.patch(model, ratio=0.5)
    seen = []
    hooked = [m for name, m in model.named_modules() if name.endswith(("attn", "attn1", "attn2"))]
    handles = [m.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("hidden_states", a[0] if a else None).shape[1]), with_kwargs=True) for m in hooked]
    patched = call(model, inputs)
    for handle in handles:
        handle.remove()
    assert rel(patched, reference) > 1e-4 and torch.isfinite(patched).all()
    image_attention = [n for n in seen if n != TEXT]  # PixArt/DiT cross-attention keys are text
    assert image_attention and set(image_attention) == {32}  # 64 tokens, half merged (SD3.5: attn and attn2)
    if preset == "tiny-sd35":
        assert len(image_attention) == 3  # block 0: joint attn + attn2; block 1: joint attn
    tome.remove(model)
    assert torch.equal(call(model, inputs), reference)


def _attention_inputs(model):
    """Record, per attention module of every block, the hidden_states / encoder_hidden_states it receives."""
    seen = []
    handles = []
    for name, module in model.named_modules():
        if type(module).__name__ in ("Attention", "FluxAttention") and ".attn" in name and not name.endswith("attn2"):

            def record(module, args, kwargs, name=name):
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                seen.append((name, hidden.clone(), kwargs.get("encoder_hidden_states")))

            handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    return seen, handles


def test_attention_sees_fewer_image_tokens_and_the_exact_text(model_and_inputs):
    model, inputs = model_and_inputs
    seen_plain, handles = _attention_inputs(model)
    call(model, inputs)
    for handle in handles:
        handle.remove()
    tome.patch(model, ratio=0.5)
    seen, handles = _attention_inputs(model)  # registered after the patch: they see what attention sees
    try:
        call(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
        tome.remove(model)
    assert len(seen) == len(seen_plain) >= 2
    kept = TOKENS - int(TOKENS * 0.5)
    for (name, hidden, text), (_, hidden_plain, text_plain) in zip(seen, seen_plain):
        if "single" in name:  # Flux single-stream: [text; image] in one sequence
            assert hidden.shape[1] == TEXT + kept and hidden_plain.shape[1] == TEXT + TOKENS
        else:
            assert hidden.shape[1] == kept and hidden_plain.shape[1] == TOKENS
        if text is not None and "attn1" not in name:
            assert text.shape[1] == TEXT
    # The first block's text is exactly the unpatched text (single blocks: the text prefix).
    name, hidden, text = seen[0]
    if text is not None:
        assert torch.equal(text, seen_plain[0][2])
    single = [(s, p) for s, p in zip(seen, seen_plain) if "single" in s[0]]
    if single:
        (_, hidden, _), (_, hidden_plain, _) = single[0]
        assert hidden.shape[1] == TEXT + kept


def test_keyword_only_and_positional_calls_agree():
    model = build_transformer("tiny-sd3")
    inputs = transformer_inputs(model, HEIGHT, WIDTH, batch=2)
    tome.patch(model, ratio=0.5)
    with torch.no_grad():
        by_keyword = model(**inputs).sample
        positional = model(
            inputs["hidden_states"], inputs["encoder_hidden_states"], inputs["pooled_projections"], inputs["timestep"]
        ).sample
    assert torch.equal(by_keyword, positional)


def test_bad_options_raise_before_anything_is_patched(bad_option):
    options, error, message = bad_option
    model = build_transformer("tiny-sd3")
    with pytest.raises(error, match=message):
        tome.patch(model, **options)
    assert not tome.patched_models(model)


def test_blocks_selects_which_blocks_merge():
    model = build_transformer("tiny-flux")  # block 0: double stream, block 1: single stream
    inputs = transformer_inputs(model, HEIGHT, WIDTH)
    for blocks, merged in (([0], 1), ([-1], 1), ([0, 1], 2), (None, 2)):
        tome.patch(model, ratio=0.5, blocks=blocks)
        call(model, inputs)
        (state,) = [s for _, s in tome.patched_models(model)]
        assert state.ledger.stats[1].blocks == merged
    with pytest.raises(ValueError, match="blocks: index 2 is out of range for FluxTransformer2DModel, which has 2"):
        tome.patch(model, ratio=0.5, blocks=[2])
    with pytest.raises(TypeError, match="blocks must hold block indices"):
        tome.patch(model, blocks=[0.5])
    tome.remove(model)


def test_block_ratios_set_each_blocks_ratio():
    model = build_transformer("tiny-sd3", num_layers=3)
    inputs = transformer_inputs(model, HEIGHT, WIDTH)

    def image_tokens(**options):
        """Image tokens each block's joint attention sees (hooks registered after the patch)."""
        tome.patch(model, **options)
        seen = []
        handles = [
            block.attn.register_forward_pre_hook(lambda m, a, k: seen.append(k["hidden_states"].shape[1]), with_kwargs=True)
            for block in model.transformer_blocks
        ]
        call(model, inputs)
        for handle in handles:
            handle.remove()
        return seen

    assert image_tokens(ratio=0.5, block_ratios={0: 0.75, -1: 0.0}) == [
        TOKENS - int(TOKENS * 0.75), TOKENS - int(TOKENS * 0.5), TOKENS
    ]
    assert image_tokens(ratio=0.5, block_ratios={1: 0.25}, attn_ratio=0.75) == [TOKENS - int(TOKENS * 0.75)] * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # block 1 merges: no nothing-merges warning
        assert image_tokens(ratio=0.0, block_ratios={1: 0.5}) == [TOKENS, TOKENS // 2, TOKENS]
    with pytest.raises(ValueError, match="block_ratios: index 3 is out of range for SD3Transformer2DModel, which has 3"):
        tome.patch(model, block_ratios={3: 0.5})
    with pytest.raises(ValueError, match=r"block_ratios\[0\]=0.9 cannot be reached"):
        tome.patch(model, block_ratios={0: 0.9})
    tome.remove(model)


def test_reuse_blocks_shares_one_match_between_consecutive_blocks(monkeypatch):
    import tome_core.algorithm.match as match_module

    model = build_transformer("tiny-sd3", num_layers=4)
    inputs = transformer_inputs(model, HEIGHT, WIDTH, batch=2)
    computed = []
    original = match_module.partition_bipartite
    monkeypatch.setattr(match_module, "partition_bipartite", lambda *a, **k: computed.append(1) or original(*a, **k))
    for reuse, matches in ((1, 4), (2, 2), (4, 1)):
        computed.clear()
        tome.patch(model, ratio=0.5, reuse_blocks=reuse)
        call(model, inputs)
        assert len(computed) == matches
    tome.remove(model)


# ---------------------------------------------------------------------------------------------------------
# Size-aware joint attention against attention over tokens repeated by their sizes (text included)


def _match(batch: int, shared: bool = False):
    generator = torch.Generator().manual_seed(3)
    metric = torch.randn(batch, TOKENS, 16, generator=generator)
    ops = get_ops(metric)
    from tome_core.algorithm.match import bipartite_matches

    return bipartite_matches(ops, metric, 8, 6, 2, 2, [int(TOKENS * 0.6)], None, 0, shared)[0]


def _sized(attention, args, kwargs, match, text, merged):
    args, kwargs = FRAMEWORK.size_aware(attention, args, kwargs, SizeBias(match, text, merged))
    try:
        return attention(*args, **kwargs)
    finally:
        FRAMEWORK.size_aware_done(attention, computed=True)


@pytest.mark.parametrize("preset, block_name, text", [
    ("tiny-sd3", "transformer_blocks", TEXT_AFTER),
    ("tiny-pixart", "transformer_blocks", TEXT_NONE),
    ("tiny-flux", "transformer_blocks", TEXT_BEFORE),
    ("tiny-flux", "single_transformer_blocks", TEXT_PREFIX),
])
def test_size_aware_attention_equals_attention_over_repeated_tokens(preset, block_name, text):
    model = build_transformer(preset)
    block = getattr(model, block_name)[0]
    attention = block.attn1 if hasattr(block, "attn1") else block.attn
    generator = torch.Generator().manual_seed(1)
    channels = model.inner_dim if hasattr(model, "inner_dim") else model.config.num_attention_heads * model.config.attention_head_dim
    batch = 2
    rotary = preset == "tiny-flux"
    match = _match(batch, shared=rotary)
    image = merge(torch.randn(batch, TOKENS, channels, generator=generator), match)
    repeated = unmerge(image, match)  # every merged token repeated once per token it stands for
    context = torch.randn(batch, TEXT, channels, generator=generator)
    kwargs, plain_kwargs = {}, {}
    if text in (TEXT_AFTER, TEXT_BEFORE):
        kwargs["encoder_hidden_states"] = plain_kwargs["encoder_hidden_states"] = context
    if text == TEXT_PREFIX:
        merged_in, plain_in = torch.cat([context, image], 1), torch.cat([context, repeated], 1)
    else:
        merged_in, plain_in = image, repeated
    if rotary:
        ids = torch.cat([torch.zeros(TEXT, 3), torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(8.0), torch.arange(6.0), indexing="ij"), -1).reshape(-1, 3)])
        positions = model.pos_embed(ids)
        kwargs["image_rotary_emb"] = merge_positions(positions, match)
        # Repeated tokens sit at their slot's position (the destination's), as the merged token does.
        slot = match.slot[0]
        plain_kwargs["image_rotary_emb"] = tuple(
            torch.cat([p[:TEXT], p[TEXT:][match.representatives[0]][slot]]) for p in positions
        )
    with torch.no_grad():
        sized = _sized(attention, (), {"hidden_states": merged_in, **kwargs}, match, text, image)
        plain = attention(hidden_states=plain_in, **plain_kwargs)
    sized_image, plain_image = (sized[0], plain[0]) if isinstance(sized, tuple) else (sized, plain)
    if text == TEXT_PREFIX:
        torch.testing.assert_close(sized_image[:, :TEXT], plain_image[:, :TEXT], rtol=1e-4, atol=1e-5)
        sized_image, plain_image = sized_image[:, TEXT:], plain_image[:, TEXT:]
    torch.testing.assert_close(unmerge(sized_image, match), plain_image, rtol=1e-4, atol=1e-5)
    if isinstance(sized, tuple):  # the text stream of joint attention
        torch.testing.assert_close(sized[1], plain[1], rtol=1e-4, atol=1e-5)
    # And plain softmax over merged tokens is not the same thing (the test can fail).
    with torch.no_grad():
        unsized = attention(hidden_states=merged_in, **kwargs)
    unsized_image = unsized[0] if isinstance(unsized, tuple) else unsized
    if text == TEXT_PREFIX:
        unsized_image = unsized_image[:, TEXT:]
    assert rel(unmerge(unsized_image, match), plain_image) > 1e-3


def test_shared_match_gives_every_item_the_same_merged_positions():
    match = _match(3, shared=True)
    representatives = match.representatives
    assert torch.equal(representatives[0], representatives[1]) and torch.equal(representatives[0], representatives[2])
    assert not torch.equal(_match(3).representatives[0], _match(3).representatives[1])


def test_flux_merged_tokens_carry_their_destinations_position():
    model = build_transformer("tiny-flux")
    inputs = transformer_inputs(model, HEIGHT, WIDTH, batch=2)
    tome.patch(model, ratio=0.5)
    seen = []
    attention = model.transformer_blocks[0].attn
    handle = attention.register_forward_pre_hook(lambda m, a, k: seen.append(k["image_rotary_emb"]), with_kwargs=True)
    try:
        call(model, inputs)
    finally:
        handle.remove()
        tome.remove(model)
    cos, _ = seen[0]
    full_cos, _ = model.pos_embed(torch.cat([inputs["txt_ids"], inputs["img_ids"]]))
    assert cos.shape[0] == TEXT + TOKENS - TOKENS // 2
    torch.testing.assert_close(cos[:TEXT], full_cos[:TEXT])
    # Every merged position is the position of one image token (no averaged or invented positions).
    image = full_cos[TEXT:]
    for row in cos[TEXT:]:
        assert (image - row).abs().amax(-1).min() == 0


# ---------------------------------------------------------------------------------------------------------
# Pipelines


def _run(pipe, call_kwargs, seed=0):
    torch.manual_seed(seed)  # the SD3 ControlNet pipeline samples its control latents from the global RNG
    return pipe(
        num_inference_steps=2, height=32, width=32, generator=torch.Generator().manual_seed(seed),
        output_type="latent", **call_kwargs,
    )[0]


@pytest.mark.parametrize("kind", TRANSFORMER_PIPELINES)
def test_pipelines_patch_their_transformer_and_controlnet(kind):
    pipe, call_kwargs = build_transformer_pipeline(kind)
    pipe.set_progress_bar_config(disable=True)
    reference = _run(pipe, call_kwargs)
    pipe.apply_tome(ratio=0.5)
    patched = _run(pipe, call_kwargs)
    models = tome.patched_models(pipe)
    assert [type(m).__name__ for m, _ in models][0] == type(pipe.transformer).__name__
    assert len(models) == (2 if "controlnet" in kind else 1)
    for _, state in models:
        assert state.ledger.stats[1].kept < state.ledger.stats[1].tokens
    assert torch.isfinite(patched).all() and rel(patched, reference) > 1e-4
    assert torch.equal(_run(pipe, call_kwargs), patched)
    pipe.remove_tome()
    assert torch.equal(_run(pipe, call_kwargs), reference)


def test_torch_compile_equals_eager():
    """Size-aware joint attention (a torch function mode) compiles without a graph break. (Flux compiles
    too, with one graph break: it reads its token grid from img_ids on the host once per ids tensor.)"""
    model = build_transformer("tiny-sd3", num_layers=1)
    inputs = transformer_inputs(model, HEIGHT, WIDTH, batch=2)
    tome.patch(model, ratio=0.5)
    eager = call(model, inputs)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(**inputs).sample, eager, rtol=1e-4, atol=1e-5)
    tome.remove(model)


# ---------------------------------------------------------------------------------------------------------
# diffusers' caching methods beside ToMe


def _cache(name, pipe):
    from diffusers import FasterCacheConfig, FirstBlockCacheConfig, PyramidAttentionBroadcastConfig, TaylorSeerCacheConfig

    return {
        "first-block": FirstBlockCacheConfig(threshold=0.5),
        "pyramid-attention-broadcast": PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: pipe.current_timestep,
        ),
        "taylorseer": TaylorSeerCacheConfig(),
        "faster-cache": FasterCacheConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: pipe.current_timestep, is_guidance_distilled=True,
        ),
    }[name]


def _run_steps(pipe, call_kwargs):
    return pipe(
        num_inference_steps=4, height=32, width=32, generator=torch.Generator().manual_seed(0), output_type="latent",
        **call_kwargs,
    )[0]


@pytest.mark.parametrize("cache", ["first-block", "pyramid-attention-broadcast"])
@pytest.mark.parametrize("tome_first", [False, True])
def test_caches_that_keep_whole_outputs_compose_in_either_order(cache, tome_first):
    """FirstBlockCache caches block outputs (full token count); Pyramid Attention Broadcast hands back an
    attention output stored at an earlier step, which ToMe unmerges with that step's match."""
    pipe, call_kwargs = build_transformer_pipeline("flux")
    pipe.set_progress_bar_config(disable=True)
    plain = _run_steps(pipe, call_kwargs)
    if tome_first:
        tome.patch(pipe, ratio=0.5)
        pipe.transformer.enable_cache(_cache(cache, pipe))
        both = _run_steps(pipe, call_kwargs)
        tome.remove(pipe)
        cache_alone = _run_steps(pipe, call_kwargs)
    else:
        pipe.transformer.enable_cache(_cache(cache, pipe))
        cache_alone = _run_steps(pipe, call_kwargs)
        tome.patch(pipe, ratio=0.5)
        both = _run_steps(pipe, call_kwargs)
        tome.remove(pipe)
        assert torch.equal(_run_steps(pipe, call_kwargs), cache_alone)  # remove undoes only ToMe
    assert torch.isfinite(both).all() and rel(both, cache_alone) > 1e-4
    pipe.transformer.disable_cache()
    assert torch.equal(_run_steps(pipe, call_kwargs), plain)  # disable_cache undoes only the cache
    tome.patch(pipe, ratio=0.5)
    tome_alone = _run_steps(pipe, call_kwargs)
    pipe.transformer.enable_cache(_cache(cache, pipe))
    _run_steps(pipe, call_kwargs)
    pipe.transformer.disable_cache()
    assert torch.equal(_run_steps(pipe, call_kwargs), tome_alone)


def test_pyramid_attention_broadcast_reuses_the_unmerged_output_of_its_step():
    """On a skipped step the attention output is the one unmerged at the step that computed it."""
    pipe, call_kwargs = build_transformer_pipeline("flux")
    pipe.set_progress_bar_config(disable=True)
    tome.patch(pipe, ratio=0.5)
    pipe.transformer.enable_cache(_cache("pyramid-attention-broadcast", pipe))
    attention = pipe.transformer.transformer_blocks[0].attn
    outputs = []
    handle = attention.register_forward_hook(lambda m, a, k, out: outputs.append(out[0]), with_kwargs=True)
    _run_steps(pipe, call_kwargs)
    handle.remove()
    assert len(outputs) == 4 and outputs[1] is outputs[0] and outputs[3] is outputs[2]
    assert outputs[0].shape[1] == 64  # the full token count: what the block adds to its residual


@pytest.mark.parametrize("cache", ["taylorseer", "faster-cache"])
def test_caches_that_extrapolate_merged_outputs_are_refused_clearly(cache):
    pipe, call_kwargs = build_transformer_pipeline("flux")
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(_cache(cache, pipe))
    with pytest.raises(ValueError, match="builds its output from outputs of earlier steps"):
        tome.patch(pipe, ratio=0.5)
    assert not tome.patched_models(pipe)
    pipe.transformer.disable_cache()
    tome.patch(pipe, ratio=0.5)
    pipe.transformer.enable_cache(_cache(cache, pipe))  # after patch: refused at the first call
    with pytest.raises(ValueError, match="builds its output from outputs of earlier steps"):
        _run_steps(pipe, call_kwargs)


def test_fractional_timesteps_give_each_step_its_own_partition():
    """Flux passes t / 1000 in [0, 1]: the partition must still change from step to step."""
    from tome_core.algorithm.partition import random_offsets

    ops = get_ops(torch.zeros(1))
    like = torch.zeros(1)
    tables = [random_offsets(ops, like, 16, 16, 2, 2, 0, torch.tensor(t), 0) for t in (1.0, 0.75, 0.5, 0.25)]
    assert all(not torch.equal(a, b) for i, a in enumerate(tables) for b in tables[i + 1 :])
    assert torch.equal(random_offsets(ops, like, 16, 16, 2, 2, 0, 0.5, 0), tables[2])  # Python and tensor agree


@pytest.mark.parametrize("kind, pag_class", [("sd3", "StableDiffusion3PAGPipeline"), ("pixart-sigma", "PixArtSigmaPAGPipeline")])
def test_pag_pipelines_of_transformers_run_merged_and_remove_exactly(kind, pag_class):
    """PAG on SD3 (joint PAG processors) and PixArt-Σ with the defaults (size-aware attention on)."""
    import diffusers

    base, call_kwargs = build_transformer_pipeline(kind)
    pipe = getattr(diffusers, pag_class).from_pipe(base, pag_applied_layers=["blocks.1"])
    pipe.set_progress_bar_config(disable=True)
    run = lambda: pipe(  # noqa: E731
        num_inference_steps=2, height=32, width=32, generator=torch.Generator().manual_seed(0),
        output_type="latent", pag_scale=3.0, guidance_scale=5.0, **call_kwargs,
    )[0]
    reference = run()
    tome.patch(pipe, ratio=0.5)
    patched = run()
    [(_, state)] = tome.patched_models(pipe)
    assert (state.ledger.stats[1].blocks, state.ledger.stats[1].tokens, state.ledger.stats[1].kept) == (2, 64, 32)
    assert torch.isfinite(patched).all() and rel(patched, reference) > 1e-4
    tome.remove(pipe)
    assert torch.equal(run(), reference)


def test_size_bias_mode_keeps_every_positional_sdpa_argument():
    """A processor calling SDPA positionally (mask, dropout, causal flag; scale is keyword-only) keeps its
    arguments; the bias joins its mask. Oracle: SDPA itself with the same dropout draw and the bias added by
    hand, and the softmax written out without dropout."""
    from tome_core.adapters.diffusers import _AttentionMode

    sdpa = torch.nn.functional.scaled_dot_product_attention
    match = _match(2)
    image = merge(torch.randn(2, TOKENS, 8), match)
    query, key, value = (torch.randn(2, 2, match.kept, 4) for _ in range(3))
    mask = torch.randn(2, 1, match.kept, match.kept)
    sizes = match.sizes[..., 0].log()[:, None, None, :]
    for dropout in (0.0, 0.5):
        torch.manual_seed(0)
        with _AttentionMode(SizeBias(match, TEXT_NONE, image)) as mode:
            out = sdpa(query, key, value, mask, dropout, False, scale=0.5)
        assert mode.calls == 1
        torch.manual_seed(0)
        torch.testing.assert_close(out, sdpa(query, key, value, mask + sizes, dropout, False, scale=0.5))
    expected = torch.softmax(query @ key.transpose(-1, -2) * 0.5 + mask + sizes, -1) @ value
    with _AttentionMode(SizeBias(match, TEXT_NONE, image)):
        torch.testing.assert_close(sdpa(query, key, value, mask, 0.0, False, scale=0.5), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Packed ids that are not one raster grid (issues 33 and 35): FLUX.1 Kontext's reference tokens, random ids


def kontext_inputs(model, batch=2):
    """A Flux call as FLUX.1 Kontext makes it: the reference image's tokens (ids with index 1) after the
    output's, in the same image stream."""
    inputs = transformer_inputs(model, HEIGHT, WIDTH, batch=batch)
    reference_ids = inputs["img_ids"].clone()
    reference_ids[:, 0] = 1
    reference = torch.randn(inputs["hidden_states"].shape, generator=torch.Generator().manual_seed(9))
    return dict(inputs, hidden_states=torch.cat([inputs["hidden_states"], reference], 1),
                img_ids=torch.cat([inputs["img_ids"], reference_ids], 0))


def test_kontext_reference_tokens_pass_through_and_the_output_grid_merges():
    model = build_transformer("tiny-flux")
    inputs = kontext_inputs(model)
    grid = inputs["hidden_states"].shape[1] // 2
    reference = call(model, inputs)
    plain_inputs = []
    first = next(m for n, m in model.named_modules() if n.endswith("transformer_blocks.0.attn"))
    handle = first.register_forward_pre_hook(lambda m, a, k: plain_inputs.append(k["hidden_states"]), with_kwargs=True)
    call(model, inputs)
    handle.remove()
    tome.patch(model, ratio=0.5)
    seen = []
    handles = [m.register_forward_pre_hook(lambda m, a, k, n=n: seen.append((n, k["hidden_states"])), with_kwargs=True)
               for n, m in model.named_modules() if n.endswith(".attn")]
    out = call(model, inputs)
    for h in handles:
        h.remove()
    (_, state), = tome.patched_models(model)
    assert (state.ledger.stats[1].tokens, state.ledger.stats[1].kept) == (grid, grid // 2)  # the output's grid only
    double = [x for n, x in seen if n.startswith("transformer_blocks")]
    single = [x for n, x in seen if n.startswith("single_transformer_blocks")]
    assert {x.shape[1] for x in double} == {grid // 2 + grid}  # merged output tokens, then every reference token
    assert {x.shape[1] for x in single} == {7 + grid // 2 + grid}  # text, merged output, reference
    # the first block's reference tokens reach attention exactly as unpatched
    torch.testing.assert_close(double[0][:, grid // 2 :], plain_inputs[0][:, grid:], rtol=0, atol=0)
    assert torch.isfinite(out).all() and 0 < rel(out, reference) < 0.1
    tome.remove(model)
    torch.testing.assert_close(call(model, inputs), reference, rtol=0, atol=0)


@pytest.mark.parametrize("ids", ["randn", "shuffled"])
def test_ids_that_are_no_raster_grid_run_unmerged_and_say_so_once(ids):
    """diffusers' own model tests pass random ids: nothing can be placed on a grid, so the call runs unpatched
    with one warning (before: a ValueError at the first call)."""
    model = build_transformer("tiny-flux")
    inputs = transformer_inputs(model, HEIGHT, WIDTH, batch=2)
    if ids == "randn":
        inputs["img_ids"] = torch.randn(inputs["img_ids"].shape, generator=torch.Generator().manual_seed(1))
    else:
        inputs["img_ids"] = inputs["img_ids"][torch.randperm(len(inputs["img_ids"]), generator=torch.Generator().manual_seed(1))]
    reference = call(model, inputs)
    tome.patch(model, ratio=0.5)
    with pytest.warns(UserWarning, match="img_ids do not begin with one image's tokens in raster order"):
        torch.testing.assert_close(call(model, inputs), reference, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(model, inputs)  # said once
    assert "no block merged: its img_ids" in tome.patched_models(model)[0].state.summary()


def test_leading_raster_reads_grids_and_refuses_the_rest():
    from tome_core.models.levels import leading_raster

    raster = lambda index, h, w, top=0: [[index, top + i // w, i % w] for i in range(h * w)]  # noqa: E731
    assert leading_raster(raster(0, 3, 4)) == (3, 4, 0)
    assert leading_raster(raster(0, 3, 4) + raster(1, 2, 2)) == (3, 4, 4)  # Kontext: a reference after
    assert leading_raster(raster(0, 2, 5, top=7)) == (2, 5, 0)  # offsets are fine
    assert leading_raster(raster(0, 3, 4) + raster(0, 2, 2)) is None  # another image under the same index
    assert leading_raster(raster(1, 2, 2) + raster(0, 3, 4)) is None  # indices must rise
    assert leading_raster(raster(0, 3, 4)[::-1]) is None
    assert leading_raster([[0, 0.5, 0], [0, 1.25, 0], [0, 2.5, 0]]) is None  # uneven steps
    half = [[index, row * 0.5, col * 0.5, 0] for index, row, col in raster(0, 3, 4)]
    assert leading_raster(half) == (3, 4, 0)  # FLUX.3: ids scaled by its image_rope_scale


def test_indicated_run_reads_the_image_run_from_token_roles_and_refuses_other_packings():
    from tome_core.models.levels import indicated_run

    image = [[65536, 65536 + i // 4, 65536 + i % 4] for i in range(12)]  # a 3x4 grid, Ideogram 4's offset ids
    text = lambda n: [[i, i, i] for i in range(n)]  # noqa: E731
    pad = lambda n: [[0, 0, 0]] * n  # noqa: E731
    roles = [[-1, 3, 3] + [2] * 12, [3, 3, 3] + [2] * 12]
    ids = [pad(1) + text(2) + image, text(3) + image]
    assert indicated_run(roles, 2, ids, [[-1, 1, 1] + [1] * 12, [1] * 15]) == (3, 4, 3, 0)  # left padding, then text
    assert indicated_run([row + [3] for row in roles], 2, [row + text(1) for row in ids]) == (3, 4, 3, 1)  # a tail
    assert indicated_run([roles[0], [3, 3] + [2] * 12 + [3]], 2, [ids[0], text(2) + image + text(1)]) is None  # moved
    assert indicated_run(roles, 2, ids, [[1] * 9 + [2] * 6, [1] * 15]) is None  # two samples' images back to back
    # the last run is the grid; an earlier run of the role passes through (another sample, condition frames)
    assert indicated_run([[3, 2, 2, 3] + [2] * 12], 2, [text(1) + image[:2] + text(1) + image]) == (3, 4, 4, 0)
    video = [[t * 5, row, col] for t in range(3) for row in range(2) for col in range(3)]  # 3 frames of 2x3, one layout
    assert indicated_run([[1, 1] + [0] * 18], 0, [text(2) + video]) == (6, 3, 2, 0)
    assert indicated_run(roles, 2, [ids[0], text(3) + image[::-1]]) is None  # the rows' grids differ
    assert indicated_run([[3, 3, 3]], 2, [text(3)]) is None  # no image


def test_trailing_readers_find_the_grid_after_conditioning_tokens():
    from tome_core.models.levels import trailing_frames, trailing_raster

    raster = lambda index, h, w: [[index, i // w, i % w] for i in range(h * w)]  # noqa: E731
    assert trailing_raster(raster(10, 2, 2) + raster(0, 3, 4)) == (3, 4, 4)  # Flux.2 Klein KV: references first
    assert trailing_raster(raster(0, 3, 4)) == (3, 4, 0)
    assert trailing_raster(raster(0, 3, 4)[::-1]) is None
    video = lambda frames, h, w, t0=0: [[t0 + f, r * 32, c * 32] for f in range(frames) for r in range(h) for c in range(w)]  # noqa: E731
    assert trailing_frames(video(3, 2, 4)) == (3, 2, 4, 0)
    assert trailing_frames(video(1, 2, 4) + video(3, 2, 4)) == (3, 2, 4, 8)  # LTX: a condition frame at time 0 first
    assert trailing_frames(video(2, 3, 4) + video(3, 2, 4, t0=5)) == (3, 2, 4, 24)  # another grid before
    assert trailing_frames([[0, 0, 0], [0, 0, 1], [0, 1, 1]]) is None


# ---------------------------------------------------------------------------------------------------------
# Latte (issue 33): spatial and temporal BasicTransformerBlocks alternate; its input (batch, C, frames, H, W) has
# a 2-D patch, so each frame is an item of the spatial blocks' batch and merges on its own grid


def test_latte_merges_each_frame_on_its_grid_and_leaves_its_temporal_blocks_alone():
    from diffusers import LatteTransformer3DModel

    torch.manual_seed(0)
    model = LatteTransformer3DModel(
        sample_size=8, num_layers=1, patch_size=2, attention_head_dim=4, num_attention_heads=2, caption_channels=8,
        in_channels=4, cross_attention_dim=8, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
        video_length=3,
    ).eval()
    for parameter in model.parameters():  # adaLN-zero and output layers start at zero: give them values
        if not parameter.any():
            parameter.data.normal_(0, 0.02)
    inputs = dict(hidden_states=torch.randn(2, 4, 3, 8, 8), timestep=torch.tensor([500, 500]), encoder_hidden_states=torch.randn(2, 5, 8))
    reference = call(model, inputs)
    tome.patch(model, ratio=0.5)
    seen = []
    handles = [m.register_forward_pre_hook(lambda m, a, k, n=n: seen.append((n.split(".")[0], tuple(k["hidden_states"].shape) if "hidden_states" in k else tuple(a[0].shape))), with_kwargs=True)
               for n, m in model.named_modules() if n.endswith("attn1")]
    out = call(model, inputs)
    for handle in handles:
        handle.remove()
    # spatial: 2 videos x 3 frames, 16 -> 8 tokens each; temporal: 2 x 16 patch sequences of 3 frames, untouched
    assert sorted(set(seen)) == [("temporal_transformer_blocks", (32, 3, 8)), ("transformer_blocks", (6, 8, 8))]
    assert torch.isfinite(out).all() and 0 < rel(out, reference) < 0.2
    tome.remove(model)
    torch.testing.assert_close(call(model, inputs), reference, rtol=0, atol=0)

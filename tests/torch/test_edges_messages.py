"""What a user is told at the edges (issue 59): an object that is no pipeline or model is named first, with how
to load a model id; an option that acts on a kind of sub-layer the model's blocks do not have (cross-attention on
Flux and SD3) says so at ``patch``, and a patch that then merges nothing says that; and what a patched model keeps
between calls is what docs/performance.md says it keeps, and ``remove`` lets go of all of it.

Oracles: the unpatched model and the patch without the option (outputs equal bit for bit), and the bytes the
profiler counts (``tome_tools.diffusers_bench.tensor_peak_mib``) against the bytes of what is kept."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from diffusers import UNet2DConditionModel

import tome_core.torch as tome
from tome_core.algorithm import partition
from tome_tools.diffusers_bench import tensor_peak_mib
from tome_tools.diffusers_models import build_transformer, build_unet, transformer_inputs

WRONG = [
    (tome.patch, None, r"^ToMe patches a pipeline or a model; got None\. It takes a diffusers DiffusionPipeline"),
    (tome.apply_patch, "stable-diffusion-v1-5", (
        r"^ToMe patches a pipeline or a model; got str 'stable-diffusion-v1-5': a model id or folder is not a model; "
        r"load it first, e\.g\. pipe = DiffusionPipeline\.from_pretrained\('stable-diffusion-v1-5'\), then patch\(pipe\)\. "
        r"It takes a diffusers DiffusionPipeline .*docs/models\.md"
    )),
    (tome.patch, UNet2DConditionModel, r"^ToMe patches .*; got the class diffusers\..*UNet2DConditionModel: pass a model of it"),
    (tome.patch, 42, r"^ToMe patches a pipeline or a model; got int 42\. It takes"),
    (tome.remove, None, r"^remove takes a patched pipeline or model; got None$"),
    (tome.remove_patch, "sd", r"^remove takes a patched pipeline or model; got str 'sd'$"),
    (tome.patched_models, None, r"^patched_models takes a pipeline or a model; got None$"),
]


@pytest.mark.parametrize("entry, given, message", WRONG, ids=[f"{e.__name__}-{g!r}"[:40] for e, g, _ in WRONG])
def test_a_wrong_object_is_named_first_in_a_short_message(entry, given, message):
    with pytest.raises(TypeError, match=message) as refused:
        entry(given)
    assert len(str(refused.value)) < 450, str(refused.value)


def _flux_or_sd3(name):
    model = build_transformer(name)
    return model, transformer_inputs(model, 8, 8)


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


@pytest.mark.parametrize("name, where", [("tiny-flux", "FluxTransformer2DModel"), ("tiny-sd3", "SD3Transformer2DModel")])
def test_cross_attention_options_on_a_model_without_cross_attention_warn_at_patch(name, where):
    model, inputs = _flux_or_sd3(name)
    tome.patch(model, ratio=0.5)
    without = _run(model, inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tome.patch(model, ratio=0.5, merge_crossattn=True, crossattn_ratio=0.25)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert said == [
        f"ToMe patch on {where}: merge_crossattn=True and crossattn_ratio=0.25 act on cross-attention, which no merged "
        f"block of {where} has, so it changes nothing there; leave it out"
    ]
    torch.testing.assert_close(_run(model, inputs), without, rtol=0, atol=0)  # it changes nothing indeed
    tome.remove(model)


@pytest.mark.parametrize("name, where", [("tiny-flux", "FluxTransformer2DModel"), ("tiny-sd3", "SD3Transformer2DModel")])
def test_only_cross_attention_on_a_model_without_it_merges_nothing_and_says_so(name, where):
    model, inputs = _flux_or_sd3(name)
    unpatched = _run(model, inputs)
    with pytest.warns(UserWarning, match=(
        rf"^ToMe patch on {where} merges no tokens: merge_attn=False and merge_mlp=False, and merge_crossattn=True acts "
        rf"on cross-attention, which no merged block of {where} has$"
    )):
        tome.patch(model, ratio=0.5, merge_attn=False, merge_crossattn=True)
    torch.testing.assert_close(_run(model, inputs), unpatched, rtol=0, atol=0)
    tome.remove(model)


def test_an_option_on_a_sublayer_the_model_has_says_nothing():
    model, inputs = _flux_or_sd3("tiny-flux")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tome.patch(model, ratio=0.5, merge_mlp=True, mlp_ratio=0.25)  # Flux's blocks have feed-forwards
    tome.remove(model)


# --------------------------------------------------------------------------------------------------------
# What a patched model keeps between calls (docs/performance.md, "Memory")


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_bytes(item) for item in value)
    if isinstance(value, dict):
        return sum(_bytes(item) for item in value.values())
    fields = getattr(value, "__dataclass_fields__", None)  # a kept match
    return sum(_bytes(getattr(value, name)) for name in fields) if fields else 0


@pytest.mark.parametrize("options, grad, reused", [
    (dict(ratio=0.5), False, False),  # the index tables alone
    (dict(ratio=0.5, reuse_blocks=2), False, True),  # and the matches the call's later blocks reused
    (dict(ratio=0.5, reuse_level=True), False, True),
    (dict(ratio=0.5), True, False),  # and each merged block's last matches, for checkpointing to recompute it
    (dict(min_tokens=0), True, False),
], ids=["tables", "reuse_blocks", "reuse_level", "gradients", "default-gradients"])
def test_between_calls_a_patched_model_keeps_what_the_readme_says_and_remove_lets_go_of_it(options, grad, reused):
    model = build_unet("tiny")
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 4, 32, 32, generator=generator), torch.tensor([500]), torch.randn(1, 7, 32, generator=generator))

    def call(grad):
        def once():
            with torch.set_grad_enabled(grad):
                model(*inputs)  # the output dropped: what stays is the model's
        return tensor_peak_mib(once)[1] * 2**20

    tome.patch(model, **options)
    kept = call(grad)
    (_, state), = tome.patched_models(model)
    tokens, blocks = max(s.tokens for s in state.ledger.stats.values()), sum(s.blocks for s in state.ledger.stats.values())
    tables, matches = _bytes(dict(partition._CACHE)), _bytes(state.matching.cache)
    del state
    assert tables > 0 and (matches > 0) == reused
    beyond = kept - tables - matches  # with gradients on: each merged block's last matches
    assert (beyond > 0) == grad and 0 <= beyond <= 16 * tokens * blocks, (beyond, tokens, blocks)
    assert matches <= 16 * tokens * blocks
    assert call(grad) == 0  # the next call replaces what the last one kept
    if grad:
        assert call(False) == 0  # a call without gradients leaves the last matches with gradients kept

    def remove():
        tome.remove(model)
        gc.collect()

    assert -tensor_peak_mib(remove)[1] * 2**20 == kept  # remove lets go of all of it
    assert not partition._CACHE

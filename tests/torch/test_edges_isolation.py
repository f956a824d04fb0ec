"""Edges round three, 2-7: what a merged attention's function mode acts on, and what a running call survives.

The rule (docs/limits.md, "Isolation"): a merged attention's mode acts only on its own attention's calls, those made
by its code or its processor's over keys that can hold its merged image tokens; every other call made while it runs
(a hook on ``to_q``, another model called inside it, an IP-Adapter's attention to its image prompt, a kernel call over
the reference tokens alone) passes through exactly.

Oracles: the same SDPA call or model call made outside the merged attention, the unpatched model, the patched model
with a plain processor.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import tome_core.torch as tome
from tome_tools.diffusers_models import add_flux_ip_adapter, build_transformer, build_unet, transformer_inputs


class KeyCounts(TorchFunctionMode):
    """Records the key count of every SDPA call under it, as the kernel gets it (entered before any patched call,
    it sits below ToMe's modes and sees what they pass on)."""

    def __init__(self):
        super().__init__()
        self.keys: List[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.keys.append((args[1] if len(args) > 1 else kwargs["key"]).shape[-2])
        return func(*args, **kwargs)


def unet_call():
    generator = torch.Generator().manual_seed(0)
    inputs = dict(
        sample=torch.randn(2, 4, 16, 16, generator=generator), timestep=torch.tensor([500, 500]),
        encoder_hidden_states=torch.randn(2, 7, 32, generator=generator),
    )
    return lambda m: m(**inputs).sample


def merged_self_attention(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for name, m in model.named_modules() if name.endswith("attn1"))


def test_a_hook_calling_sdpa_inside_a_merged_attention_gets_its_own_keys():
    """Edges round three, 4: an SDPA call made by a hook on ``to_q`` of a merged attention was taken for that
    attention's and given its size bias (a RuntimeError, or with fewer keys a wrong result). It now equals the same
    call made outside."""
    unet, call = build_unet("tiny"), unet_call()
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(2, 2, 64, 8, generator=generator) for _ in range(3))
    outside = F.scaled_dot_product_attention(query, key, value)
    inside = []
    merged_self_attention(unet).to_q.register_forward_hook(
        lambda m, a, out: inside.append(F.scaled_dot_product_attention(query, key, value))
    )
    tome.patch(unet, ratio=0.5)
    with torch.no_grad():
        call(unet)
    assert inside and all(torch.equal(x, outside) for x in inside)


def test_a_patched_model_called_inside_a_merged_attention_runs_as_alone():
    """Edges round three, 4: a second patched model called from inside a merged attention of the first got the
    first one's size bias on top of its own (off by 0.036 at ratio 0.5). Its output now equals its call alone."""
    outer, inner, call = build_unet("tiny", seed=0), build_unet("tiny", seed=1), unet_call()
    tome.patch(outer, ratio=0.5)
    tome.patch(inner, ratio=0.5)
    with torch.no_grad():
        alone = call(inner)
        inside = []
        merged_self_attention(outer).to_q.register_forward_hook(lambda m, a, out: inside.append(call(inner)) if not inside else None)
        call(outer)
    assert inside and torch.equal(inside[0], alone)


def flux_with_ip_adapter(scale: float):
    """A tiny Flux whose attentions run diffusers' ``FluxIPAdapterAttnProcessor``, and its call's inputs."""
    model = build_transformer("tiny-flux")
    inputs = transformer_inputs(model, 16, 12, batch=2, text=7)
    add_flux_ip_adapter(model, inputs, scale, batch=2)
    return model, inputs


def run(model, inputs, image_prompt: bool = True):
    """The model's output (a fresh copy of its attention arguments each call), with or without the image prompt."""
    attention = dict(inputs["joint_attention_kwargs"]) if image_prompt else {}
    with torch.no_grad():
        return model(**{**inputs, "joint_attention_kwargs": attention}).sample


@pytest.mark.parametrize("options", [
    dict(ratio=0.5), dict(ratio=0.5, proportional_attn=False), dict(ratio=0.5, mode="kv"),
], ids=["bias", "plain", "kv"])
def test_flux_ip_adapter_merges_and_its_image_prompt_attention_passes_through(options):
    """Edges round three, 2: Flux with diffusers' IP-Adapter processor failed at its first merged call in every mode
    (the size bias and the kv kernel took its attention to the 4 image-prompt tokens for the block's; its image-prompt
    output stayed merged). At scale 0 it now equals the patched model with the plain processor exactly; at scale 1 its
    image-prompt calls keep their 4 keys and the output changes."""
    silent, inputs = flux_with_ip_adapter(scale=0.0)
    tome.patch(silent, **options)
    with_ip = run(silent, inputs)
    tome.remove(silent)
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    silent.set_attn_processor(FluxAttnProcessor())
    tome.patch(silent, **options)
    plain = run(silent, inputs, image_prompt=False)
    assert torch.allclose(with_ip, plain, atol=1e-6), (with_ip - plain).abs().max()

    model, inputs = flux_with_ip_adapter(scale=1.0)
    unpatched = run(model, inputs)
    tome.patch(model, **options)
    with KeyCounts() as counts:
        output = run(model, inputs)
    assert 4 in counts.keys and torch.isfinite(output).all()
    assert float((output - unpatched).abs().max()) > 1e-4


def test_flux2_klein_kv_pipeline_merges_under_kv():
    """Edges round three, 3: the Flux.2 Klein KV pipeline failed at its first call under ``mode="kv"`` ("a kernel call
    over 1 x 256 keys does not fit"): its extract step attends over the reference image's tokens alone. Every kernel
    call now gets at most the unpatched keys, some fewer."""
    from tome_tools.diffusers_zoo_pipelines import build_zoo_pipeline

    pipe, call = build_zoo_pipeline("flux2-klein-kv")
    pipe.set_progress_bar_config(disable=True)

    def keys():
        with torch.no_grad(), KeyCounts() as counts:
            output = pipe(num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent", **call)[0]
        return output, counts.keys

    reference, plain = keys()
    tome.patch(pipe, ratio=0.5, mode="kv")
    output, merged = keys()
    assert len(merged) == len(plain) and all(m <= p for m, p in zip(merged, plain)) and merged != plain
    assert torch.isfinite(output).all()


def test_compiling_after_an_interrupt_inside_a_merged_attention_traces_whole():
    """Edges round three, 5: after a Ctrl-C inside a merged attention its mode stayed on torch's stack for compiled
    calls, which cannot clear it from inside a trace: ``fullgraph=True`` raised ``Unsupported`` and every other compile
    broke its graph. Dynamo's compile-start callback now drops it: the compiled call traces whole and equals eager."""
    import torch._dynamo

    torch._dynamo.reset()
    model = build_transformer("tiny-flux")
    inputs = transformer_inputs(model, 16, 16, batch=2)
    tome.patch(model, ratio=0.5)
    with torch.no_grad():
        eager = model(**inputs).sample
    fired = []

    def interrupt_once(module, args):
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt

    handle = next(m for name, m in model.named_modules() if name.endswith("attn")).to_k.register_forward_pre_hook(interrupt_once)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(**inputs)
    handle.remove()
    assert torch._C._len_torch_function_stack() == 1  # the interrupted call's mode, left for the compile to meet
    with torch.no_grad():
        compiled = torch.compile(model, backend="eager", fullgraph=True)(**inputs).sample
    torch._dynamo.reset()
    assert torch.allclose(compiled, eager, atol=1e-5) and torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("options", [dict(ratio=0.5), dict(mode="kv", ratio=0.5)], ids=["tokens", "kv"])
def test_remove_inside_a_running_call_takes_effect_when_the_call_returns(options):
    """Edges round three, 6: ``remove`` from a hook inside a running call took the hooks off half-way (a raw shape
    error; under ``mode="kv"`` ToMe's function mode stayed on torch's stack). The call now finishes as it began,
    equal to an untouched patched call, and the model is unpatched when it returns."""
    unet, call = build_unet("tiny"), unet_call()
    with torch.no_grad():
        unpatched = call(unet)
        tome.patch(unet, **options)
        patched = call(unet)
        handle = merged_self_attention(unet).register_forward_hook(lambda m, a, out: tome.remove(unet) and None)
        during = call(unet)
        handle.remove()
        assert torch.equal(during, patched) and torch._C._len_torch_function_stack() == 0
        assert not tome.patched_models(unet)
        assert torch.equal(call(unet), unpatched)


def test_remove_inside_a_call_that_is_then_interrupted_takes_effect_at_the_next_call():
    """A call that ``remove`` was asked inside, then interrupted (Ctrl-C: no post-hook runs), leaves its model
    unpatched from the next call on."""
    unet, call = build_unet("tiny"), unet_call()
    with torch.no_grad():
        unpatched = call(unet)
        tome.patch(unet, ratio=0.5)

        def remove_then_interrupt(module, args, output):
            tome.remove(unet)
            raise KeyboardInterrupt

        handle = merged_self_attention(unet).register_forward_hook(remove_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            call(unet)
        handle.remove()
        assert torch.equal(call(unet), unpatched) and not tome.patched_models(unet)


def test_patch_inside_a_running_call_is_refused_and_the_call_finishes():
    """Edges round three, 6: a new ``patch`` from inside a running call replaced the hooks half-way (a raw shape
    error). It is now refused, naming the running model, and the call finishes as patched."""
    unet, call = build_unet("tiny"), unet_call()
    tome.patch(unet, ratio=0.5)
    with torch.no_grad():
        patched = call(unet)
        errors = []

        def repatch(module, args, output):
            try:
                tome.patch(unet, ratio=0.3)
            except ValueError as error:
                errors.append(str(error))

        handle = merged_self_attention(unet).register_forward_hook(repatch)
        during = call(unet)
        handle.remove()
    assert errors and "UNet2DConditionModel" in errors[0] and "between calls" in errors[0]
    assert torch.equal(during, patched)


def test_two_models_sharing_blocks_cannot_both_be_patched():
    """Edges round three, 7: two models holding the same transformer blocks could both be patched; the first one's
    call then failed with a misleading "a transformer block ran before its model ... gave the latent size". The
    second patch is now refused, naming the other model; patching the first again, or after removing it, works."""
    first = build_transformer("tiny-pixart")
    second = build_transformer("tiny-pixart")
    second.transformer_blocks = first.transformer_blocks
    tome.patch(first, ratio=0.5)
    with pytest.raises(ValueError, match="also a block of a patched PixArtTransformer2DModel"):
        tome.patch(second, ratio=0.5)
    assert not tome.patched_models(second)
    tome.patch(first, ratio=0.3)  # the same model again: its own blocks
    tome.remove(first)
    tome.patch(second, ratio=0.5)
    assert tome.patched_models(second)


def test_a_pipeline_of_two_models_sharing_blocks_is_refused_whole():
    """Two models of one ``patch`` call that share blocks are refused before either is patched."""
    import copy

    first = build_transformer("tiny-pixart")
    holder = torch.nn.ModuleDict({"a": first, "b": copy.copy(first)})  # a shallow copy: the same blocks
    with pytest.raises(ValueError, match="also a block of"):
        tome.patch(holder, ratio=0.5)
    assert not tome.patched_models(holder)


def _key_counts(model, inputs):
    from tome_tools.diffusers_bench import SdpaCalls

    with torch.no_grad(), SdpaCalls() as calls:
        model(**inputs, return_dict=False)
    return calls.lengths


def test_a_reference_as_large_as_the_output_keeps_its_keys_under_kv():
    """The edges property test's wide run: Flux.2 Klein KV's extract step with a reference of 16 tokens beside an
    output of 15 gave the reference's own attention (16 keys) the output's key merge under ``mode="kv"``: a call is
    the attention's own only over at least every token it was given (its text included). It now keeps its keys."""
    from diffusers.models.transformers.transformer_flux2 import Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor

    model = build_transformer("tiny-flux2-klein")
    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    target, reference = transformer_inputs(model, 6, 10, batch=1), transformer_inputs(model, 8, 8, batch=1, seed=1)
    ids = reference["img_ids"].clone()
    ids[:, 0] = 10
    extract = dict(
        target, hidden_states=torch.cat([reference["hidden_states"], target["hidden_states"]], 1),
        img_ids=torch.cat([ids, target["img_ids"]]), kv_cache_mode="extract", num_ref_tokens=16,
    )
    plain = _key_counts(model, extract)
    tome.patch(model, ratio=0.5, mode="kv")
    merged = _key_counts(model, extract)
    assert [q for q, _ in merged] == [q for q, _ in plain]
    assert [k for (_, k), (q, _) in zip(merged, plain) if q == 16] == [16, 16]  # the reference's own calls
    assert all(k < p for (q, k), (_, p) in zip(merged, plain) if q != 16)  # the output's calls merge


def test_an_image_prompt_as_long_as_the_image_keeps_its_keys_under_kv():
    """The wide run: Flux's IP-Adapter on a 2x2 grid (4 image tokens) beside 4 image-prompt tokens merged the
    image-prompt attention's keys too under ``mode="kv"``. The joint text now counts among the attention's own keys."""
    model, inputs = flux_with_ip_adapter(scale=1.0)
    inputs = dict(transformer_inputs(model, 4, 4, batch=2, text=7), joint_attention_kwargs=inputs["joint_attention_kwargs"])
    plain = _key_counts(model, {**inputs, "joint_attention_kwargs": dict(inputs["joint_attention_kwargs"])})
    tome.patch(model, ratio=0.5, mode="kv")
    merged = _key_counts(model, {**inputs, "joint_attention_kwargs": dict(inputs["joint_attention_kwargs"])})
    assert [k for q, k in merged if k == 4 or q == 4] == [k for q, k in plain if q == 4] == [4]

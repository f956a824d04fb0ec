"""Edges of issue 43 around size-aware attention's function mode: torch.compile of joint- and rotary-attention
models, and an interrupt (Ctrl-C) inside a merged attention.

Oracles: the same patched model run eagerly and uninterrupted, and a plain SDPA call computed by hand.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import tome_core.torch as tome
from tome_tools.diffusers_models import (
    build_transformer, build_unet, build_video_transformer, transformer_inputs, video_transformer_inputs,
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def flux():
    model = build_transformer("tiny-flux")
    inputs = transformer_inputs(model, 16, 16, batch=2)
    return model, lambda m: m(**inputs, return_dict=False)[0]


def wan():
    model = build_video_transformer("tiny-wan")
    inputs = video_transformer_inputs(model, 3, 16, 16, batch=2)
    return model, lambda m: m(**inputs, return_dict=False)[0]


def unet():
    model = build_unet("tiny")
    generator = torch.Generator().manual_seed(0)
    inputs = dict(
        sample=torch.randn(2, 4, 16, 16, generator=generator), timestep=torch.tensor([500, 500]),
        encoder_hidden_states=torch.randn(2, 7, 32, generator=generator),
    )
    return model, lambda m: m(**inputs).sample


def _plain_sdpa_is_exact() -> bool:
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(2, 2, 5, 8, generator=generator) for _ in range(3))
    by_hand = torch.softmax(query @ key.transpose(-1, -2) / 8**0.5, dim=-1) @ value
    return torch.allclose(F.scaled_dot_product_attention(query, key, value), by_hand, atol=1e-6)


@pytest.mark.parametrize("build", [flux, wan], ids=["flux", "wan"])
def test_compiled_eager_backend_adds_the_size_bias_once(build):
    """torch.compile(backend="eager") of a patched joint/rotary-attention model equals eager: before, a graph break at
    ``Tensor.unflatten`` inside the armed bias mode made the resumed graph add the bias a second time (0.059 on Flux)."""
    model, call = build()
    tome.patch(model)
    with torch.no_grad():
        eager = call(model)
        compiled = call(torch.compile(model, backend="eager"))
    assert torch.allclose(compiled, eager, atol=1e-5), (compiled - eager).abs().max()


KV_IN_KERNEL = dict(mode="kv", matching="cell", sx=2, sy=2, cell_pool="sample")


@pytest.mark.parametrize("options", [{}, KV_IN_KERNEL], ids=["default", "kv-in-kernel"])
@pytest.mark.parametrize("build", [flux, wan], ids=["flux", "wan"])
def test_fullgraph_traces_merged_joint_attention(build, options):
    """``fullgraph=True`` traces a patched Flux / Wan whole (before: ``Unsupported: super().unflatten()`` in every
    merged attention), also with keys and values merged inside the attention kernel. Flux reads its img_ids on the
    host once per ids tensor (its token grid): an eager call with the same ids read them, as a pipeline's first
    step does for a compiled transformer."""
    model, call = build()
    tome.patch(model, **options)
    with torch.no_grad():
        eager = call(model)
        compiled = call(torch.compile(model, backend="eager", fullgraph=True))
    assert torch.allclose(compiled, eager, atol=1e-5), (compiled - eager).abs().max()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("build, options", [(unet, {"ratio": 0.5}), (flux, {"ratio": 0.5}), (flux, KV_IN_KERNEL)],
                         ids=["unet", "flux", "flux-kv-in-kernel"])
def test_interrupt_inside_merged_attention_leaves_attention_intact(build, options, interrupt):
    """A Ctrl-C inside a merged attention (after size-aware attention, or keys merged in the kernel, armed itself)
    leaves every later attention exact: an unrelated SDPA call, the next patched call (equal to an uninterrupted
    one), and ``remove``. Before, the size-bias mode stayed on torch's stack: later SDPA calls raised (UNet) or
    carried a stale bias (Flux)."""
    model, call = build()
    with torch.no_grad():
        unpatched = call(model)
        tome.patch(model, **options)
        want = call(model)
        attention = next(m for name, m in model.named_modules() if name.endswith(("attn1", "attn")) and hasattr(m, "to_k"))
        fired = []

        def interrupt_once(module, args):
            if not fired:
                fired.append(True)
                raise interrupt("inside a merged attention")

        handle = attention.to_k.register_forward_pre_hook(interrupt_once)
        with pytest.raises(interrupt):
            call(model)
        handle.remove()
        assert fired
        assert _plain_sdpa_is_exact()
        assert torch.equal(call(model), want)
        assert torch._C._len_torch_function_stack() == 0
        tome.remove(model)
        assert torch.equal(call(model), unpatched)
        assert torch._C._len_torch_function_stack() == 0


def test_interrupt_then_remove_clears_the_stack():
    """``remove`` right after an interrupt leaves torch's function-mode stack as it was before the patch."""
    model, call = flux()
    tome.patch(model, ratio=0.5)
    attention = next(m for name, m in model.named_modules() if name.endswith("attn"))

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = attention.to_k.register_forward_pre_hook(interrupt)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        call(model)
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tome.remove(model)
    assert torch._C._len_torch_function_stack() == 0
    assert _plain_sdpa_is_exact()


def test_compiling_a_similarity_match_warns_nothing_of_a_cache():
    """Edges round three, 14: dynamo warned that a `functools.lru_cache` (the frame bands') may be silently wrong in
    every compiled similarity-matched model, images included; the bands are now kept in a plain dict."""
    unet = build_unet("tiny").eval()
    tome.patch(unet, ratio=0.5)
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.compile(unet, backend="eager")(torch.randn(1, 4, 32, 32, generator=generator), 500, torch.randn(1, 7, 32, generator=generator))
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]


@pytest.mark.parametrize("options, message", [
    (dict(blocks=torch.tensor(1.0)), "blocks must be a list of block indices (ints) or None, got tensor(1.)"),
    (dict(mode="kv", matching="cell", frame_window=None), "frame_window=None sets how far a similarity search reaches across frames; matching='cell' searches nothing"),
])
def test_two_messages_of_edges_round_three_say_what_is_wrong(options, message):
    """Edges round three, 15: a 0-d tensor of blocks gave a bare "iteration over a 0-d tensor"; frame_window=None
    with cell matching was refused as "None limits a similarity search"."""
    with pytest.raises((TypeError, ValueError)) as error:
        tome.patch(build_unet("tiny"), **options)
    assert message in str(error.value)

"""Edges of issue 43 around size-aware attention's function mode: torch.compile of joint- and rotary-attention
models, and an interrupt (Ctrl-C) inside a merged attention.

Oracles: the same patched model run eagerly and uninterrupted, and a plain SDPA call computed by hand.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn.functional as F

import tome_core.torch as tome
from tome_tools.diffusers_models import (
    build_transformer, build_transformer_pipeline, build_unet, build_video_transformer, transformer_inputs,
    video_transformer_inputs,
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


def test_no_function_of_the_library_is_an_lru_cache():
    """Edges round three, 14: dynamo warned that a ``functools.lru_cache`` (the frame bands') may be silently wrong in
    every compiled similarity-matched model, images included; it warns of every lru_cache a trace calls. The library's
    caches are plain dicts: no function of any of its modules is an lru_cache (a compiled UNet took 38 s to show it)."""
    import functools
    import importlib
    import pkgutil

    import tome_core

    cached = []
    for info in pkgutil.walk_packages(tome_core.__path__, "tome_core."):
        if info.name.split(".")[-1] in ("paddle", "jax", "ppdiffusers", "flax", "paddle_ops", "jax_ops"):
            continue  # other frameworks' modules: not importable in this session, and never traced by torch
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            functions = [value, *vars(value).values()] if isinstance(value, type) else [value]
            cached += [f"{info.name}.{name}" for f in functions if isinstance(f, functools._lru_cache_wrapper)]
    assert not cached


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


def _flux_pipeline():
    """A tiny FluxPipeline and ``run()``: one generation of 2 steps at 32x32 pixels (a 2x2 token grid), seeded."""
    pipe, call = build_transformer_pipeline("flux")
    pipe.set_progress_bar_config(disable=True)

    def run():
        with torch.no_grad():
            return pipe(
                height=32, width=32, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                output_type="latent", **call,
            ).images

    return pipe, run


def test_a_flux_pipeline_with_its_transformer_compiled_fullgraph_runs_patched():
    """Also seen in edges round three: ``torch.compile(pipe.transformer, fullgraph=True)`` of a patched Flux
    pipeline failed in every generation, as the transformer read each generation's new img_ids on the host (a
    graph break). The patched pipeline now tells the ids it makes their grid: two generations trace with no break
    and no new graph for the second, and equal the eager patched pipeline's."""
    pipe, run = _flux_pipeline()
    plain = run()
    tome.patch(pipe, ratio=0.5, min_tokens=0)
    eager = run()
    assert not torch.allclose(eager, plain, atol=1e-3)  # it merges
    backend = torch._dynamo.testing.CompileCounter()
    pipe.transformer = torch.compile(pipe.transformer, backend=backend, fullgraph=True)
    first = run()
    graphs = backend.frame_count
    second = run()
    assert backend.frame_count == graphs
    for compiled in (first, second):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_the_grid_a_flux_pipeline_tells_is_the_grid_its_ids_give_and_remove_takes_the_teller_off():
    """The patched pipeline's ids maker, an attribute of that pipeline object, tags the ids with the grid the
    transformer read from them before (the pipeline's output equals that of its transformer patched alone), and
    ``remove`` leaves the pipeline's attributes exactly as they were (a maker the object held itself restored)."""
    pipe, run = _flux_pipeline()
    cls = type(pipe)
    tome.patch(pipe.transformer, ratio=0.5, min_tokens=0)
    alone = run()
    before = dict(vars(pipe))
    tome.patch(pipe, ratio=0.5, min_tokens=0)
    ids = pipe._prepare_latent_image_ids(1, 3, 5, "cpu", torch.float32)
    assert ids._tome_grid == (3, 5) and set(vars(pipe)) == set(before) | {"_prepare_latent_image_ids"}
    assert torch.equal(run(), alone)
    tome.remove(pipe)
    assert vars(pipe) == before and pipe._prepare_latent_image_ids is cls._prepare_latent_image_ids
    def own(batch_size, height, width, device, dtype):  # a maker the object holds itself
        return cls._prepare_latent_image_ids(batch_size, height, width, device, dtype)

    pipe._prepare_latent_image_ids = own
    tome.patch(pipe, ratio=0.5, min_tokens=0)
    assert pipe._prepare_latent_image_ids(1, 2, 2, "cpu", torch.float32)._tome_grid == (2, 2)
    tome.remove(pipe)
    assert pipe._prepare_latent_image_ids is own

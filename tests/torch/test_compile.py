"""torch.compile in every order with patch, remove and re-patch (issue 16).

torch.compile guards on a module's class but not on its hooks, so each patch gives the modules it hooks a
same-named subclass of their class (:func:`tome_core.hooks.retyping.patched_class`) and ``remove`` restores the class.
Oracle: the eager model in the same state (unpatched, or patched with the same options), to float tolerance.
Compilations are counted by a backend that runs dynamo's graph as it is (``fullgraph=True`` everywhere, so a
graph break raises): only graphs of the model's own layers count (a hook's small frame, compiled once per
process, does not). The counts are those the table of docs/limits.md gives.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch._dynamo

import tome_core.torch as tome
from tome_tools.diffusers_models import build_pipeline, build_unet

# One level, three transformer blocks: the smallest UNet whose blocks merge, to keep compile time down.
ONE_LEVEL = dict(
    block_out_channels=(32,),
    down_block_types=("CrossAttnDownBlock2D",),
    up_block_types=("CrossAttnUpBlock2D",),
    mid_block_type=None,
)
TIMESTEPS = (500, 300)


class CountingBackend:
    """A torch.compile backend that runs the captured graph as it is and counts graphs with a linear layer."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        if any("linear" in str(node.target) for node in graph_module.graph.nodes):
            self.graphs += 1
        return graph_module.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def unet():
    return build_unet("tiny", seed=0, **ONE_LEVEL)


@pytest.fixture(scope="module")
def inputs():
    generator = torch.Generator().manual_seed(5)
    sample, text = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 7, 32, generator=generator)
    return {t: (sample, torch.tensor(t), text) for t in TIMESTEPS}


def run(model, inputs):
    with torch.no_grad():
        return model(*inputs).sample


@pytest.fixture(scope="module")
def eager(unet, inputs):
    """``eager[ratio][timestep]``: the eager model's output, unpatched (ratio None) or patched."""
    outputs = {}
    for ratio in (None, 0.5, 0.3):
        model = copy.deepcopy(unet)
        if ratio is not None:
            tome.patch(model, ratio=ratio)
        outputs[ratio] = {t: run(model, x) for t, x in inputs.items()}
    assert (outputs[0.5][500] - outputs[None][500]).abs().max() > 1e-3  # the states differ
    return outputs


def compiled(model, how, backend):
    """``(what to call, what to patch)`` for one way of compiling ``model``."""
    options = dict(backend=backend, fullgraph=True)
    if how == "torch.compile(model)":
        wrapper = torch.compile(model, **options)
        return wrapper, wrapper  # patch the wrapper itself: the hooks must reach the module it compiles
    if how == "model.compile()":
        model.compile(**options)
        return model, model
    if how == "a compiled function calling the model":
        return torch.compile(lambda *x: model(*x), **options), model
    if how == "compile_repeated_blocks":
        model.compile_repeated_blocks(**options)
        return model, model
    raise AssertionError(how)


# Compilations per state change: whole-model compiles once per new state; regional compilation compiles its
# block once for all three blocks unpatched, and each block once when patched (their hooks differ).
COMPILES = {
    "torch.compile(model)": dict(first=1, patch=1),
    "model.compile()": dict(first=1, patch=1),
    "a compiled function calling the model": dict(first=1, patch=1),
    "compile_repeated_blocks": dict(first=1, patch=3),
}


@pytest.mark.parametrize("how", list(COMPILES))
def test_patch_remove_and_repatch_after_a_compiled_call_take_effect(unet, inputs, eager, how):
    if how == "compile_repeated_blocks":  # 1 + 3 per patch compilations of one code object; torch allows 8
        with torch._dynamo.config.patch(recompile_limit=16):
            check_orders(unet, inputs, eager, how)
    else:
        check_orders(unet, inputs, eager, how)


def check_orders(unet, inputs, eager, how):
    model = copy.deepcopy(unet)
    backend = CountingBackend()
    call, target = compiled(model, how, backend)
    costs = COMPILES[how]

    def check(ratio, timestep, compiles):
        torch.testing.assert_close(run(call, inputs[timestep]), eager[ratio][timestep], rtol=1e-5, atol=1e-5)
        assert backend.graphs == compiles, (ratio, timestep)

    check(None, 500, costs["first"])
    tome.patch(target, ratio=0.5)
    assert [type(m).__name__ for m, _ in tome.patched_models(target)] == ["UNet2DConditionModel"]
    check(0.5, 500, costs["first"] + costs["patch"])
    check(0.5, 300, costs["first"] + costs["patch"])  # a new timestep: no recompilation
    tome.remove(target)
    check(None, 500, costs["first"] + costs["patch"])  # the code compiled before patching runs again
    tome.patch(target, ratio=0.5)
    check(0.5, 500, costs["first"] + 2 * costs["patch"])  # a new patch compiles again, even with equal options
    tome.patch(target, ratio=0.3)
    check(0.3, 300, costs["first"] + 3 * costs["patch"])
    tome.remove(target)
    check(None, 300, costs["first"] + 3 * costs["patch"])


def test_patch_before_compiling_then_remove_and_repatch(unet, inputs, eager):
    model = tome.patch(copy.deepcopy(unet), ratio=0.5)
    backend = CountingBackend()
    call = torch.compile(model, backend=backend, fullgraph=True)
    torch.testing.assert_close(run(call, inputs[500]), eager[0.5][500], rtol=1e-5, atol=1e-5)
    tome.remove(model)
    torch.testing.assert_close(run(call, inputs[500]), eager[None][500], rtol=1e-5, atol=1e-5)
    tome.patch(model, ratio=0.3)
    torch.testing.assert_close(run(call, inputs[300]), eager[0.3][300], rtol=1e-5, atol=1e-5)
    assert backend.graphs == 3


def test_inductor_reduce_overhead_patch_and_remove_after_compiled_call(inputs):
    """inductor itself (mode="reduce-overhead": CUDA graphs on a GPU, plain inductor here) on the smallest
    model with a merging block: one Transformer2DModel."""
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    torch.manual_seed(0)
    model = Transformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=32, norm_num_groups=32, cross_attention_dim=32
    ).eval()
    x, text = torch.randn(2, 32, 8, 8), torch.randn(2, 7, 32)

    def run2d(m):
        with torch.no_grad():
            return m(x, encoder_hidden_states=text, return_dict=False)[0]

    plain = run2d(model)
    patched = run2d(tome.patch(copy.deepcopy(model), ratio=0.5))
    assert (patched - plain).abs().max() > 1e-3
    call = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    torch.testing.assert_close(run2d(call), plain, rtol=1e-4, atol=1e-5)
    tome.patch(call, ratio=0.5)
    torch.testing.assert_close(run2d(call), patched, rtol=1e-4, atol=1e-5)
    tome.remove(call)
    torch.testing.assert_close(run2d(call), plain, rtol=1e-4, atol=1e-5)


def test_pipeline_with_a_compiled_unet_takes_patch_and_remove():
    pipe = build_pipeline("sd")
    pipe.set_progress_bar_config(disable=True)
    arguments = dict(prompt="a photo", num_inference_steps=2, height=32, width=32, output_type="np")

    def images():
        return pipe(**arguments, generator=torch.Generator().manual_seed(0)).images

    plain = images()
    tome.patch(pipe, ratio=0.5)
    patched = images()
    tome.remove(pipe)
    assert np.abs(patched - plain).max() > 1e-4
    backend = CountingBackend()
    pipe.unet = torch.compile(pipe.unet, backend=backend, fullgraph=True)
    np.testing.assert_allclose(images(), plain, rtol=1e-4, atol=1e-4)
    tome.patch(pipe, ratio=0.5)
    np.testing.assert_allclose(images(), patched, rtol=1e-4, atol=1e-4)
    tome.remove(pipe)
    np.testing.assert_allclose(images(), plain, rtol=1e-4, atol=1e-4)
    assert backend.graphs == 2  # unpatched, patched; every step of a state reuses its graph


def test_patched_classes_pickle_and_copy_as_patched(unet, inputs, eager):
    model = tome.patch(copy.deepcopy(unet), ratio=0.5)

    def attn1(m):
        return m.down_blocks[0].attentions[0].transformer_blocks[0].attn1

    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(twin) is type(unet)  # the model and its blocks keep their classes
        assert type(attn1(twin)) is type(attn1(model)) is not type(attn1(unet))  # the merged sub-layers do not
        assert type(attn1(twin)).__qualname__ == "Attention" and isinstance(attn1(twin), type(attn1(unet)))
        torch.testing.assert_close(run(twin, inputs[500]), eager[0.5][500], rtol=1e-5, atol=1e-5)
        tome.remove(twin)
        assert type(attn1(twin)) is type(attn1(unet))
        torch.testing.assert_close(run(twin, inputs[500]), eager[None][500], rtol=0, atol=0)
    torch.testing.assert_close(run(model, inputs[500]), eager[0.5][500], rtol=1e-5, atol=1e-5)


def test_recompile_limit_under_fullgraph_raises_torchs_error(unet, inputs):
    """Each patch is a new class: past torch's recompile limit, fullgraph code raises (not silently eager)."""
    model = copy.deepcopy(unet)
    call = torch.compile(model, backend="eager", fullgraph=True)
    limit = 2
    with torch._dynamo.config.patch(recompile_limit=limit), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(call, inputs[500])
        tome.patch(model, ratio=0.5)
        run(call, inputs[500])
        tome.patch(model, ratio=0.4)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            run(call, inputs[500])


def test_blocks_compiled_one_by_one_beyond_the_recompile_limit_are_refused_at_patch(unet, inputs, eager):
    model = copy.deepcopy(unet)
    model.compile_repeated_blocks(backend="eager", fullgraph=True)
    run(model, inputs[500])
    with torch._dynamo.config.patch(recompile_limit=3):
        with pytest.raises(ValueError, match=r"3 BasicTransformerBlocks .*recompile_limit \(3\) .* at least 4"):
            tome.patch(model, ratio=0.5)
    assert not tome.patched_models(model)
    torch.testing.assert_close(run(model, inputs[500]), eager[None][500], rtol=1e-5, atol=1e-5)


def test_timestep_range_under_torch_compile_switches_between_merged_and_unpatched(unet, inputs, eager):
    """The range is read on the host at the model's entry (a graph break there, so not fullgraph); the blocks
    compiled inside follow each call's decision."""
    model = tome.patch(copy.deepcopy(unet), ratio=0.5, timestep_range=(400, 1000))
    wrapper = torch.compile(model, backend="eager")
    for t in (500, 300, 500):
        expected = eager[0.5][t] if t >= 400 else eager[None][t]
        torch.testing.assert_close(run(wrapper, inputs[t]), expected, rtol=1e-5, atol=1e-5)

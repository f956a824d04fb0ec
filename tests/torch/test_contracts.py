"""The promises under the default and every option (issue 35), on torch: a sweep's findings, each against an
oracle (the unpatched model, a fresh patch, tomesd's own patch, brute-force token counts), then property tests
over the option space and the processors users stack.

Promises: every bad option is refused before anything is patched, naming the argument; a model or processor
``patch`` accepts runs (``mode="auto"`` runs ToMe for SD's arrangement in a block whose processor cannot take
separate keys, and the summary says so); nothing is silently skipped (a patch that merges nothing warns); the
same seed gives the same image in every generation; ``remove`` is exact.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, List, Tuple

import numpy as np
import pytest
import torch
from diffusers.models.attention_processor import (
    AttnProcessor,
    AttnProcessor2_0,
    PAGIdentitySelfAttnProcessor2_0,
    SlicedAttnProcessor,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import tome_core.torch as tome
from tome_tools.diffusers_models import build_pipeline, build_transformer, build_unet, build_video_unet

STEPS = (900, 500, 100)  # one generation: timesteps going down


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the models are tiny, and two threads wait on each other on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def call(model, inputs, timestep=None):
    sample, t, text = inputs
    with torch.no_grad():
        return model(sample, t if timestep is None else timestep, text).sample


def quiet_patch(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return tome.patch(model, **options)


class HandAttnProcessor:
    """A processor of the user's own that computes attention by hand: no SDPA, no attention mask."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        weights = (q @ k.transpose(-1, -2) * attn.scale).softmax(-1)
        return attn.to_out[1](attn.to_out[0](weights @ v))


class KernelKeys(TorchDispatchMode):
    """The key counts the attention kernels of one call receive: ``mode="kv"`` on a fused ``to_qkv`` merges the
    keys inside ``F.scaled_dot_product_attention``, after every module hook has run. A dispatch mode, not a function
    mode as ``tome_tools.diffusers_bench.SdpaCalls``: that one is entered around the whole call, below ToMe's
    function mode; one entered by this pre-hook would sit above ToMe's, armed by its earlier pre-hook, and see the
    keys unmerged."""

    def __init__(self):
        super().__init__()
        self.keys: List[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__:
            self.keys.append(args[1].shape[-2])
        return func(*args, **(kwargs or {}))


def attn1_keys(model, children=("attn1",)) -> Tuple[List[Tuple], List[Any]]:
    """(queries, keys) of every self-attention call, from hooks after ToMe's; with other ``children`` (of the
    transformer blocks), (child, tokens in, keys) of each of their calls. The keys are those the attention kernel
    receives where the processor calls one, else those the module receives."""
    seen: List[Tuple] = []
    kernels: List[KernelKeys] = []

    def enter(module, args, kwargs):
        kernels.append(KernelKeys())
        kernels[-1].__enter__()

    def count(module, args, kwargs, output, child):
        kernel = kernels.pop()
        kernel.__exit__(None, None, None)
        hidden = args[0] if args else kwargs["hidden_states"]
        keys = kwargs.get("encoder_hidden_states") if child == "attn1" else None
        keys = kernel.keys[0] if kernel.keys else (hidden if keys is None else keys).shape[1]
        seen.append((hidden.shape[1], keys) if children == ("attn1",) else (child, hidden.shape[1], keys))

    handles = []
    for n, m in model.named_modules():
        child = n.rsplit(".", 1)[-1]
        if child in children and ".transformer_blocks." in n:
            handles.append(m.register_forward_pre_hook(enter, with_kwargs=True))
            handles.append(m.register_forward_hook(
                lambda m, a, k, o, child=child: count(m, a, k, o, child), with_kwargs=True))
    return seen, handles


# --------------------------------------------------------------------------------------- a default that runs


def test_the_default_runs_tokens_where_attn1_attends_to_text_and_explicit_kv_is_refused_at_patch(inputs):
    unet = build_unet("tiny", seed=0, only_cross_attention=True)
    reference = call(unet, inputs)
    with pytest.raises(ValueError, match=r"mode='kv' needs .*\.attn1 attends to the text \(only_cross_attention=True\)"):
        tome.patch(unet, mode="kv")
    assert tome.patched_models(unet) == []
    tome.patch(unet)
    seen, _ = attn1_keys(unet)
    out = call(unet, inputs)
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    assert (128, 7) in seen and (256, 7) not in seen  # queries merged by half, keys the 7 text tokens
    assert "only_cross_attention=True), not to its own tokens, so ToMe for SD's arrangement runs there" in tome.patched_models(unet)[0].state.summary()
    tome.remove(unet)
    torch.testing.assert_close(call(unet, inputs), reference, rtol=0, atol=0)


def test_a_hand_written_processor_is_refused_at_patch_under_size_aware_attention_and_runs_by_default(unet, inputs):
    model = copy.deepcopy(unet)
    model.set_attn_processor(HandAttnProcessor())
    reference = call(model, inputs)
    with pytest.raises(ValueError, match=r"proportional_attn=True .* in block 0 of UNet2DConditionModel "
                       r"BasicTransformerBlock.attn1's processor HandAttnProcessor computes attention without "
                       r"scaled_dot_product_attention .*pass proportional_attn=False"):
        tome.patch(model, ratio=0.5)
    tome.patch(model, ratio=0.5, proportional_attn=False)
    assert not torch.equal(call(model, inputs), reference)
    tome.patch(model)  # auto: kv cannot run there, nor can the sizes reach it: tokens with a plain softmax
    seen, _ = attn1_keys(model)
    assert not torch.equal(call(model, inputs), reference) and (128, 128) in seen and (256, 256) not in seen
    tome.remove(model)
    torch.testing.assert_close(call(model, inputs), reference, rtol=0, atol=0)


# ---------------------------------------------------------------------------- inputs the unpatched model takes


@pytest.mark.parametrize("options", [{}, {"ratio": 0.5}, {"ratio": 0.5, "timestep_range": (400, 1000)}], ids=repr)
def test_numpy_and_python_timesteps_give_the_tensor_timestep_output(unet, inputs, options):
    model = tome.patch(copy.deepcopy(unet), **options)
    expected = call(model, inputs, torch.tensor(500))
    # every form the unpatched UNet takes (it refuses np.float32 and numpy arrays itself)
    for timestep in (np.int64(500), np.float64(500), 500, 500.0, torch.tensor([500, 500]), torch.tensor([500]), torch.tensor(500.0)):
        torch.testing.assert_close(call(model, inputs, timestep), expected, rtol=0, atol=1e-6, msg=repr(timestep))


def test_timestep_range_under_fullgraph_compile_names_itself():
    model = tome.patch(build_unet("tiny", seed=0), ratio=0.5, timestep_range=(0, 1000))
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    sample, text = torch.randn(2, 4, 16, 16), torch.randn(2, 7, 32)
    with pytest.raises(Exception, match="tome_core reads a small tensor on the host.*timestep under timestep_range.*fullgraph"):
        with torch.no_grad():
            compiled(sample, torch.tensor(500), text)


# --------------------------------------------------------------------------------------- foreign patches


def test_a_unet_patched_by_tomesd_is_taken_over_and_remove_undoes_both(unet, inputs):
    tomesd = pytest.importorskip("tomesd")
    reference = call(unet, inputs)
    model = copy.deepcopy(unet)
    tomesd.apply_patch(model, ratio=0.5)
    assert any(type(m).__name__ == "ToMeBlock" for m in model.modules())
    tome.patch(model, ratio=0.5)
    fresh = tome.patch(copy.deepcopy(unet), ratio=0.5)
    torch.testing.assert_close(call(model, inputs), call(fresh, inputs), rtol=0, atol=0)
    assert not any(type(m).__name__ == "ToMeBlock" or "_tome_info" in m.__dict__ for m in model.modules())
    tome.remove(model)
    torch.testing.assert_close(call(model, inputs), reference, rtol=0, atol=0)
    again = copy.deepcopy(unet)  # remove alone also undoes tomesd's patch
    tomesd.apply_patch(again, ratio=0.5)
    tome.remove(again)
    assert not again._forward_pre_hooks
    torch.testing.assert_close(call(again, inputs), reference, rtol=0, atol=0)


# ------------------------------------------------------------------------------- state of one generation


def generation(model, inputs, steps=STEPS) -> List[torch.Tensor]:
    return [call(model, inputs, torch.tensor(t)) for t in steps]


@pytest.mark.parametrize("options", [
    {"ratio": 0.5, "reuse_steps": 2}, {"ratio": 0.5, "reuse_steps": 2, "use_rand": False}, {"ratio": 0.5, "reuse_steps": 3, "reuse_level": True},
], ids=repr)
def test_reuse_steps_gives_the_same_output_in_every_generation(unet, inputs, options):
    model = tome.patch(copy.deepcopy(unet), **options)
    first, second = generation(model, inputs), generation(model, inputs)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fresh = tome.patch(copy.deepcopy(unet), **options)
    for a, b in zip(first, generation(fresh, inputs)):  # and the output of a model never run before
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the matches are still reused within a generation: its second step equals step 900's match at step 500
    state = tome.patched_models(model)[0].state
    assert state.matching.calls == len(STEPS)


def test_reuse_steps_on_animatediff_gives_the_same_output_in_every_generation():
    from tome_tools.diffusers_models import video_unet_inputs

    model = tome.patch(build_video_unet("animatediff"), ratio=0.5, reuse_steps=2, use_rand=False)
    inputs = video_unet_inputs(model, 4, 8, 8, batch=2, seed=1)

    def generation():
        with torch.no_grad():
            return [model(**{**inputs, "timestep": torch.tensor(t)}).sample for t in STEPS]

    for a, b in zip(generation(), generation()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reuse_steps_in_a_pipeline_same_seed_same_image():
    pipe = build_pipeline("sd")
    pipe.set_progress_bar_config(disable=True)
    tome.patch(pipe, ratio=0.5, reuse_steps=2)
    run = lambda: pipe("a cat", num_inference_steps=3, height=32, width=32, output_type="np",
                       generator=torch.Generator().manual_seed(0)).images
    np.testing.assert_array_equal(run(), run())


# ---------------------------------------------------------------------------- options that cannot act


@pytest.mark.parametrize("options, message", [
    ({"blocks": [1]}, "blocks names block 1 of UNet2DConditionModel, which runs at 1/2 scale and never merges"),
    ({"blocks": [-1]}, "blocks names block -1 of UNet2DConditionModel, which runs at 1/4 scale"),
    ({"level_ratios": {2: 0.5}}, r"level_ratios names level 2 \(1/2 scale\), where no block of UNet2DConditionModel merges"),
    ({"mode": "kv", "matching": "cell", "level_cells": {4: 2}, "max_downsample": 2}, r"level_cells names level 4"),
    ({"block_ratios": {0: 0.7}, "blocks": [4]}, r"block_ratios gives block 0 of UNet2DConditionModel a ratio, but blocks=\[4\]"),
    ({"block_ratios": {0: 0.3, -7: 0.6}}, r"block_ratios names block 0 of UNet2DConditionModel twice \(0 and -7"),
    ({"ratio": 0.5, "timestep_range": (2000, 3000)}, "never merges on UNet2DConditionModel, whose timesteps run from 0 to 1000"),
    ({"level_cells": {1: 4}, "ratio": 0.9, "max_downsample": 2}, r"ratio=0.9 cannot be reached at 1/2 scale of UNet2DConditionModel, whose cells are 2x2"),
], ids=lambda case: repr(case) if isinstance(case, dict) else None)
def test_options_that_cannot_act_on_the_unet_are_refused_before_anything_is_patched(unet, options, message):
    model = tome.patch(copy.deepcopy(unet), ratio=0.3)
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    with pytest.raises(ValueError, match=message):
        tome.patch(model, **options)
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks  # the earlier patch stays
    assert tome.patched_models(model)[0].state.config.ratio == 0.3


def test_options_that_cannot_act_on_flux_and_video_unets_are_refused():
    with pytest.raises(ValueError, match=r"timestep_range=\(400.0, 600.0\) never merges on FluxTransformer2DModel, whose timesteps run from 0 to 1"):
        tome.patch(build_transformer("tiny-flux"), ratio=0.5, timestep_range=(400, 600))
    with pytest.raises(ValueError, match="blocks names block -1 of UNetMotionModel, which runs at 1/2 scale"):
        tome.patch(build_video_unet("animatediff"), ratio=0.5, blocks=[-1])


def test_zero_ratios_on_every_merged_block_warn_naming_them_and_merge_nothing(unet, inputs):
    model = copy.deepcopy(unet)
    with pytest.warns(UserWarning, match=r"merges no tokens: block_ratios\[0\]=0.0, block_ratios\[4\]=0.0, block_ratios\[5\]=0.0 \(no merged"):
        tome.patch(model, block_ratios={0: 0.0, 4: 0.0, 5: 0.0})
    torch.testing.assert_close(call(model, inputs), call(unet, inputs), rtol=0, atol=0)


def test_seeds_beyond_the_hash_prime_give_other_images(unet, inputs):
    outputs = [call(tome.patch(copy.deepcopy(unet), ratio=0.5, seed=seed), inputs) for seed in (0, 32749, 2**31 - 1)]
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], outputs[2])


@pytest.mark.parametrize("entry, message", [
    (lambda u: tome.patch(u, ratio="0.75", matching="cell"), r"ratio must be a float in \[0, 1 - 1/\(sx\*sy\)\], got '0.75' \(str\)"),
    (lambda u: tome.apply_patch(u, ratio=0.5, foo=1), "apply_patch got unknown option.s. foo; tomesd's apply_patch takes ratio, max_downsample"),
], ids=["ratio-str-cell", "apply_patch-foo"])
def test_errors_name_the_argument(unet, entry, message):
    with pytest.raises(TypeError, match=message):
        entry(copy.deepcopy(unet))


def test_level_cells_bound_the_ratio_at_their_own_level(unet, inputs):
    """level_cells={1: 4} lets the finest level (the only one merged here) take 0.9; the old check cited 2x2."""
    model = tome.patch(copy.deepcopy(unet), level_cells={1: 4}, ratio=0.9)
    seen, _ = attn1_keys(model)
    call(model, inputs)
    assert (256 - int(256 * 0.9), 256 - int(256 * 0.9)) in seen


# ---------------------------------------------------------------------------------------- property tests

PROCESSORS = {
    "sdpa": lambda m: m.set_attn_processor(AttnProcessor2_0()),
    "classic": lambda m: m.set_attn_processor(AttnProcessor()),
    "sliced": lambda m: m.set_attn_processor(SlicedAttnProcessor(slice_size=1)),
    "fused": lambda m: m.fuse_qkv_projections(),
    "pag": lambda m: [a.set_processor(PAGIdentitySelfAttnProcessor2_0()) for n, a in m.named_modules() if n.endswith("attn1")],
    "hand": lambda m: m.set_attn_processor(HandAttnProcessor()),
}
OPTIONS = st.fixed_dictionaries({}, optional={
    "mode": st.sampled_from(["auto", "tokens", "kv", "queries"]),
    "ratio": st.sampled_from([0.0, 0.3, 0.5, 0.75, 0.9, "0.5"]),
    "matching": st.sampled_from(["similarity", "cell"]),
    "cell_pool": st.sampled_from(["mean", "sample"]),
    "max_downsample": st.sampled_from([None, 1, 2, 4]),
    "sx": st.sampled_from([1, 2, 4]),
    "use_rand": st.booleans(),
    "merge_crossattn": st.booleans(),
    "merge_mlp": st.booleans(),
    "proportional_attn": st.booleans(),
    "seed": st.sampled_from([0, 7, 32749, 2**31 - 1]),
    "blocks": st.sampled_from([[0], [1], [-1], [0, 4], [0, -7]]),
    "block_ratios": st.sampled_from([{0: 0.0}, {0: 0.7}, {4: 0.3, 5: 0.0}, {1: 0.5}]),
    "level_ratios": st.sampled_from([{1: 0.0}, {1: 0.6}, {2: 0.5}]),
    "level_cells": st.sampled_from([{1: 4}, {2: 2}]),
    "reuse_steps": st.sampled_from([1, 2]),
    "reuse_blocks": st.sampled_from([1, 2]),
    "attn_ratio": st.sampled_from([0.0, 0.4]),
    "timestep_range": st.sampled_from([(400, 1000), (0, 600), (2000, 3000)]),
})


class Unpatched(dict):
    """processor name -> (the tiny UNet with it, its outputs over one generation, its sub-layer calls in order)."""

    def __repr__(self) -> str:
        return f"Unpatched({', '.join(self)})"


@pytest.fixture(scope="module")
def models(unet):
    built = Unpatched()
    for name, set_up in PROCESSORS.items():
        model = copy.deepcopy(unet)
        set_up(model)
        seen, handles = attn1_keys(model, SUBLAYERS)
        outputs = generation(model, INPUTS, PROPERTY_STEPS)
        for handle in handles:
            handle.remove()
        built[name] = (model, outputs, seen)
    return built


SUBLAYERS = ("attn1", "attn2", "ff")
PROPERTY_STEPS = (900, 300)  # each timestep_range drawn holds one of them
INPUTS = (torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(5)), None,
          torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(6)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(processor=st.sampled_from(sorted(PROCESSORS)), options=OPTIONS)
@example(processor="fused", options={"mode": "kv"})  # keys merged inside the kernel: counted there
def test_every_option_set_is_refused_naming_an_argument_or_runs_merges_repeats_and_removes(models, patch_or_refuse, processor, options):
    model, reference, plain = models[processor]
    caught = patch_or_refuse(tome, model, options)
    if caught is None:
        return
    try:
        seen, handles = attn1_keys(model, SUBLAYERS)
        first = generation(model, INPUTS, PROPERTY_STEPS)
        for handle in handles:
            handle.remove()
        second = generation(model, INPUTS, PROPERTY_STEPS)
    finally:
        tome.remove(model)
    for a, b in zip(first, second):  # same seed, same output in every generation
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(torch.isfinite(out).all() for out in first)
    warned = [message for message in caught if "merges no tokens" in message]
    assert len(seen) == len(plain)
    fewer = [(now, before) for now, before in zip(seen, plain) if now != before]  # calls on fewer tokens or keys
    assert all(n[1] <= b[1] and n[2] <= b[2] for n, b in fewer), fewer
    assert warned or fewer, (options, seen)
    if warned:
        for a, b in zip(first, reference):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(generation(model, INPUTS, PROPERTY_STEPS), reference):  # remove is exact
        torch.testing.assert_close(a, b, rtol=0, atol=0)

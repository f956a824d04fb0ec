"""The torch entry point: call styles, lifecycle, errors, randomness. The unpatched model is the oracle."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from diffusers.models.attention import BasicTransformerBlock

import tome_core.torch as tome
from tome_tools.diffusers_models import build_unet


@pytest.fixture(scope="module")
def unet():
    return build_unet("tiny", seed=0)


@pytest.fixture(scope="module")
def inputs():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(2, 4, 16, 16, generator=generator), torch.tensor(500), torch.randn(2, 7, 32, generator=generator)


def call(model, inputs, keywords=False):
    sample, timestep, text = inputs
    with torch.no_grad():
        if keywords:
            return model(sample=sample, timestep=timestep, encoder_hidden_states=text).sample
        return model(sample, timestep, text).sample


def test_keyword_only_call_equals_positional(unet, inputs):
    model = tome.patch(copy.deepcopy(unet), ratio=0.5)
    positional, keywords = call(model, inputs), call(model, inputs, keywords=True)
    assert not torch.equal(positional, call(unet, inputs))
    torch.testing.assert_close(keywords, positional, rtol=0, atol=0)


def test_patch_twice_equals_patch_once_with_newer_options(unet, inputs):
    twice = tome.patch(tome.patch(copy.deepcopy(unet), ratio=0.3, merge_mlp=True), ratio=0.6)
    once = tome.patch(copy.deepcopy(unet), ratio=0.6)
    torch.testing.assert_close(call(twice, inputs), call(once, inputs), rtol=0, atol=0)
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in twice.modules())
    assert hooks == sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in once.modules())


def test_remove_restores_classes_hooks_and_bit_identical_output(unet, inputs):
    model = copy.deepcopy(unet)
    plain = call(model, inputs)
    classes = [type(m) for m in model.modules()]
    tome.remove(model)  # removing an unpatched model is a no-op
    tome.patch(model, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    patched = [type(m) for m in model.modules()]  # hooked modules: a same-named subclass (torch.compile guards it)
    assert all(issubclass(p, c) and p.__qualname__ == c.__qualname__ for p, c in zip(patched, classes))
    assert sum(p is not c for p, c in zip(patched, classes)) > 1
    assert list(model.state_dict()) == list(unet.state_dict())
    assert tome.remove(model) is model
    assert [type(m) for m in model.modules()] == classes
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    torch.testing.assert_close(call(model, inputs), plain, rtol=0, atol=0)


def test_ratio_zero_is_exactly_unpatched_and_says_it_merges_nothing(unet, inputs):
    model = copy.deepcopy(unet)
    with pytest.warns(UserWarning, match="merges no tokens: ratio=0"):
        tome.patch(model, ratio=0.0)
    torch.testing.assert_close(call(model, inputs), call(unet, inputs), rtol=0, atol=0)


def test_running_a_patched_model_leaves_the_global_rng_alone(unet, inputs):
    model = tome.patch(copy.deepcopy(unet), ratio=0.5, use_rand=True)
    before = torch.get_rng_state()
    first = call(model, inputs)
    assert torch.equal(torch.get_rng_state(), before)
    torch.testing.assert_close(call(model, inputs), first, rtol=0, atol=0)


def test_seed_and_timestep_choose_the_partition(unet, inputs):
    sample, _, text = inputs
    model = tome.patch(copy.deepcopy(unet), ratio=0.5, seed=1)
    other_seed = tome.patch(copy.deepcopy(unet), ratio=0.5, seed=2)
    fixed = tome.patch(copy.deepcopy(unet), ratio=0.5, use_rand=False)
    a, b = call(model, inputs), call(other_seed, inputs)
    assert not torch.equal(a, b)
    assert not torch.equal(a, call(model, (sample, torch.tensor(499), text)))
    assert not torch.equal(a, call(fixed, inputs))


def test_tomesd_drop_in_names_use_tomesd_defaults(unet, inputs):
    model = tome.apply_patch(copy.deepcopy(unet), use_rand=False)
    reference = tome.patch(copy.deepcopy(unet), ratio=0.5, max_downsample=1, use_rand=False, proportional_attn=False)
    torch.testing.assert_close(call(model, inputs), call(reference, inputs), rtol=0, atol=0)
    tome.remove_patch(model)
    torch.testing.assert_close(call(model, inputs), call(unet, inputs), rtol=0, atol=0)
    assert tome.apply_tome.__wrapped__ is tome.patch.__wrapped__ and tome.remove_tome is tome.remove


def test_deepcopy_of_a_patched_model_stays_patched_independently(unet, inputs):
    model = tome.patch(copy.deepcopy(unet), ratio=0.5)
    clone = copy.deepcopy(model)
    patched = call(model, inputs)
    torch.testing.assert_close(call(clone, inputs), patched, rtol=0, atol=0)
    tome.remove(model)
    torch.testing.assert_close(call(clone, inputs), patched, rtol=0, atol=0)
    torch.testing.assert_close(call(model, inputs), call(unet, inputs), rtol=0, atol=0)


def test_blocks_outside_a_2d_transformer_raise_a_clear_error():
    torch.manual_seed(0)
    block = BasicTransformerBlock(32, 4, 8, cross_attention_dim=16).eval()
    wrapper = torch.nn.Sequential(block)
    # Refused by patch itself, never by the first call.
    with pytest.raises(ValueError, match="BasicTransformerBlocks are outside a UNet.*nothing tells them their token grid"):
        tome.patch(wrapper, ratio=0.5)
    assert not tome.patched_models(wrapper)


@pytest.mark.parametrize(
    "obj, error, message",
    [
        ("a pipeline", TypeError, "ToMe patches a pipeline or a model; got str 'a pipeline'.*It takes a diffusers DiffusionPipeline"),
        (torch.nn.Linear(2, 2), ValueError, "nothing to patch: Linear contains no transformer block ToMe knows; pass a pipeline, or its UNet"),
    ],
)
def test_objects_that_cannot_be_patched_raise(obj, error, message):
    with pytest.raises(error, match=message):
        tome.patch(obj)


def test_a_refusal_is_short_and_says_what_to_pass():
    """A module ToMe cannot patch is refused in one or two sentences (under 400 characters), not with a list of
    the library's classes: a pipeline's text encoder, and every class the registry refuses with its reason."""
    from transformers import CLIPTextConfig, CLIPTextModel

    from tome_core.models.model_zoo import REFUSED

    encoder = CLIPTextModel(CLIPTextConfig(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2))
    with pytest.raises(ValueError) as refused:
        tome.patch(encoder)
    message = str(refused.value)
    assert len(message) < 400 and "CLIPTextModel" in message and "pass a pipeline, or its UNet" in message, message
    for name, reason in REFUSED.items():  # said as "ToMe cannot patch {class}: {reason}"
        assert len(f"ToMe cannot patch {name}: {reason}") < 400, name


def test_a_misspelt_option_gets_a_suggestion(unet):
    with pytest.raises(TypeError, match=r"unknown ToMe option\(s\) rato \(did you mean ratio for rato\?\)"):
        tome.patch(copy.deepcopy(unet), rato=0.5)
    with pytest.raises(TypeError, match=r"unknown ToMe option\(s\) zzz; valid options"):  # nothing close: no guess
        tome.patch(copy.deepcopy(unet), zzz=1)


def test_bad_options_raise_through_every_entry_point(unet):
    model = copy.deepcopy(unet)
    with pytest.raises(ValueError, match="ratio=0.9 cannot be reached"):
        tome.patch(model, ratio=0.9)
    with pytest.raises(TypeError, match="unknown ToMe option\\(s\\) rato"):
        model.apply_tome(rato=0.5)
    with pytest.raises(ValueError, match="max_downsample must be one of"):
        tome.apply_patch(model, max_downsample=3)
    assert not hasattr(model, "_tome_patch")


TOMESD_NAMES = {"ratio", "max_downsample", "sx", "sy", "use_rand", "merge_attn", "merge_crossattn", "merge_mlp"}


def test_every_bad_option_raises_through_every_entry_point_and_patches_nothing(unet, bad_option):
    options, error, message = bad_option
    model = copy.deepcopy(unet)
    entries = [lambda: tome.patch(model, **options), lambda: model.apply_tome(**options)]
    if set(options) <= TOMESD_NAMES:
        entries.append(lambda: tome.apply_patch(model, **options))
    for entry in entries:
        with pytest.raises(error, match=message):
            entry()
    assert tome.patched_models(model) == []


def test_merge_mlp_with_forward_chunking_is_refused(unet, inputs):
    """Refused by patch when the chunking is already set (issue 35), by the first call when it is set after."""
    model = copy.deepcopy(unet)

    def chunk():
        for module in model.modules():
            if isinstance(module, BasicTransformerBlock):
                module.set_chunk_feed_forward(chunk_size=16, dim=1)

    tome.patch(model, merge_mlp=True)
    chunk()
    with pytest.raises(ValueError, match="merge_mlp=True cannot be combined with feed-forward chunking"):
        call(model, inputs)
    with pytest.raises(ValueError, match="merge_mlp=True cannot be combined with feed-forward chunking"):
        tome.patch(model, merge_mlp=True)
    tome.patch(model)  # merge_mlp off: chunking and merging coexist
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.isfinite(call(model, inputs)).all()


def test_apply_tome_takes_the_ratio_positionally_and_names_itself_when_misused(unet):
    model = copy.deepcopy(unet)
    model.apply_tome(0.3)
    [(_, state)] = tome.patched_models(model)
    assert (state.config.ratio, state.config.mode) == (0.3, "tokens")
    with pytest.raises(TypeError, match=r"apply_tome takes the ratio as its only positional argument, got 2"):
        model.apply_tome(0.5, 2)
    with pytest.raises(TypeError, match="apply_tome got the ratio twice"):
        tome.apply_tome(model, 0.5, ratio=0.5)
    assert tome.patched_models(model)[0][1].config.ratio == 0.3  # a refused call keeps the earlier patch
    tome.patch(model, 0.4)  # patch takes it positionally too, as users of apply_tome write it
    assert tome.patched_models(model)[0][1].config.ratio == 0.4
    with pytest.raises(TypeError, match=r"patch takes the ratio as its only positional argument, got 2"):
        tome.patch(model, 0.5, 2)


def test_patched_models_print_briefly_and_dir_shows_the_public_names(unet):
    tome.patch(unet, ratio=0.3)
    try:
        text = repr(tome.patched_models(unet))
        [(model, state)] = tome.patched_models(unet)  # still unpacks as (model, state)
    finally:
        tome.remove(unet)
    assert model is unet and state.config.ratio == 0.3
    assert text == "[Patched(model=UNet2DConditionModel, state=ToMeState(config=ToMeConfig(ratio=0.3, mode='tokens'), finest_level=1, no call yet))]"
    assert "DiffusionPipeline" not in dir(tome)


def test_the_state_says_when_no_call_has_run_yet(unet):
    model = copy.deepcopy(unet)
    tome.patch(model, ratio=0.5)
    state = tome.patched_models(model)[0].state
    assert state.summary() == "  no call yet: summary() describes the last call of the patched model"
    with torch.no_grad():
        model(torch.randn(1, 4, 16, 16), torch.tensor(500), torch.randn(1, 7, 32))
    assert "no call yet" not in repr(state) and "256 -> 128 tokens" in state.summary(), state.summary()


def test_the_cli_leaves_out_transformers_torchvision_notice():
    """diffusers' pipelines make transformers 5 say once per class that it falls back to PIL without
    torchvision; the project's CLI does not print it (the library itself changes no logging)."""
    import subprocess
    import sys

    code = "import tome_tools.diffusers_bench"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    if "requires torchvision" not in plain.stderr:  # before the second import (a subprocess importing diffusers)
        pytest.skip("this transformers (or torchvision installed) prints no notice: nothing to leave out")
    quiet = subprocess.run(
        [sys.executable, "-c", "from tome_tools.console import quiet_known_notices; quiet_known_notices(); " + code],
        capture_output=True, text=True,
    )
    assert quiet.returncode == 0 and "requires torchvision" not in quiet.stderr, quiet.stderr

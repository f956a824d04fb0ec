"""The paddle entry point: call styles, lifecycle, errors and warnings, randomness, the installed methods.

Oracles: the unpatched model (exact equality), ppdiffusers' own ToMe port, and paddle's global RNG stream.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import paddle
import pytest
from ppdiffusers import DiffusionPipeline
from ppdiffusers.models.attention import BasicTransformerBlock

import tome_core.paddle as tome
from tome_tools.ppdiffusers_models import build_pipeline


def hook_count(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_post_hooks) for m in model.sublayers(include_self=True))


def block_classes(model) -> list:
    return [type(m) for m in model.sublayers(include_self=True)]


def test_keyword_only_call_equals_positional(unet, inputs, call, tiny_unet):
    tome.patch(unet, ratio=0.5)
    positional, keywords = call(unet, inputs), call(unet, inputs, keywords=True)
    assert np.abs(positional - call(tiny_unet, inputs)).max() > 1e-4
    np.testing.assert_array_equal(keywords, positional)


def test_patch_twice_equals_patch_once_with_newer_options(tiny_unet, inputs, call):
    twice = tome.patch(tome.patch(copy.deepcopy(tiny_unet), ratio=0.3, merge_mlp=True), ratio=0.6)
    once = tome.patch(copy.deepcopy(tiny_unet), ratio=0.6)
    np.testing.assert_array_equal(call(twice, inputs), call(once, inputs))
    assert hook_count(twice) == hook_count(once) > 0


def test_remove_restores_classes_hooks_state_dict_and_bit_identical_output(unet, inputs, call):
    plain = call(unet, inputs)
    classes, hooks = block_classes(unet), hook_count(unet)
    state = {k: v.numpy().copy() for k, v in unet.state_dict().items()}
    assert tome.remove(unet) is unet  # removing an unpatched model is a no-op
    tome.patch(unet, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    call(unet, inputs)
    patched = block_classes(unet)  # hooked layers: a same-named subclass per patch, as on torch (compilers see it)
    assert all(issubclass(p, c) and p.__qualname__ == c.__qualname__ for p, c in zip(patched, classes))
    assert patched != classes
    after = unet.state_dict()
    assert after.keys() == state.keys() and all(np.array_equal(after[k].numpy(), v) for k, v in state.items())
    assert tome.remove(unet) is unet
    assert hook_count(unet) == hooks and not any("_tome_patch" in m.__dict__ for m in unet.sublayers(True))
    assert block_classes(unet) == classes
    np.testing.assert_array_equal(call(unet, inputs), plain)


def test_ratio_zero_is_exactly_unpatched_and_says_it_merges_nothing(unet, inputs, call, tiny_unet):
    with pytest.warns(UserWarning, match="merges no tokens: ratio=0"):
        tome.patch(unet, ratio=0.0)
    np.testing.assert_array_equal(call(unet, inputs), call(tiny_unet, inputs))


def test_running_a_patched_model_leaves_the_global_rng_alone(unet, inputs, call):
    tome.patch(unet, ratio=0.5, use_rand=True)
    paddle.seed(123)
    first = call(unet, inputs)
    after_run = paddle.rand([8]).numpy()
    paddle.seed(123)
    np.testing.assert_array_equal(paddle.rand([8]).numpy(), after_run)  # the same stream: nothing drew from it
    np.testing.assert_array_equal(call(unet, inputs), first)


def test_seed_and_timestep_choose_the_partition(tiny_unet, inputs, call):
    sample, _, text = inputs
    model = tome.patch(copy.deepcopy(tiny_unet), ratio=0.5, seed=1)
    other_seed = tome.patch(copy.deepcopy(tiny_unet), ratio=0.5, seed=2)
    fixed = tome.patch(copy.deepcopy(tiny_unet), ratio=0.5, use_rand=False)
    a = call(model, inputs)
    assert np.abs(a - call(other_seed, inputs)).max() > 1e-5
    assert np.abs(a - call(model, (sample, paddle.to_tensor(499), text))).max() > 1e-5
    assert np.abs(a - call(fixed, inputs)).max() > 1e-5
    # The timestep may also be a Python int or a float tensor: the same step gives the same partition.
    np.testing.assert_array_equal(call(model, (sample, 500, text)), a)
    np.testing.assert_allclose(call(model, (sample, paddle.to_tensor(500.0), text)), a, rtol=1e-5, atol=1e-6)


def test_tomesd_drop_in_names_use_tomesd_defaults(tiny_unet, inputs, call):
    model = tome.apply_patch(copy.deepcopy(tiny_unet), use_rand=False)
    reference = tome.patch(copy.deepcopy(tiny_unet), ratio=0.5, max_downsample=1, use_rand=False, proportional_attn=False)
    np.testing.assert_array_equal(call(model, inputs), call(reference, inputs))
    tome.remove_patch(model)
    np.testing.assert_array_equal(call(model, inputs), call(tiny_unet, inputs))
    assert tome.apply_tome.__wrapped__ is tome.patch.__wrapped__ and tome.remove_tome is tome.remove


def test_deepcopy_of_a_patched_model_stays_patched_independently(unet, inputs, call, tiny_unet):
    tome.patch(unet, ratio=0.5)
    clone = copy.deepcopy(unet)
    patched = call(unet, inputs)
    np.testing.assert_array_equal(call(clone, inputs), patched)
    tome.remove(clone)  # paddle's own hook handles would remove the original's hooks here
    np.testing.assert_array_equal(call(unet, inputs), patched)
    np.testing.assert_array_equal(call(clone, inputs), call(tiny_unet, inputs))


def test_methods_on_every_layer_and_pipeline_are_ours(unet, inputs, call):
    reference = tome.patch(copy.deepcopy(unet), ratio=0.5, use_rand=False)
    assert unet.apply_tome(ratio=0.5, use_rand=False) is unet
    assert [type(m).__name__ for m, _ in tome.patched_models(unet)] == ["UNet2DConditionModel"]
    np.testing.assert_array_equal(call(unet, inputs), call(reference, inputs))
    assert not any(type(m).__name__.startswith("ToMe") for m in unet.sublayers())  # no class swapped
    assert unet.remove_tome() is unet and tome.patched_models(unet) == []
    for cls in (paddle.nn.Layer, DiffusionPipeline):
        assert cls.apply_tome.__module__ == cls.remove_tome.__module__ == "tome_core.paddle"
    assert tome.PPDIFFUSERS_APPLY_TOME.__module__ == "ppdiffusers.patches.tomesd_patch_utils"
    pipe = build_pipeline("sd")
    assert pipe.apply_tome(max_downsample=2) is pipe
    assert [type(m).__name__ for m, s in tome.patched_models(pipe)] == ["UNet2DConditionModel"]
    assert tome.patched_models(pipe)[0][1].config.max_downsample == 2
    pipe.remove_tome()
    assert tome.patched_models(pipe) == []


def test_remove_undoes_ppdiffusers_own_port(unet, inputs, call, tiny_unet):
    plain, classes, hooks = call(unet, inputs), block_classes(unet), hook_count(unet)
    tome.PPDIFFUSERS_APPLY_TOME(unet, ratio=0.5, use_rand=False)
    theirs = call(unet, inputs)
    assert np.abs(theirs - plain).max() > 1e-4 and block_classes(unet) != classes
    unet.remove_tome()
    assert block_classes(unet) == classes and hook_count(unet) == hooks
    assert not any("_tome_info" in m.__dict__ for m in unet.sublayers(True))
    np.testing.assert_array_equal(call(unet, inputs), plain)
    # Either implementation applied over the other replaces it (no double merging).
    tome.PPDIFFUSERS_APPLY_TOME(unet, ratio=0.5, use_rand=False)
    reference = dict(ratio=0.5, max_downsample=1, use_rand=False, proportional_attn=False)  # ppdiffusers' arithmetic
    tome.patch(unet, **reference)
    ours = call(unet, inputs)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ours, call(tome.patch(copy.deepcopy(tiny_unet), **reference), inputs))
    tome.PPDIFFUSERS_APPLY_TOME(unet, ratio=0.5, use_rand=False)
    assert tome.patched_models(unet) == []
    np.testing.assert_array_equal(call(unet, inputs), theirs)
    tome.remove(unet)
    np.testing.assert_array_equal(call(unet, inputs), plain)


def test_blocks_outside_a_2d_transformer_raise_a_clear_error():
    paddle.seed(0)
    wrapper = paddle.nn.Sequential(BasicTransformerBlock(32, 4, 8, cross_attention_dim=16))
    # Refused by patch itself, never by the first call.
    with pytest.raises(ValueError, match="BasicTransformerBlocks are outside a UNet.*nothing tells them their token grid"):
        tome.patch(wrapper, ratio=0.5)
    assert not tome.patched_models(wrapper) and hook_count(wrapper) == 0


@pytest.mark.parametrize(
    "obj, error, message",
    [
        ("a pipeline", TypeError, "ToMe patches a pipeline or a model; got str 'a pipeline'.*It takes a ppdiffusers DiffusionPipeline"),
        (paddle.nn.Linear(2, 2), ValueError, "nothing to patch: Linear contains no transformer block ToMe knows; pass a pipeline, or its UNet"),
    ],
)
def test_objects_that_cannot_be_patched_raise(obj, error, message):
    with pytest.raises(error, match=message):
        tome.patch(obj)


def test_bad_options_raise_through_every_entry_point(unet):
    with pytest.raises(ValueError, match="ratio=0.9 cannot be reached"):
        tome.patch(unet, ratio=0.9)
    with pytest.raises(TypeError, match="unknown ToMe option\\(s\\) rato"):
        unet.apply_tome(rato=0.5)
    with pytest.raises(ValueError, match="max_downsample must be one of"):
        tome.apply_patch(unet, max_downsample=3)
    with pytest.raises(TypeError, match="use_rand must be True or False, got 1"):
        build_pipeline("sd").apply_tome(use_rand=1)
    assert not any("_tome_patch" in m.__dict__ for m in unet.sublayers(True))


def test_merge_mlp_with_forward_chunking_is_refused(unet, inputs, call):
    """Refused by patch when the chunking is already set, by the first call when it is set after patch."""
    def chunk():
        for layer in unet.sublayers():
            if isinstance(layer, BasicTransformerBlock):
                layer.set_chunk_feed_forward(chunk_size=8, dim=1)  # divides every level's tokens

    tome.patch(unet, merge_mlp=True)
    chunk()
    with pytest.raises(ValueError, match="merge_mlp=True cannot be combined with feed-forward chunking"):
        call(unet, inputs)
    with pytest.raises(ValueError, match="merge_mlp=True cannot be combined with feed-forward chunking"):
        tome.patch(unet, merge_mlp=True)
    tome.patch(unet)  # merge_mlp off: chunking and merging coexist
    assert np.isfinite(call(unet, inputs)).all()


TOMESD_NAMES = {"ratio", "max_downsample", "sx", "sy", "use_rand", "merge_attn", "merge_crossattn", "merge_mlp"}


@pytest.fixture(scope="module")
def sd_pipe():
    return build_pipeline("sd")


def test_every_bad_option_raises_through_every_entry_point_and_keeps_the_earlier_patch(unet, sd_pipe, bad_option):
    options, error, message = bad_option
    tome.patch(unet, ratio=0.4)
    hooks = hook_count(unet)
    entries = [lambda: tome.patch(unet, **options), lambda: unet.apply_tome(**options),
               lambda: sd_pipe.apply_tome(**options)]
    if set(options) <= TOMESD_NAMES:
        entries.append(lambda: tome.apply_patch(unet, **options))
    for entry in entries:
        with pytest.raises(error, match=message):
            entry()
    assert hook_count(unet) == hooks and [s.config.ratio for _, s in tome.patched_models(unet)] == [0.4]
    assert tome.patched_models(sd_pipe) == []


def test_a_patch_that_merges_nothing_warns_and_equals_unpatched(unet, tiny_unet, inputs, call, nothing_merges):
    options, reason = nothing_merges
    with pytest.warns(UserWarning, match=f"ToMe patch on UNet2DConditionModel merges no tokens: {reason}"):
        tome.patch(unet, **options)
    np.testing.assert_array_equal(call(unet, inputs), call(tiny_unet, inputs))


def test_patches_that_merge_something_do_not_warn(unet, tiny_unet, inputs, call):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for options in ({}, {"max_downsample": 2, "level_ratios": {2: 0.0}}, {"ratio": 0.0, "max_downsample": 2, "level_ratios": {2: 0.5}}):
            tome.patch(unet, **options)
            assert np.abs(call(unet, inputs) - call(tiny_unet, inputs)).max() > 1e-6


def test_a_self_attention_given_an_attention_mask_runs_on_all_its_tokens_and_says_so(unet, tiny_unet, inputs):
    """Merging cannot follow a mask over the self-attention's tokens: that attention runs unmerged (the rest of
    its block still merges), said once; before, size-aware attention raised at once. A UNet's ``attention_mask``
    covers one level's tokens, so the unpatched model itself fails at the next level: the patched one must get
    exactly as far, with the finest level's self-attention seeing all 256 tokens."""
    sample, timestep, text = inputs
    mask = paddle.ones([2, 256])
    with pytest.raises(ValueError) as plain_error, paddle.no_grad():
        tiny_unet(sample, timestep, text, attention_mask=mask)
    tome.patch(unet, ratio=0.5, proportional_attn=True)
    seen = []
    handles = [
        m.register_forward_pre_hook(lambda layer, args: seen.append(args[0].shape[1]))
        for name, m in unet.named_sublayers() if name.endswith("attn1")
    ]
    with pytest.warns(UserWarning, match="given an attention_mask over its tokens"):
        with pytest.raises(ValueError) as patched_error, paddle.no_grad():
            unet(sample, timestep, text, attention_mask=mask)
    for handle in handles:
        handle.remove()
    assert seen[0] == 256  # the finest level's self-attention saw all its tokens
    assert str(patched_error.value) == str(plain_error.value)  # and failed where the unpatched model fails


def test_apply_tome_takes_the_ratio_positionally_and_names_itself_when_misused(unet):
    unet.apply_tome(0.3)  # ppdiffusers' users write the ratio positionally
    [(_, state)] = tome.patched_models(unet)
    assert (state.config.ratio, state.config.mode) == (0.3, "tokens")
    with pytest.raises(TypeError, match=r"apply_tome takes the ratio as its only positional argument, got 2"):
        unet.apply_tome(0.5, 2)
    tome.remove(unet)


def test_unconditional_unet2d_is_refused_on_paddle_with_its_reason():
    """UNet2DModel merges on torch (inside each Attention, at its projections) but not on paddle yet: ``patch``
    refuses it, and a pipeline holding it, by name and before any hook is attached, rather than merging it
    untested or failing inside it."""
    from ppdiffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    from tome_core.adapters.ppdiffusers import NOT_ON_PADDLE

    unet = UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
        norm_num_groups=8, attention_head_dim=8, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=10))
    for obj in (unet, pipe):
        with pytest.raises(ValueError, match="ToMe cannot patch UNet2DModel: not supported on paddle yet"):
            tome.patch(obj, ratio=0.5)
        assert not tome.patched_models(obj) and hook_count(unet) == 0
    with pytest.raises(ValueError, match=NOT_ON_PADDLE["UNet2DModel"][:40]):
        unet.apply_tome(0.5)


def test_kandinsky3_unet_is_refused_on_paddle_with_its_reason():
    """Kandinsky3UNet merges on torch (inside its attention blocks' attention) but not on paddle yet."""
    from ppdiffusers import Kandinsky3UNet

    unet = Kandinsky3UNet(
        in_channels=4, time_embedding_dim=8, groups=2, attention_head_dim=4, layers_per_block=2,
        block_out_channels=(16, 32), cross_attention_dim=8, encoder_hid_dim=12,
    )
    with pytest.raises(ValueError, match="ToMe cannot patch Kandinsky3UNet: not supported on paddle yet"):
        tome.patch(unet, ratio=0.5)
    assert hook_count(unet) == 0

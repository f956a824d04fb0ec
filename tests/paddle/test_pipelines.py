"""Real ppdiffusers pipelines built from tiny configs: patched output changes, removal restores it exactly.

Oracles: the unpatched pipeline's image (exact equality after removal), token counts seen inside the
attention layers, and the state dicts before patching.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import tome_core.paddle as tome
from tome_tools.ppdiffusers_models import PIPELINES, build_controlnet, build_pipeline


def call_kwargs(kind: str) -> dict:
    paddle.seed(7)
    image = paddle.rand([1, 3, 64, 64])
    kwargs = dict(prompt="a photo of a cat", num_inference_steps=2, guidance_scale=5.0, output_type="np")
    if kind == "img2img":
        kwargs.update(image=image, strength=0.9)
    else:
        kwargs.update(height=64, width=64)
    if kind == "inpaint":
        kwargs.update(image=image, mask_image=paddle.rand([1, 1, 64, 64]))
    if kind == "controlnet":
        kwargs.update(image=image)
    return kwargs


def run(pipe, kind: str, **overrides) -> np.ndarray:
    # ppdiffusers' paddle.Generator().manual_seed re-seeds the global generator it draws from: same noise every run.
    return pipe(**{**call_kwargs(kind), **overrides}, generator=paddle.Generator().manual_seed(0)).images


def build(kind: str):
    pipe = build_pipeline(kind)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def attn1_token_counts(model) -> list:
    """Token counts each attn1 receives (hooks registered after ToMe's run after them: they see merged inputs)."""
    seen = []
    for name, layer in model.named_sublayers():
        if name.endswith("attn1"):
            layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    return seen


def state_of(pipe) -> dict:
    return {
        (name, key): value.numpy().copy()
        for name, component in pipe.components.items()
        if isinstance(component, paddle.nn.Layer)
        for key, value in component.state_dict().items()
    }


@pytest.mark.parametrize("kind", PIPELINES)
def test_pipeline_patch_changes_output_and_remove_restores_it(kind):
    pipe = build(kind)
    state = state_of(pipe)
    plain = run(pipe, kind)
    assert pipe.apply_tome(ratio=0.5) is pipe
    patched = run(pipe, kind)
    again = run(pipe, kind)
    assert np.isfinite(patched).all()
    assert np.abs(patched - plain).max() > 1e-4
    np.testing.assert_array_equal(patched, again)  # same call, same generator: same image
    after = state_of(pipe)
    assert after.keys() == state.keys() and all(np.array_equal(after[k], v) for k, v in state.items())
    pipe.remove_tome()
    np.testing.assert_array_equal(run(pipe, kind), plain)
    assert not any("_tome_patch" in m.__dict__ for m in pipe.unet.sublayers(include_self=True))


def test_controlnet_blocks_are_merged():
    pipe = build("controlnet")
    tome.patch(pipe, ratio=0.5)
    unet_counts, controlnet_counts = attn1_token_counts(pipe.unet), attn1_token_counts(pipe.controlnet)
    run(pipe, "controlnet")
    # 64x64 images give 32x32 latents: the finest level (1024 tokens) runs on 512, deeper levels unmerged.
    assert set(controlnet_counts) == {512, 256, 64} and set(unet_counts) == {512, 256, 64}
    states = {type(model).__name__: state for model, state in tome.patched_models(pipe)}
    assert states["ControlNetModel"].ledger.stats[1].kept == 512 and states["ControlNetModel"].ledger.stats[1].tokens == 1024
    assert states["UNet2DConditionModel"].ledger.stats[1].blocks == 3  # one down, two up transformer blocks


def test_multi_controlnet_patches_every_net():
    pipe = build("controlnet")
    second = build_controlnet(pipe.unet, seed=7)
    multi = type(pipe)(**{**pipe.components, "controlnet": [pipe.controlnet, second]})
    multi.set_progress_bar_config(disable=True)
    tome.patch(multi, ratio=0.5)
    assert [type(m).__name__ for m, _ in tome.patched_models(multi)] == [
        "UNet2DConditionModel", "ControlNetModel", "ControlNetModel"
    ]  # fmt: skip
    counts = attn1_token_counts(second)
    kwargs = call_kwargs("controlnet")
    multi(**{**kwargs, "image": [kwargs["image"], kwargs["image"]]}, generator=paddle.Generator().manual_seed(0))
    assert set(counts) == {512, 256, 64}


def test_sdxl_merges_by_default_and_warns_when_max_downsample_excludes_it(sdxl_check):
    sdxl_check(tome, build("sdxl"), lambda pipe: run(pipe, "sdxl"), attn1_token_counts)


def test_keyword_only_unet_call_inside_a_pipeline_step():
    """The UNet called with keywords only (as some schedulers/pipelines do) reads the same latent and step."""
    pipe = build("sd")
    tome.patch(pipe, ratio=0.5)
    sample = paddle.randn([2, 4, 32, 32])
    text = paddle.randn([2, 77, 32])
    with paddle.no_grad():
        positional = pipe.unet(sample, paddle.to_tensor(981), text).sample.numpy()
        keywords = pipe.unet(sample=sample, timestep=paddle.to_tensor(981), encoder_hidden_states=text).sample
    np.testing.assert_array_equal(keywords.numpy(), positional)
    assert tome.patched_models(pipe)[0][1].ledger.stats[1].kept == 512

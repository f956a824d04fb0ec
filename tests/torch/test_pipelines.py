"""Real diffusers pipelines built from tiny configs: patched output changes, removal restores it exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tome_core.torch as tome
from tome_tools.diffusers_models import PIPELINES, build_controlnet, build_pipeline


def call_kwargs(kind: str) -> dict:
    generator = torch.Generator().manual_seed(0)
    image = torch.rand(1, 3, 64, 64, generator=generator)
    kwargs = dict(prompt="a photo of a cat", num_inference_steps=2, guidance_scale=5.0, output_type="np")
    if kind == "img2img":
        kwargs.update(image=image, strength=0.9)
    else:
        kwargs.update(height=64, width=64)
    if kind == "inpaint":
        kwargs.update(image=image, mask_image=torch.rand(1, 1, 64, 64, generator=generator))
    if kind == "controlnet":
        kwargs.update(image=image)
    return kwargs


def run(pipe, kind: str) -> np.ndarray:
    return pipe(**call_kwargs(kind), generator=torch.Generator().manual_seed(0)).images


def attn1_token_counts(model: torch.nn.Module) -> list:
    """Token counts each attn1 receives (hooks run after ToMe's, so they see merged inputs)."""
    seen = []
    for name, module in model.named_modules():
        if name.endswith("attn1"):
            module.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    return seen


@pytest.mark.parametrize("kind", PIPELINES)
def test_pipeline_patch_changes_output_and_remove_restores_it(kind):
    pipe = build_pipeline(kind)
    state = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    plain = run(pipe, kind)
    assert pipe.apply_tome(ratio=0.5) is pipe
    patched = run(pipe, kind)
    again = run(pipe, kind)
    assert np.isfinite(patched).all()
    assert np.abs(patched - plain).max() > 1e-4
    np.testing.assert_array_equal(patched, again)  # same call, same generator: same image
    assert all(torch.equal(state[k], v) for k, v in pipe.unet.state_dict().items())
    pipe.remove_tome()
    np.testing.assert_array_equal(run(pipe, kind), plain)
    assert not any(hasattr(m, "_tome_patch") for m in pipe.unet.modules())


def test_controlnet_blocks_are_merged():
    pipe = build_pipeline("controlnet")
    tome.patch(pipe, ratio=0.5)
    unet_counts, controlnet_counts = attn1_token_counts(pipe.unet), attn1_token_counts(pipe.controlnet)
    run(pipe, "controlnet")
    # 64x64 images give 32x32 latents: the finest level (1024 tokens) runs on 512, deeper levels unmerged.
    assert set(controlnet_counts) == {512, 256, 64} and set(unet_counts) == {512, 256, 64}
    states = {type(model).__name__: state for model, state in tome.patched_models(pipe)}
    assert states["ControlNetModel"].ledger.stats[1].kept == 512


def test_multi_controlnet_patches_every_net():
    pipe = build_pipeline("controlnet")
    second = build_controlnet(pipe.unet, seed=7)
    multi = type(pipe)(**{**pipe.components, "controlnet": [pipe.controlnet, second]})
    tome.patch(multi, ratio=0.5)
    assert {type(m).__name__ for m, _ in tome.patched_models(multi)} == {"UNet2DConditionModel", "ControlNetModel"}
    assert len(tome.patched_models(multi)) == 3
    counts = attn1_token_counts(second)
    kwargs = call_kwargs("controlnet")
    kwargs["image"] = [kwargs["image"], kwargs["image"]]
    multi(**kwargs, generator=torch.Generator().manual_seed(0))
    assert 512 in counts


def test_sdxl_merges_by_default_and_warns_when_max_downsample_excludes_it(sdxl_check):
    sdxl_check(tome, build_pipeline("sdxl"), lambda pipe: run(pipe, "sdxl"), attn1_token_counts)

"""Patched tiny Flax pipelines end to end, compiled (``jit=True``, pmap) and not, SD and ControlNet.

Oracles: the unpatched pipeline's images (the patched ones must differ, and must come back bit for bit after
``remove``), the non-jit patched images for the jit ones (the pmap path must have taken the patch, even when
the pipeline was compiled before patching), and token counts from the grid for what each model's
self-attention ran on. A 2-level UNet keeps compilation short; images are 64x64 (32x32 latents), 2 steps.
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.jax_utils import replicate
from flax.training.common_utils import shard

import tome_core.jax as tome
from tome_tools.flax_models import TWO_LEVELS, build_pipeline

STEPS = 2
SIZE = 64  # the Flax ControlNet pipeline wants multiples of 64; both share the VAE and text encoder shapes


class Runner:
    """Calls one pipeline the same way every time (same prompt, seed and control image)."""

    def __init__(self, kind):
        self.kind = kind
        self.size = SIZE
        self.pipe, self.params = build_pipeline(kind, seed=0, **TWO_LEVELS)
        prepare = self.pipe.prepare_inputs if kind == "sd" else self.pipe.prepare_text_inputs
        self.ids = prepare(["a tiny test"])
        self.rng = jax.random.PRNGKey(0)
        self.extra = {}
        if kind == "controlnet":
            image = np.random.default_rng(1).random((1, 3, self.size, self.size)).astype(np.float32)
            self.extra["image"] = jnp.asarray(image)
        else:
            self.extra.update(height=self.size, width=self.size)
        self.replicated = None

    def __call__(self, jit):
        if not jit:
            return np.asarray(
                self.pipe(prompt_ids=self.ids, params=self.params, prng_seed=self.rng, num_inference_steps=STEPS,
                          jit=False, **self.extra).images
            )
        if self.replicated is None:
            self.replicated = replicate(self.params)
        extra = {k: shard(v) if k == "image" else v for k, v in self.extra.items()}
        images = self.pipe(prompt_ids=shard(self.ids), params=self.replicated, prng_seed=self.rng[None],
                           num_inference_steps=STEPS, jit=True, **extra).images
        return np.asarray(images).reshape((-1,) + images.shape[2:])

    def generate(self):
        """The pipeline's whole generation as a function (to trace abstractly)."""
        if self.kind == "sd":
            return lambda: self.pipe._generate(
                self.ids, self.params, self.rng, STEPS, self.size, self.size, jnp.array([7.5])
            )
        return lambda: self.pipe._generate(
            self.ids, self.extra["image"], self.params, self.rng, STEPS, jnp.array([7.5]), None, None, jnp.array([1.0])
        )


@pytest.fixture(scope="module", params=["sd", "controlnet"])
def runner(request):
    return Runner(request.param)


def test_patch_takes_effect_after_compiling_and_remove_restores_exactly(runner, rel):
    pipe = runner.pipe
    unet, controlnet = pipe.unet, getattr(pipe, "controlnet", None)
    plain = runner(jit=True)  # compiled (pmap) before patching: the case that must not keep the plain UNet
    assert tome.patch(pipe, ratio=0.5, seed=2) is pipe
    assert [name for name, _ in tome.patched_models(pipe)] == (["unet"] if controlnet is None else ["unet", "controlnet"])
    patched_jit = runner(jit=True)
    patched_eager = runner(jit=False)
    assert np.isfinite(patched_jit).all() and patched_jit.shape == plain.shape == (1, runner.size, runner.size, 3)
    assert rel(patched_jit, plain) > 1e-3
    assert rel(patched_jit, patched_eager) < 1e-4  # the pmap path runs the patched UNet
    assert tome.remove(pipe) is pipe
    assert pipe.unet is unet and getattr(pipe, "controlnet", None) is controlnet and type(pipe).__module__.startswith("diffusers")
    np.testing.assert_array_equal(runner(jit=True), plain)


def test_every_model_of_the_pipeline_runs_attention_on_fewer_tokens(runner, attn1_tokens):
    pipe = runner.pipe
    tome.patch(pipe, ratio=0.5)
    try:
        seen = Counter((model, n) for model, _, n in attn1_tokens(runner.generate()))
    finally:
        tome.remove(pipe)
    plain = Counter((model, n) for model, _, n in attn1_tokens(runner.generate()))
    # Latents are half the image size (2x VAE). The UNet has 3 blocks at 1/1 (down 0, up 1 x2) and 1 in the
    # middle (1/2); a ControlNet has down 0 and the middle. Only 1/1 merges, by half.
    full, middle = (runner.size // 2) ** 2, (runner.size // 4) ** 2
    unet, controlnet = "FlaxUNet2DConditionModel", "FlaxControlNetModel"
    expected = Counter({(unet, full // 2): 3, (unet, middle): 1})
    expected_plain = Counter({(unet, full): 3, (unet, middle): 1})
    if runner.kind == "controlnet":
        expected.update({(controlnet, full // 2): 1, (controlnet, middle): 1})
        expected_plain.update({(controlnet, full): 1, (controlnet, middle): 1})
    assert seen == expected and plain == expected_plain


def test_a_pipeline_without_models_to_patch_is_refused(runner):
    import copy

    pipe = copy.copy(runner.pipe)
    pipe.unet = None
    if runner.kind == "controlnet":
        pipe.controlnet = None
    with pytest.raises(ValueError, match="nothing to patch: .* has no FlaxUNet2DConditionModel `unet`"):
        tome.patch(pipe)

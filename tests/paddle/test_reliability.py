"""Reliability of the paddle adapter (issue 6): odd shapes and batches (also property-based), saving and
loading, threads (models and pipelines), global RNG states.

Oracles: the unpatched model, the token counts the merge must produce on the grid each transformer really
sees, the files an unpatched model saves, each pipeline run alone, and the RNG states before the call.
(paddle has no float16/bfloat16 matmul on CPU, so the unpatched UNet itself cannot run in half precision
here; dtypes are covered on torch and jax. Option errors, patch twice, remove, deepcopy and the paddle RNG
stream: test_api.py.)
"""

from __future__ import annotations

import copy
import os
import random
import warnings

import numpy as np
import paddle
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ppdiffusers import UNet2DConditionModel
from ppdiffusers.models.attention import BasicTransformerBlock
from ppdiffusers.models.transformer_2d import Transformer2DModel

import tome_core.paddle as tome
from tome_tools.ppdiffusers_models import build_pipeline


def make_inputs(batch, h, w, seed=0, timestep=500):
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((batch, 4, h, w)).astype(np.float32))
    text = paddle.to_tensor(rng.standard_normal((batch, 7, 32)).astype(np.float32))
    return sample, paddle.to_tensor(timestep), text


def patched_copy(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nothing-merges warnings are tested elsewhere
        return tome.patch(copy.deepcopy(model), **options)


class Observer:
    """Records, for every self-attention call, the grid its transformer saw and the tokens reaching attn1.

    Registered after the patch, so its attn1 pre-hook runs after ToMe's and sees merged tokens.
    """

    def __init__(self, model):
        self.grid = None
        self.blocks = []
        for layer in model.sublayers():
            if isinstance(layer, Transformer2DModel):
                layer.register_forward_pre_hook(self._enter)
            if isinstance(layer, BasicTransformerBlock):
                layer.attn1.register_forward_pre_hook(self._attn1)

    def _enter(self, layer, inputs):
        self.grid = tuple(inputs[0].shape[-2:])

    def _attn1(self, layer, inputs):
        self.blocks.append((self.grid, inputs[0].shape[1]))


def expected_tokens(grid, ratio, sx=2, sy=2):
    h, w = grid
    return h * w if (h // sy) * (w // sx) == 0 else h * w - int(h * w * ratio)


def check_shape_case(tiny_unet, call, batch, h, w, seed=0, **options):
    """Patched at every level (max_downsample=8) against unpatched; returns the grids that merged."""
    inputs = make_inputs(batch, h, w, seed=seed)
    plain = call(tiny_unet, inputs)
    model = patched_copy(tiny_unet, max_downsample=8, **options)
    observer = Observer(model)
    out = call(model, inputs)
    assert out.shape == plain.shape and out.dtype == plain.dtype and np.isfinite(out).all()
    assert len(observer.blocks) == 7  # tiny UNet: 1 + 1 down, 1 mid, 2 + 2 up transformer blocks
    config = tome.patched_models(model)[0][1].config
    for grid, tokens in observer.blocks:
        assert tokens == expected_tokens(grid, config.ratio, config.sx, config.sy), (grid, tokens)
    merged = {grid for grid, tokens in observer.blocks if tokens < grid[0] * grid[1]}
    if merged:
        assert np.abs(out - plain).max() > 1e-6
    else:  # nothing merged anywhere: the hooks are exact no-ops
        np.testing.assert_array_equal(out, plain)
    return merged, inputs, plain


@pytest.mark.parametrize(
    "batch, h, w, merged_grids",
    [
        pytest.param(1, 16, 16, {(16, 16), (8, 8), (4, 4)}, id="batch1-square"),
        pytest.param(3, 16, 24, {(16, 24), (8, 12), (4, 6)}, id="odd-batch3-non-square"),
        pytest.param(1, 31, 33, {(31, 33), (16, 17), (8, 9)}, id="31x33-odd-at-every-level"),
        pytest.param(2, 40, 10, {(40, 10), (20, 5), (10, 3)}, id="cfg-batch2-aspect-4:1"),
        pytest.param(2, 2, 8, {(2, 8)}, id="2x8-h1-at-deep-levels"),
        pytest.param(2, 1, 3, set(), id="1x3-no-full-cell-anywhere"),
    ],
)
def test_shapes_match_unpatched_and_merge_every_level_that_has_a_cell(tiny_unet, call, batch, h, w, merged_grids):
    merged, inputs, plain = check_shape_case(tiny_unet, call, batch, h, w, ratio=0.5)
    assert merged == merged_grids
    np.testing.assert_array_equal(call(patched_copy(tiny_unet, ratio=0.0, max_downsample=8), inputs), plain)


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    batch=st.integers(1, 3),
    h=st.integers(1, 22),
    w=st.integers(1, 22),
    cells=st.sampled_from([(2, 2), (1, 2), (3, 2), (2, 3), (1, 1)]),
    fraction=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    use_rand=st.booleans(),
)
def test_any_small_latent_and_cell_size_give_the_unpatched_shape_and_exact_token_counts(
    tiny_unet, call, batch, h, w, cells, fraction, use_rand
):
    sx, sy = cells
    ratio = fraction * (1 - 1 / (sx * sy))  # up to the reachable maximum itself
    check_shape_case(tiny_unet, call, batch, h, w, seed=h * 100 + w, ratio=ratio, sx=sx, sy=sy, use_rand=use_rand)


def test_cfg_halves_share_one_partition_and_odd_batches_keep_randomness(tiny_unet, call):
    """The same latent twice in a batch merges identically in both rows, randomness on, at any batch size."""
    sample, timestep, text = make_inputs(1, 16, 16, seed=3)
    model = patched_copy(tiny_unet, ratio=0.5, use_rand=True)
    single = call(model, (sample, timestep, text))
    double = call(model, (paddle.concat([sample, sample]), timestep, paddle.concat([text, text])))
    np.testing.assert_allclose(double[0], double[1], rtol=0, atol=0)
    np.testing.assert_allclose(double[:1], single, rtol=1e-4, atol=1e-5)  # batch 1 vs 2: float rounding only
    fixed = call(patched_copy(tiny_unet, ratio=0.5, use_rand=False), (sample, timestep, text))
    assert np.abs(single - fixed).max() > 1e-6  # batch 1 still uses the random partition (tomesd turns it off)


def test_save_pretrained_writes_the_unpatched_files_and_loads_unpatched(unet, tiny_unet, inputs, call, tmp_path):
    unet.save_pretrained(str(tmp_path / "plain"))
    tome.patch(unet, ratio=0.5)
    patched_out = call(unet, inputs)
    unet.save_pretrained(str(tmp_path / "patched"))
    names = sorted(os.listdir(tmp_path / "plain"))
    assert names == sorted(os.listdir(tmp_path / "patched"))
    for name in names:
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "patched" / name).read_bytes(), name
    loaded = UNet2DConditionModel.from_pretrained(str(tmp_path / "patched"))
    loaded.eval()
    assert tome.patched_models(loaded) == []
    np.testing.assert_array_equal(call(loaded, inputs), call(tiny_unet, inputs))
    np.testing.assert_array_equal(call(unet, inputs), patched_out)  # saving left the patch in place


def test_two_models_patched_differently_run_from_two_threads(tiny_unet, inputs, call, run_in_two_threads):
    options = [dict(ratio=0.5), dict(ratio=0.3, merge_mlp=True, seed=4)]
    models = [patched_copy(tiny_unet, **o) for o in options]
    expected = [call(m, inputs) for m in models]
    results = run_in_two_threads([lambda m=m: [call(m, inputs) for _ in range(3)] for m in models])
    for index in range(2):
        for out in results[index]:
            np.testing.assert_array_equal(out, expected[index])
    assert np.abs(expected[0] - expected[1]).max() > 1e-6


def test_two_pipelines_patched_differently_run_from_two_threads(run_in_two_threads):
    """Each pipeline run alone is the oracle. Latents are passed in and DDIM (eta 0) draws no noise, so
    nothing in the runs depends on paddle's global generator, which two threads would share."""
    pipes = [build_pipeline("sd", seed=0), build_pipeline("sd", seed=0)]
    tome.patch(pipes[0], ratio=0.5)
    tome.patch(pipes[1], ratio=0.3, max_downsample=2, merge_mlp=True, seed=4)
    latents = paddle.to_tensor(np.random.default_rng(2).standard_normal((1, 4, 16, 16)).astype(np.float32))
    kwargs = dict(prompt="a photo of a cat", num_inference_steps=2, guidance_scale=5.0, output_type="np",
                  height=32, width=32, latents=latents)
    for pipe in pipes:
        pipe.set_progress_bar_config(disable=True)
    expected = [pipe(**kwargs).images for pipe in pipes]
    assert np.abs(expected[0] - expected[1]).max() > 1e-4
    results = run_in_two_threads([lambda p=p: [p(**kwargs).images for _ in range(2)] for p in pipes])
    for index in range(2):
        for images in results[index]:
            np.testing.assert_array_equal(images, expected[index])
    assert [s.config.ratio for _, s in tome.patched_models(pipes[1])] == [0.3]


def test_a_patched_model_leaves_numpy_python_and_paddle_rng_states_alone(tiny_unet, inputs, call):
    model = patched_copy(tiny_unet, ratio=0.5, use_rand=True, max_downsample=8, merge_crossattn=True, merge_mlp=True)
    np.random.seed(5)
    random.seed(5)
    paddle.seed(5)
    numpy_state, python_state = np.random.get_state(), random.getstate()
    first = call(model, inputs)
    after = np.random.get_state()
    assert after[0] == numpy_state[0] and np.array_equal(after[1], numpy_state[1]) and after[2:] == numpy_state[2:]
    assert random.getstate() == python_state
    drawn = paddle.rand([8]).numpy()
    paddle.seed(5)
    np.testing.assert_array_equal(paddle.rand([8]).numpy(), drawn)  # paddle's stream: nothing drew from it
    np.testing.assert_array_equal(call(model, inputs), first)  # and the same seed gives the same output
    assert np.abs(first - call(tiny_unet, inputs)).max() > 1e-4

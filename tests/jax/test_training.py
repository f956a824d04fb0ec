"""Training through a patched Flax UNet (issue #19, jax part): ``jax.grad`` of a denoising loss under ``jax.jit``.

Oracles:

* Central finite differences in float64 (``jax.enable_x64``), for every arrangement (``tokens``, ``kv``,
  ``queries`` at ratio 0.5; ``kv`` with cell pooling), ``use_rand=False``, size-aware attention on: the
  gradient with respect to the sample and to five weights, on a few coordinates each and along one random
  direction through every parameter and the sample at once.
* The unpatched model: a ratio-0 patch gives its loss and gradients bit for bit; ratio 0.5 gives other
  gradients.

One small model (one level: a down block, the middle and an up block, four transformer blocks, all at full
resolution) is built once; each patched variant compiles once (the finite differences reuse the compiled
loss-and-gradient function on shifted inputs).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tome_core.jax as tome
from tome_tools.flax_models import build_unet

# "tiny" cut to one level: attention in the down block, the middle and the up block, all at 1/1.
ONE_LEVEL = dict(
    block_out_channels=(32,), down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",)
)
ARRANGEMENTS = {
    "tokens": dict(mode="tokens", ratio=0.5),
    "kv": dict(mode="kv", ratio=0.5),
    "queries": dict(mode="queries", ratio=0.5),
    "kv-cell": dict(mode="kv", matching="cell"),
    "kv-cell-sample": dict(mode="kv", matching="cell", cell_pool="sample"),  # use_rand=False: each cell's first token
}
BLOCK = ("down_blocks_0", "attentions_0", "transformer_blocks_0")
CHECKED_WEIGHTS = (
    ("conv_in", "kernel"),  # feeds every block input, i.e. the match's metric
    BLOCK + ("norm1", "scale"),
    BLOCK + ("attn1", "to_q", "kernel"),  # queries: merged in tokens/queries
    BLOCK + ("attn1", "to_k", "kernel"),  # keys: merged (size-aware) in tokens/kv
    ("mid_block", "attentions_0", "transformer_blocks_0", "attn1", "to_v", "kernel"),
)
EPS = 1e-6
SAMPLE = ("sample",)  # the sample's key beside the parameter paths in a shift


@pytest.fixture(autouse=True)
def x64():
    """Every test runs with jax's 64-bit types on (and leaves them off for the other test modules)."""
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="module")
def setup():
    """``(UNet computing in float64, params, inputs)``; params and inputs as float64 numpy arrays, which keep
    their dtype outside the x64 context."""
    with jax.enable_x64(True):
        unet, params = build_unet("tiny", seed=0, dtype=jnp.float64, **ONE_LEVEL)
    params = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    rng = np.random.default_rng(1)
    inputs = dict(
        sample=rng.standard_normal((2, 4, 8, 8)),
        context=rng.standard_normal((2, 7, 32)),
        target=rng.standard_normal((2, 4, 8, 8)),
        timesteps=np.array([500, 500], np.int32),
    )
    return unet, params, inputs


def loss(model, params, sample, context, target, timesteps):
    prediction = model.apply({"params": params}, sample, timesteps, context).sample
    return jnp.mean((prediction - target) ** 2)


@partial(jax.jit, static_argnums=0)
def loss_and_grads(model, params, sample, context, target, timesteps):
    """``(loss, (d loss / d params, d loss / d sample))`` under ``jax.jit`` (one compilation per model)."""
    return jax.value_and_grad(loss, argnums=(1, 2))(model, params, sample, context, target, timesteps)


def run(model, params, inputs) -> Tuple[float, Any, np.ndarray]:
    """Loss, parameter gradients and sample gradient of one step, as float64 numpy."""
    assert jax.config.jax_enable_x64
    value, (grad_params, grad_sample) = loss_and_grads(
        model, params, inputs["sample"], inputs["context"], inputs["target"], inputs["timesteps"]
    )
    assert value.dtype == jnp.float64 and grad_sample.dtype == jnp.float64
    return float(value), jax.tree_util.tree_map(np.asarray, grad_params), np.asarray(grad_sample)


def leaf(tree: Any, path: Tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def shifted(tree: Any, path: Tuple[str, ...], delta: np.ndarray) -> Any:
    """A copy of the nested dict ``tree`` with ``delta`` added to the leaf at ``path``."""
    if not path:
        return tree + delta
    return {**tree, path[0]: shifted(tree[path[0]], path[1:], delta)}


def relative_error(a: Any, b: Any) -> float:
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])
    return float(np.linalg.norm(flat(a) - flat(b)) / np.linalg.norm(flat(b)))


@pytest.fixture(scope="module")
def unpatched(setup):
    """Loss and gradients of the unpatched model (compiled once for the module)."""
    unet, params, inputs = setup
    with jax.enable_x64(True):
        return run(unet, params, inputs)


def merged_summary(calls) -> str:
    (name, state), = calls  # one patched call traced
    summary = state.summary()
    assert "4 blocks" in summary and "merged;" in summary, summary
    return summary


@pytest.mark.parametrize("arrangement", list(ARRANGEMENTS))
def test_gradients_equal_central_differences_in_each_arrangement(setup, unpatched, arrangement, central_differences):
    """``jax.jit(jax.value_and_grad(...))`` of the patched UNet's mean squared error: the gradient w.r.t. the
    sample and five weights equals central differences (float64, eps 1e-6) on three coordinates of each (the
    largest gradient and two random ones), and along one random direction through every parameter and the
    sample; the loss and gradients differ from the unpatched model's."""
    unet, params, inputs = setup
    model = tome.patch(unet, use_rand=False, **ARRANGEMENTS[arrangement])
    assert model.tome.proportional_attn
    with tome.record() as calls:
        value, grad_params, grad_sample = run(model, params, inputs)
    merged_summary(calls)
    loss_unpatched, params_unpatched, sample_unpatched = unpatched
    assert abs(value - loss_unpatched) > 1e-6
    assert relative_error(grad_sample, sample_unpatched) > 1e-3
    assert relative_error(grad_params, params_unpatched) > 1e-3

    def loss_at(params_shift: Dict[Tuple[str, ...], np.ndarray], sample_shift: Any = 0.0) -> float:
        shifted_params = params
        for path, delta in params_shift.items():
            shifted_params = shifted(shifted_params, path, delta)
        return run(model, shifted_params, {**inputs, "sample": inputs["sample"] + sample_shift})[0]

    def central(shift: Dict[Tuple[str, ...], np.ndarray]) -> float:
        """The central difference along ``shift``: parameter paths, and the sample under ``SAMPLE``."""
        params_shift = {path: delta for path, delta in shift.items() if path != SAMPLE}
        sample_shift = shift.get(SAMPLE, 0.0)
        scale = lambda s: {path: delta * s for path, delta in params_shift.items()}
        plus = loss_at(scale(EPS), sample_shift * EPS)
        minus = loss_at(scale(-EPS), sample_shift * -EPS)
        return (plus - minus) / (2 * EPS)

    rng = np.random.default_rng(2)
    checked = {SAMPLE: grad_sample, **{path: leaf(grad_params, path) for path in CHECKED_WEIGHTS}}
    paths = [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    every = {**{path: leaf(grad_params, path) for path in paths}, SAMPLE: grad_sample}
    central_differences(checked, central, rng, atol=1e-10, directions=every)


def test_ratio_zero_gives_the_unpatched_gradients_exactly(setup, unpatched):
    """A ratio-0 patch under ``jax.jit``: the unpatched loss and every gradient bit for bit (XLA drops the
    match's unused ops: the same computation)."""
    unet, params, inputs = setup
    with pytest.warns(UserWarning, match="merges no tokens"):
        model = tome.patch(unet, ratio=0.0)
    value, grad_params, grad_sample = run(model, params, inputs)
    loss_unpatched, params_unpatched, sample_unpatched = unpatched
    assert value == loss_unpatched
    np.testing.assert_array_equal(grad_sample, sample_unpatched)
    assert jax.tree_util.tree_structure(grad_params) == jax.tree_util.tree_structure(params_unpatched)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree_util.tree_leaves(grad_params), jax.tree_util.tree_leaves(params_unpatched))
    )

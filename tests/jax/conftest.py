"""Fixtures of the jax / Flax tests: tiny Flax models with random weights (nothing downloaded), their inputs,
one jitted ``apply`` shared by every test (jax caches its compilation per model, so equal patched modules
compile once), and a spy recording how many tokens reach each self-attention."""

from __future__ import annotations

from functools import partial
from typing import Any, List, Tuple

import diffusers
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

# diffusers 0.39 logs a deprecation warning from every Flax module setup, transformers one per Flax model.
diffusers.utils.logging.set_verbosity_error()
transformers.utils.logging.set_verbosity_error()

from tome_tools.flax_models import TWO_LEVELS, build_controlnet, build_unet  # noqa: E402


@partial(jax.jit, static_argnums=0)
def _apply(model, params, sample, timesteps, context, added=None):
    """``model``'s output under ``jax.jit`` (one compilation per distinct model and input shapes)."""
    return model.apply({"params": params}, sample, timesteps, context, added).sample


@pytest.fixture(scope="session")
def tiny():
    """``(FlaxUNet2DConditionModel, params)`` of the "tiny" SD-shaped preset."""
    return build_unet("tiny", seed=0)


@pytest.fixture(scope="session")
def small():
    """``(FlaxUNet2DConditionModel, params)`` of "tiny" cut to two levels: for tests that compile it."""
    return build_unet("tiny", seed=0, **TWO_LEVELS)


@pytest.fixture(scope="session")
def small_controlnet(small):
    """A FlaxControlNetModel for ``small`` (every weight random, including the zero-initialised outputs)."""
    return build_controlnet(small[0], seed=3)


@pytest.fixture(scope="session")
def inputs():
    """A CFG-sized batch at 16x16 latents: ``(sample, timesteps, context)``."""
    rng = np.random.default_rng(3)
    sample = jnp.asarray(rng.standard_normal((2, 4, 16, 16)), jnp.float32)
    context = jnp.asarray(rng.standard_normal((2, 7, 32)), jnp.float32)
    return sample, jnp.array([500, 500], jnp.int32), context


def _attn1_tokens(fn, *args, **kwargs) -> List[Tuple[str, Tuple[str, ...], int]]:
    """Trace ``fn(*args, **kwargs)`` abstractly (``jax.eval_shape``: no compilation, no compute) and return,
    for each self-attention run, ``(model class, path of its transformer block, query tokens it saw)``.

    The spy sits on attn1's query projection (``to_q``), inside attn1, so it sees what attn1 really ran on.
    """
    seen: List[Tuple[str, Tuple[str, ...], int]] = []

    def spy(next_fun, call_args, call_kwargs, context):
        module = context.module
        if context.method_name == "__call__" and module.name == "to_q" and module.parent.name == "attn1":
            root = module
            while isinstance(root.parent, nn.Module):
                root = root.parent
            seen.append((type(root).__name__, tuple(module.path[:-2]), int(call_args[0].shape[1])))
        return next_fun(*call_args, **call_kwargs)

    with nn.intercept_methods(spy):
        jax.eval_shape(lambda: fn(*args, **kwargs))
    return seen


def _rel(a: Any, b: Any) -> float:
    """Relative L2 distance of ``a`` from ``b``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# Helpers as fixtures (tests are imported with --import-mode=importlib, so conftest is not importable).
@pytest.fixture(scope="session")
def apply():
    return _apply


@pytest.fixture(scope="session")
def attn1_tokens():
    return _attn1_tokens


@pytest.fixture(scope="session")
def rel():
    return _rel

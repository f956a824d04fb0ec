"""Fixtures of the paddle / ppdiffusers tests: a tiny UNet with random weights and inputs for it."""

from __future__ import annotations

import copy

import numpy as np
import paddle
import pytest

import tome_core.paddle  # noqa: F401  (installs our apply_tome/remove_tome methods, as users do)
from tome_core.adapters.ppdiffusers_models import build_unet


@pytest.fixture(scope="session")
def tiny_unet():
    """The pristine tiny UNet: tests patch deep copies of it."""
    return build_unet("tiny", seed=0)


@pytest.fixture
def unet(tiny_unet):
    return copy.deepcopy(tiny_unet)


@pytest.fixture(scope="session")
def inputs():
    rng = np.random.default_rng(3)
    sample = paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype(np.float32))
    text = paddle.to_tensor(rng.standard_normal((2, 7, 32)).astype(np.float32))
    return sample, paddle.to_tensor(500), text


def _call(model, inputs, keywords=False) -> np.ndarray:
    sample, timestep, text = inputs
    with paddle.no_grad():
        if keywords:
            return model(sample=sample, timestep=timestep, encoder_hidden_states=text).sample.numpy()
        return model(sample, timestep, text).sample.numpy()


@pytest.fixture(scope="session")
def call():
    """``call(model, inputs, keywords=False)``: the UNet's output as numpy, called positionally or by keyword."""
    return _call

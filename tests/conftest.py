"""Shared test fixtures. TOME_TEST_BACKENDS (comma-separated) names the array backends the core tests run on;
a named backend that cannot be loaded is a failure, not a skip."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tome_core import load_backend

BACKENDS = [b for b in os.environ.get("TOME_TEST_BACKENDS", "numpy").split(",") if b]


class Converter:
    """Moves numpy arrays into one backend's arrays and back."""

    def __init__(self, name: str):
        self.name = name
        self.ops = load_backend(name)

    def asarray(self, a: np.ndarray):
        if self.name == "numpy":
            return a
        if self.name == "torch":
            import torch

            return torch.from_numpy(np.ascontiguousarray(a))
        if self.name == "paddle":
            import paddle

            return paddle.to_tensor(a)
        if self.name == "jax":
            import jax.numpy as jnp

            return jnp.asarray(a)
        raise AssertionError(self.name)

    def numpy(self, x) -> np.ndarray:
        return np.asarray(x) if self.name != "torch" else x.detach().cpu().numpy()


@pytest.fixture(params=BACKENDS, scope="session")
def xp(request) -> Converter:
    return Converter(request.param)

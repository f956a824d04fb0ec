"""Fixtures shared by the torch tests: a tiny SD UNet with random weights and a CFG-sized batch of inputs
(a file may define its own of the same name instead)."""

from __future__ import annotations

import pytest
import torch

from tome_core.adapters.diffusers_models import build_unet


@pytest.fixture(scope="module")
def unet():
    return build_unet("tiny", seed=0)


@pytest.fixture(scope="module")
def inputs():
    """``(sample [2, 4, 16, 16], timestep 700, text [2, 7, 32])``."""
    generator = torch.Generator().manual_seed(5)
    return torch.randn(2, 4, 16, 16, generator=generator), torch.tensor(700), torch.randn(2, 7, 32, generator=generator)

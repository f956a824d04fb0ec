"""Fixtures shared by the torch tests: a tiny SD UNet with random weights, a CFG-sized batch of inputs (a file
may define its own of the same name instead), and what a bench method's sub-layers are given."""

from __future__ import annotations

import pytest
import torch

from tome_tools.diffusers_models import build_unet


@pytest.fixture(scope="module")
def unet():
    return build_unet("tiny", seed=0)


@pytest.fixture(scope="module")
def inputs():
    """``(sample [2, 4, 16, 16], timestep 700, text [2, 7, 32])``."""
    generator = torch.Generator().manual_seed(5)
    return torch.randn(2, 4, 16, 16, generator=generator), torch.tensor(700), torch.randn(2, 7, 32, generator=generator)


@pytest.fixture
def sublayer_calls():
    """``calls(runner, method, options, modules, record)``: one call of the bench ``runner``'s ``method`` (ratio
    0.5) with ``options``, recording ``record(name, args, kwargs)`` for every call of the modules that
    ``modules()`` lists as ``(name, module)`` once the method is on. The hooks are added after the method's own,
    so they see what each sub-layer really gets."""

    def calls(runner, method, options, modules, record):
        runner.options = dict(options or {})
        seen = []
        try:
            with runner.method(method, 0.5):
                handles = [
                    module.register_forward_pre_hook(lambda m, a, k, name=name: seen.append(record(name, a, k)), with_kwargs=True)
                    for name, module in modules()
                ]
                runner.call()
            for handle in handles:
                handle.remove()
        finally:
            runner.options = {}
        return seen

    return calls

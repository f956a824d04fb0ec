"""Between calls a patched model holds only the index tables that depend on shapes and the seed alone
(``tome_core.algorithm.partition.cached``: built by the first call, read by every later one, so that a call launches only the
kernels of its own arithmetic), and ``remove`` lets them go: whatever else a call's merging builds (its choice of
partitions, matches) is let go as it returns. Oracle: the unpatched model's own retained bytes, counted exactly
from the profiler's allocation events (``tome_tools.diffusers_bench.tensor_peak_mib``), in a call that drops its
output; and the bytes of the kept tables themselves."""

from __future__ import annotations

import pytest
import torch

import tome_core.torch as tome
from tome_core.algorithm import partition
from tome_tools.diffusers_bench import tensor_peak_mib
from tome_tools.diffusers_models import build_unet, build_video_transformer


def _unet():
    model = build_unet("tiny")
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 4, 32, 32, generator=generator), torch.tensor([500]), torch.randn(1, 7, 32, generator=generator))
    return model, lambda: model(*inputs)


def _wan():
    model = build_video_transformer("tiny-wan")
    generator = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 3, 8, 12, generator=generator), timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 5, 16, generator=generator),
    )
    return model, lambda: model(**inputs)


BUILT = {"unet": _unet, "wan": _wan}


def _retained_mib(run) -> list:
    """What each of two calls leaves allocated once its output is dropped."""

    def once():
        with torch.no_grad():
            run()

    return [tensor_peak_mib(once)[1] for _ in range(2)]


@pytest.mark.parametrize("options", [
    dict(min_tokens=0),  # the default's arrangement: kv in cells drawn per call on the UNet, ToMe for SD on Wan
    dict(ratio=0.5),  # a similarity match, its partition drawn per call
    dict(ratio=0.5, use_rand=False),  # fixed partitions: shape-only tables
    dict(mode="kv", matching="cell", sx=2, sy=2, cell_pool="mean"),  # a shape-only match
], ids=["default", "ratio", "fixed", "cells"])
@pytest.mark.parametrize("kind", sorted(BUILT))
def test_a_patched_model_keeps_only_its_tables_between_calls(kind, options):
    model, run = BUILT[kind]()
    unpatched = _retained_mib(run)
    tome.patch(model, **options)
    patched = _retained_mib(run)
    (_, state), = tome.patched_models(model)
    assert state.ledger.stats and all(stats.kept < stats.tokens for stats in state.ledger.stats.values()), state.summary()
    tables = sum(_bytes(value) for value in partition._CACHE.values()) / 2**20
    assert tables > 0
    # the first call builds the tables and keeps them; the second builds and keeps nothing more
    assert patched[0] - unpatched[0] == pytest.approx(tables, abs=1e-6) and patched[1] == unpatched[1]
    # ~600 bytes a token of the merged grid at most (31 drawn partitions, two int64 rows each: 496)
    tokens = max(stats.tokens for stats in state.ledger.stats.values())
    assert tables * 2**20 <= 600 * tokens, (tables, tokens)
    tome.remove(model)
    assert not partition._CACHE and _retained_mib(run) == unpatched


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_bytes(item) for item in value)
    fields = getattr(value, "__dataclass_fields__", None)  # a kept match
    return sum(_bytes(getattr(value, name)) for name in fields) if fields else 0

"""Issue 43, "what is reported": ``summary()`` says what attention saw."""

from __future__ import annotations

import copy
import re
from contextlib import nullcontext
from typing import Any, Dict, List

import pytest
import torch
from torch.overrides import TorchFunctionMode

import tome_core.torch as tome
from tome_tools.diffusers_models import build_transformer, transformer_inputs


class _KeysSeen(TorchFunctionMode):
    """Records each SDPA call's ``(queries, keys)`` counts."""

    def __init__(self):
        super().__init__()
        self.calls: List[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs["key"]
            self.calls.append((query.shape[-2], key.shape[-2]))
        return func(*args, **kwargs)


def _self_attention_keys(model: torch.nn.Module, inputs: Dict[str, Any], text: int) -> List[int]:
    """The key counts of the self-attentions of one call (a cross-attention's keys are the ``text`` tokens)."""
    with torch.no_grad(), _KeysSeen() as seen:
        model(**inputs)
    return sorted(keys for _, keys in seen.calls if keys != text)


def _summary_keys(state: Any) -> List[int]:
    """The self-attention key counts that ``state.summary()`` reports: ``blocks`` calls at the kept count of each
    merged level (kv: its keys), and those of the blocks it says ran on all their tokens."""
    found = []
    for line in state.summary().splitlines():
        merged = re.search(r"(\d+) blocks, (\d+) -> (\d+)", line)
        passed = re.search(r"(\d+) blocks ran \S+ on all (\d+) tokens", line)
        if merged:
            found += [int(merged[3])] * int(merged[1])
        elif passed:
            found += [int(passed[2])] * int(passed[1])
    return sorted(found)


@pytest.mark.parametrize("masked", [False, True])
def test_summary_counts_the_keys_attention_saw_with_an_attention_mask(masked):
    """PixArt (a ``Transformer2DModel``) given a 2-D ``attention_mask`` runs its self-attentions on all their
    tokens (issue 43: its summary said "64 -> 16 keys/values" all the same)."""
    model = build_transformer("tiny-pixart")
    inputs = transformer_inputs(model, 16, 16, batch=2)  # an 8x8 token grid
    if masked:
        inputs["attention_mask"] = torch.ones(2, 64)
    with torch.no_grad():
        plain = model(**inputs).sample
    tome.patch(model)
    with pytest.warns(UserWarning, match="attention_mask") if masked else nullcontext():
        keys = _self_attention_keys(model, inputs, text=7)
    [(_, state)] = tome.patched_models(model)
    assert keys == _summary_keys(state), state.summary()
    if masked:
        assert keys == [64, 64]
        with torch.no_grad():
            assert torch.equal(model(**inputs).sample, plain)
        assert "merged" not in state.summary() and "attention_mask" in state.summary()
    else:
        assert max(keys) < 64



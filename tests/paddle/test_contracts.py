"""The promises under the default and every option (issue 35) on paddle, through the driver torch shares: a
hypothesis property over the options and ppdiffusers' processors, as tests/torch/test_contracts.py states it.
Every drawn option set is refused naming an argument before anything is patched, or runs, merges (a
sub-layer sees fewer tokens or keys) or has warned, gives the same output in a second generation, and
``remove`` restores the unpatched output exactly."""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np
import paddle
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ppdiffusers.models import attention_processor

import tome_core.paddle as tome

STEPS = (900, 300)
SUBLAYERS = ("attn1", "attn2", "ff")
PROCESSORS = {
    "default": lambda m: None,
    "classic": lambda m: m.set_attn_processor(attention_processor.AttnProcessor()),
    "sliced": lambda m: m.set_attn_processor(attention_processor.SlicedAttnProcessor(1)),
    "custom-diffusion": lambda m: [
        layer.set_processor(attention_processor.CustomDiffusionAttnProcessor(train_kv=False, train_q_out=False))
        for path, layer in m.named_sublayers() if path.endswith("attn1")
    ],
}
OPTIONS = st.fixed_dictionaries({}, optional={
    "mode": st.sampled_from(["auto", "tokens", "kv", "queries"]),
    "ratio": st.sampled_from([0.0, 0.5, 0.9, "0.5"]),
    "matching": st.sampled_from(["similarity", "cell"]),
    "cell_pool": st.sampled_from(["mean", "sample"]),
    "max_downsample": st.sampled_from([None, 1, 2]),
    "use_rand": st.booleans(),
    "merge_mlp": st.booleans(),
    "proportional_attn": st.booleans(),
    "seed": st.sampled_from([0, 32749]),
    "blocks": st.sampled_from([[0], [1], [0, -7]]),
    "block_ratios": st.sampled_from([{0: 0.0}, {0: 0.7}, {1: 0.5}]),
    "level_ratios": st.sampled_from([{1: 0.0}, {2: 0.5}]),
    "reuse_steps": st.sampled_from([1, 2]),
    "timestep_range": st.sampled_from([(400, 1000), (2000, 3000)]),
})


def record(model) -> Tuple[List[Tuple], List[Any]]:
    """(sub-layer, tokens in, keys) of every call, from hooks after ToMe's."""
    seen: List[Tuple] = []
    handles = []
    for path, layer in model.named_sublayers():
        child = path.rsplit(".", 1)[-1]
        if child in SUBLAYERS and "transformer_blocks" in path:
            def count(layer, args, kwargs, child=child):
                hidden = args[0] if args else kwargs["hidden_states"]
                keys = kwargs.get("encoder_hidden_states") if child == "attn1" else None
                seen.append((child, hidden.shape[1], (hidden if keys is None else keys).shape[1]))
            handles.append(layer.register_forward_pre_hook(count, with_kwargs=True))
    return seen, handles


def generation(model, inputs) -> List[np.ndarray]:
    sample, _, text = inputs
    with paddle.no_grad():
        return [model(sample, paddle.to_tensor(t), text).sample.numpy() for t in STEPS]


class Unpatched(dict):
    def __repr__(self) -> str:
        return f"Unpatched({', '.join(self)})"


@pytest.fixture(scope="module")
def models(tiny_unet, inputs):
    import copy

    built = Unpatched()
    for name, set_up in PROCESSORS.items():
        model = copy.deepcopy(tiny_unet)
        set_up(model)
        seen, handles = record(model)
        outputs = generation(model, inputs)
        for handle in handles:
            handle.remove()
        built[name] = (model, outputs, seen)
    return built


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(processor=st.sampled_from(sorted(PROCESSORS)), options=OPTIONS)
def test_every_option_set_is_refused_naming_an_argument_or_runs_merges_repeats_and_removes(models, inputs, patch_or_refuse, processor, options):
    model, reference, plain = models[processor]
    caught = patch_or_refuse(tome, model, options)
    if caught is None:
        return
    try:
        seen, handles = record(model)
        first = generation(model, inputs)
        for handle in handles:
            handle.remove()
        second = generation(model, inputs)
    finally:
        tome.remove(model)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(out).all() for out in first)
    warned = [message for message in caught if "merges no tokens" in message]
    assert len(seen) == len(plain)
    fewer = [(now, before) for now, before in zip(seen, plain) if now != before]
    assert warned or fewer, (options, seen)
    for a, b in zip(generation(model, inputs), reference):
        np.testing.assert_array_equal(a, b)

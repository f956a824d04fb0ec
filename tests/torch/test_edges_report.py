"""Issue 43, "what is reported": ``summary()`` says what attention saw, ``prefer`` is monotone, a bad ``prefer``
names itself, and ``reuse_steps`` starts afresh with every pipeline call."""

from __future__ import annotations

import re
from contextlib import nullcontext
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

import tome_core.torch as tome
from tome_tools.diffusers_models import build_transformer, transformer_inputs
from tome_tools.diffusers_bench import SdpaCalls


def _self_attention_keys(model: torch.nn.Module, inputs: Dict[str, Any], text: int) -> List[int]:
    """The key counts of the self-attentions of one call (a cross-attention's keys are the ``text`` tokens)."""
    with torch.no_grad(), SdpaCalls() as seen:
        model(**inputs)
    return sorted(keys for _, keys in seen.lengths if keys != text)


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



# ------------------------------------------------------------------------ reuse_steps: a pipeline call starts afresh


def _pipeline(**options: Any):
    from tome_tools.diffusers_models import build_pipeline

    pipe = build_pipeline("sd")
    pipe.set_progress_bar_config(disable=True)
    return tome.patch(pipe, **options)


def _image(pipe, seed: int = 0, prompt: str = "a cat", steps: int = 1):
    return pipe(prompt, num_inference_steps=steps, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(seed)).images


@pytest.mark.parametrize("steps", [1, 3])
def test_reuse_steps_starts_afresh_with_every_pipeline_call(steps):
    """One-step generations (SD-Turbo style) all run at one timestep, so a rising timestep never told them apart
    (issue 43: the second image reused the first's matches). Each call of the pipeline starts afresh: an image
    equals the one a freshly patched pipeline gives first, whatever ran before it."""
    pipe = _pipeline(ratio=0.5, reuse_steps=2)
    _image(pipe, seed=0, prompt="a dog", steps=steps)  # another generation first: its matches must not carry over
    second = _image(pipe, seed=1, steps=steps)
    np.testing.assert_array_equal(second, _image(pipe, seed=1, steps=steps))
    tome.patch(pipe, ratio=0.5, reuse_steps=2)  # afresh
    np.testing.assert_array_equal(second, _image(pipe, seed=1, steps=steps))
    if steps == 1:  # a scheduler swapped in after patch is followed too
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        _image(pipe, seed=0, prompt="a dog", steps=steps)
        np.testing.assert_array_equal(second, _image(pipe, seed=1, steps=steps))
    assert not np.array_equal(second, _image(tome.remove(pipe), seed=1, steps=steps))  # it merged
    assert "set_timesteps" not in vars(pipe.scheduler)  # remove takes the counter off the scheduler


def test_reuse_steps_on_a_model_patched_alone_follows_the_timestep():
    """Without its pipeline a model tells a new generation by its timestep rising (the rule kept for models patched
    alone): a second generation equals the first, and within one the matches are reused."""
    from tome_tools.diffusers_models import build_unet

    unet = tome.patch(build_unet("tiny"), ratio=0.5, reuse_steps=2)
    generator = torch.Generator().manual_seed(5)
    sample, text = torch.randn(2, 4, 16, 16, generator=generator), torch.randn(2, 7, 32, generator=generator)
    with torch.no_grad():
        run = lambda: [unet(sample, t, text).sample for t in (900, 500, 900, 500)]
        first, again = run(), run()
    [(_, state)] = tome.patched_models(unet)
    assert state.matching.pipeline is None and state.matching.calls == 2
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(first[0], first[2], rtol=0, atol=0)  # the third call started a generation

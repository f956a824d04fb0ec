"""The driver against a fake framework: plain-Python modules with hooks, numpy arrays, and an attention that
computes its own softmax (no torch, paddle or jax anywhere).

The oracle is exactness on duplicated tokens: when every 2x2 cell of the token grid holds one token four
times, merging a token into an identical one loses nothing. Merged keys with their sizes added to the logits
(size-aware attention) give the same softmax as the duplicated keys, merged queries give the same outputs,
unmerging copies them back, and keys pooled in cells hold each value as often as the full keys do. So the
patched model must equal the unpatched one to rounding in every arrangement, while attention really sees
fewer tokens; without the size bias it must not; and on random tokens it must differ, except at ratio 0.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest

from tome_core import driver
from tome_core.hooks.attention_bias import SizeBias
from tome_core.framework import call_running

CHANNELS, TEXT = 8, 3


class _Handle:
    def __init__(self, hooks: List[Any], hook: Any):
        self.hooks, self.hook = hooks, hook

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


class Module:
    """A module of the fake framework: children are attributes (or lists of them), hooks run around
    ``forward`` as torch's do (a pre-hook may return new arguments, a post-hook a new output)."""

    def __init__(self):
        self.pre: List[Any] = []
        self.post: List[Any] = []

    def submodules(self) -> List["Module"]:
        found = [self]
        for value in vars(self).values():
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, Module):
                    found.extend(child.submodules())
        return found

    def __call__(self, *args, **kwargs):
        for hook in list(self.pre):
            result = hook(self, args, kwargs)
            if result is not None:
                args, kwargs = result
        output = None
        try:
            output = self.forward(*args, **kwargs)
        finally:
            for hook in list(self.post):
                result = hook(self, args, kwargs, output)
                if result is not None:
                    output = result
        return output


class Attention(Module):
    """Softmax attention with identity projections; keys and values from ``encoder_hidden_states`` when given.
    ``bias`` (set by the framework's ``size_aware``) is added to the logits."""

    def __init__(self, keys_seen: List[int]):
        super().__init__()
        self.keys_seen = keys_seen
        self.bias: Optional[SizeBias] = None
        self.biases_seen: List[np.ndarray] = []

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        keys = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        self.keys_seen.append(keys.shape[1])
        logits = hidden_states @ keys.transpose(0, 2, 1) / np.sqrt(CHANNELS)
        if self.bias is not None:
            added = self.bias.for_keys(keys.shape[1], hidden_states)
            logits = logits + added
            self.bias_calls += 1
            self.biases_seen.append(added)
        logits = logits - logits.max(-1, keepdims=True)
        weights = np.exp(logits)
        return (weights / weights.sum(-1, keepdims=True)) @ keys


class FeedForward(Module):
    def __init__(self, rng: np.random.Generator):
        super().__init__()
        self.weight = rng.standard_normal((CHANNELS, CHANNELS)) / np.sqrt(CHANNELS)

    def forward(self, hidden_states):
        return np.tanh(hidden_states @ self.weight)


class BasicTransformerBlock(Module):
    """Named as diffusers' block, so the family table's "basic" entry describes it: attn1 (self), attn2
    (cross, to the text), ff."""

    def __init__(self, rng: np.random.Generator, keys_seen: List[int]):
        super().__init__()
        self.attn1, self.attn2, self.ff = Attention(keys_seen), Attention([]), FeedForward(rng)

    def forward(self, hidden_states, encoder_hidden_states=None):
        hidden_states = hidden_states + self.attn1(hidden_states)
        if self.attn2 is not None:  # None: a block without cross-attention
            hidden_states = hidden_states + self.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states)
        return hidden_states + self.ff(hidden_states)


class Transformer(Module):
    """A diffusion transformer of two blocks on a ``[B, C, H, W]`` latent (patch size 1)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.config = {"patch_size": 1}
        self.keys_seen: List[int] = []
        self.blocks = [BasicTransformerBlock(rng, self.keys_seen) for _ in range(2)]

    def forward(self, hidden_states, timestep=None, encoder_hidden_states=None):
        batch, channels, height, width = hidden_states.shape
        tokens = hidden_states.reshape(batch, channels, height * width).transpose(0, 2, 1)
        for block in self.blocks:
            tokens = block(tokens, encoder_hidden_states=encoder_hidden_states)
        return tokens.transpose(0, 2, 1).reshape(batch, channels, height, width)


class FakeFramework:
    """:class:`tome_core.framework.Framework` for :class:`Module`."""

    accepted = "a fake Module"

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, Module)

    def submodules(self, module: Module) -> List[Module]:
        return module.submodules()

    def add_pre_hook(self, module: Module, hook: Callable) -> _Handle:
        module.pre.append(hook)
        return _Handle(module.pre, hook)

    def add_post_hook(self, module: Module, hook: Callable) -> _Handle:
        module.post.append(hook)
        return _Handle(module.post, hook)

    def host_values(self, x: Any) -> List[float]:
        return np.asarray(x).reshape(-1).tolist()

    def size_aware(self, module: Attention, args: Tuple[Any, ...], kwargs: Dict[str, Any], bias: SizeBias):
        module.bias, module.bias_calls = bias, 0
        return args, kwargs

    def size_aware_done(self, module: Attention, computed: bool) -> None:
        assert module.bias is None or not computed or module.bias_calls > 0  # armed: the bias was used
        module.bias = None

    def execution(self, x: Any) -> Tuple[str, str]:
        return "cpu", "eager"

    def clear_interrupted(self) -> None:
        pass  # this framework's post-hooks run in a ``finally``

    def inform(self, message: str) -> None:
        logging.getLogger("tome_core").info(message)

    def running(self, module: Module) -> bool:
        return call_running(module, (Module.__call__.__code__,))

    def kernel_keys_problem(self, module: Module) -> str:
        return "this framework has no attention kernel to reach"

    def bias_problem(self, module: Module) -> None:
        return None

    def separate_kv(self, module: Module) -> bool:
        return True

    def may_run_again(self, x: Any) -> bool:
        return False

    def output_cache(self, module: Module) -> None:
        return None

    def shards(self, model: Module) -> None:
        return None

    def same_data(self, a: Any, b: Any) -> bool:
        return False


FW = FakeFramework()


def _inputs(duplicated: bool, seed: int = 1) -> Dict[str, Any]:
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((2, CHANNELS, 8, 8))
    if duplicated:  # every 2x2 cell holds one token four times
        latent = np.repeat(np.repeat(latent[:, :, ::2, ::2], 2, axis=2), 2, axis=3)
    return dict(hidden_states=latent, timestep=np.array(500.0), encoder_hidden_states=rng.standard_normal((2, TEXT, CHANNELS)))


def _run(model: Transformer, inputs: Dict[str, Any]) -> Tuple[np.ndarray, List[int]]:
    model.keys_seen.clear()
    return model(**inputs), list(model.keys_seen)


ARRANGEMENTS = {
    "default (keys and values in 2x2 cells)": ({}, 16),
    "tokens 0.5, size-aware (ToMe for SD)": ({"ratio": 0.5}, 32),
    "tokens 0.75, size-aware": ({"ratio": 0.75}, 16),
    "kv 0.5, size-aware": ({"mode": "kv", "ratio": 0.5}, 32),
    "queries 0.5": ({"mode": "queries", "ratio": 0.5}, 64),
}


@pytest.mark.parametrize("name", ARRANGEMENTS)
def test_merging_duplicated_tokens_is_exact_and_attention_sees_fewer(name):
    options, keys = ARRANGEMENTS[name]
    model, inputs = Transformer(), _inputs(duplicated=True)
    unpatched, seen = _run(model, inputs)
    assert seen == [64, 64]
    driver.patch(FW, model, options)
    patched, seen = _run(model, inputs)
    assert seen == [keys, keys]
    np.testing.assert_allclose(patched, unpatched, rtol=0, atol=1e-12)
    assert driver.patched_models(FW, model)[0].state.ledger.stats[1].blocks == 2


def test_without_the_size_bias_merged_duplicates_are_not_exact():
    model, inputs = Transformer(), _inputs(duplicated=True)
    unpatched, _ = _run(model, inputs)
    driver.patch(FW, model, {"ratio": 0.5, "proportional_attn": False})
    patched, seen = _run(model, inputs)
    assert seen == [32, 32] and np.abs(patched - unpatched).max() > 1e-3


def test_random_tokens_differ_ratio_zero_and_remove_are_exact():
    model, inputs = Transformer(), _inputs(duplicated=False)
    unpatched, _ = _run(model, inputs)
    driver.patch(FW, model, {"ratio": 0.5})
    assert np.abs(_run(model, inputs)[0] - unpatched).max() > 1e-3
    with pytest.warns(UserWarning, match="merges no tokens"):
        driver.patch(FW, model, {"ratio": 0.0})
    np.testing.assert_array_equal(_run(model, inputs)[0], unpatched)
    driver.remove(FW, model)
    assert not any(m.pre or m.post for m in model.submodules())
    assert type(model.blocks[0].attn1) is Attention  # its class back
    np.testing.assert_array_equal(_run(model, inputs)[0], unpatched)


def test_a_model_without_known_blocks_is_refused_at_patch():
    class Plain(Module):
        def forward(self, hidden_states):
            return hidden_states

    with pytest.raises(ValueError, match=r"nothing to patch: .*Plain contains no transformer block ToMe knows"):
        driver.patch(FW, Plain(), {})


def test_an_object_that_is_no_model_is_named_first_with_how_to_load_a_name():
    with pytest.raises(TypeError, match=r"^ToMe patches a pipeline or a model; got None\. It takes a fake Module$"):
        driver.patch(FW, None, {})
    with pytest.raises(TypeError, match=(
        r"^ToMe patches a pipeline or a model; got str 'some/model': a model id or folder is not a model; load it first, "
        r"e\.g\. pipe = DiffusionPipeline\.from_pretrained\('some/model'\), then patch\(pipe\)\. It takes a fake Module$"
    )):
        driver.patch(FW, "some/model", {})
    with pytest.raises(TypeError, match=r"^remove takes a patched pipeline or model; got None$"):
        driver.remove(FW, None)
    with pytest.raises(TypeError, match=r"^patched_models takes a pipeline or a model; got None$"):
        driver.patched_models(FW, None)


def test_cross_attention_options_on_blocks_without_it_warn_and_alone_merge_nothing():
    model, inputs = Transformer(), _inputs(duplicated=False)
    for block in model.blocks:
        block.attn2 = None
    unpatched, _ = _run(model, inputs)
    with pytest.warns(UserWarning, match=r"^ToMe patch on Transformer: merge_crossattn=True acts on cross-attention, which no "):
        driver.patch(FW, model, {"ratio": 0.5, "merge_crossattn": True})
    assert _run(model, inputs)[1] == [32, 32]  # self-attention merges as without the option
    with pytest.warns(UserWarning, match=(
        r"^ToMe patch on Transformer merges no tokens: merge_attn=False and merge_mlp=False, and merge_crossattn=True "
        r"acts on cross-attention, which no merged block of Transformer has$"
    )):
        driver.patch(FW, model, {"ratio": 0.5, "merge_attn": False, "merge_crossattn": True})
    np.testing.assert_array_equal(_run(model, inputs)[0], unpatched)
    driver.remove(FW, model)


def test_a_call_outside_timestep_range_runs_unmerged_and_exactly():
    model, inputs = Transformer(), _inputs(duplicated=False)
    unpatched, _ = _run(model, inputs)
    driver.patch(FW, model, {"ratio": 0.5, "timestep_range": (0, 400)})  # the call's timestep is 500
    patched, seen = _run(model, inputs)
    assert seen == [64, 64]
    np.testing.assert_array_equal(patched, unpatched)
    driver.patch(FW, model, {"ratio": 0.5, "timestep_range": (400, 1000)})
    assert _run(model, inputs)[1] == [32, 32]


def test_the_size_bias_is_each_merged_keys_log_size_and_text_keys_get_none():
    """Brute force: the sizes a block's bias carries sum, per batch item, to the tokens merged into its keys;
    cross-attention (text keys) is never armed."""
    model, inputs = Transformer(), _inputs(duplicated=False)
    driver.patch(FW, model, {"ratio": 0.5})
    _run(model, inputs)
    for block in model.blocks:
        [bias] = block.attn1.biases_seen
        assert bias.shape == (2, 1, 32) and (bias >= 0).all() and (bias > 0).any()
        # (a plain comparison: ppdiffusers, imported in the paddle sessions, sets np.bool = bool, which breaks
        # numpy.testing.assert_allclose against a scalar)
        assert np.abs(np.exp(bias).sum(-1) - 64).max() < 1e-9
        assert block.attn2.biases_seen == []


"""The driver against a framework made up here (issue #36): plain Python modules computing with numpy, whose
calls run the hooks the driver registers. Nothing of torch, paddle or jax: the driver, the family table and
the core must patch, merge, count and remove through the :class:`~tome_core.driver.Framework` protocol alone.

The model is a PixArt-like diffusion transformer: a ``[B, C, H, W]`` latent patchified 1x1 into ``H*W``
tokens, diffusers' block layout (``BasicTransformerBlock`` with ``attn1``, ``attn2``, ``ff``), plain softmax
attention that adds an armed size bias to its logits. Oracles: the unpatched model (``ratio=0``, ``remove``),
the token counts each attention really sees, and the merged sizes the bias must carry (they sum to the tokens).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import pytest

from tome_core import driver

WIDTH, TEXT, HEIGHT = 8, 5, 8


class FakeFramework:
    """Hooks kept in tables by module id; :class:`Module` calls run them around ``forward``."""

    accepted = "a fake Module"

    def __init__(self) -> None:
        self.pre: Dict[int, List[Any]] = {}
        self.post: Dict[int, List[Any]] = {}
        self.biases: Dict[int, Any] = {}

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, Module)

    def submodules(self, module: "Module") -> List["Module"]:
        return [module, *(sub for child in module.children() for sub in self.submodules(child))]

    def _add(self, table: Dict[int, List[Any]], module: "Module", hook: Any) -> Any:
        hooks = table.setdefault(id(module), [])
        hooks.append(hook)
        return SimpleNamespace(remove=lambda: hooks.remove(hook))

    def add_pre_hook(self, module, hook):
        return self._add(self.pre, module, hook)

    def add_post_hook(self, module, hook):
        return self._add(self.post, module, hook)

    def call(self, module: "Module", args, kwargs):
        for hook in list(self.pre.get(id(module), ())):
            changed = hook(module, args, kwargs)
            if changed is not None:
                args, kwargs = changed
        output = None
        try:
            output = module.forward(*args, **kwargs)
        finally:
            for hook in list(self.post.get(id(module), ())):
                changed = hook(module, args, kwargs, output)
                output = output if changed is None else changed
        return output

    def host_values(self, x):
        return np.asarray(x).reshape(-1).tolist()

    def size_aware(self, module, args, kwargs, bias):
        self.biases[id(module)] = bias
        return args, kwargs

    def size_aware_done(self, module, computed):
        self.biases.pop(id(module), None)

    def bias_problem(self, module):
        return None

    def separate_kv(self, module):
        return False  # no kv_input: mode="auto" runs ToMe for SD's arrangement

    def may_run_again(self, x):
        return False

    def shards(self, model):
        return None

    def same_data(self, a, b):
        return False

    def output_cache(self, module):
        return None

    def hooks(self) -> int:
        return sum(len(hooks) for table in (self.pre, self.post) for hooks in table.values())


FW = FakeFramework()


class Module:
    def children(self) -> List["Module"]:
        found = []
        for value in vars(self).values():
            found += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, Module)]
        return found

    def __call__(self, *args, **kwargs):
        return FW.call(self, args, kwargs)


class Linear(Module):
    def __init__(self, rng, width_in, width_out):
        self.weight = rng.standard_normal((width_in, width_out)) / np.sqrt(width_in)

    def forward(self, x):
        return x @ self.weight


class Attention(Module):
    """Softmax attention with one head; records the query and key counts of each call."""

    def __init__(self, rng, width, context_width=None):
        self.to_q, self.to_out = Linear(rng, width, width), Linear(rng, width, width)
        self.to_k, self.to_v = Linear(rng, context_width or width, width), Linear(rng, context_width or width, width)
        self.seen: List[tuple] = []
        self.bias_seen: List[np.ndarray] = []

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = self.to_q(hidden_states), self.to_k(context), self.to_v(context)
        logits = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
        bias = FW.biases.get(id(self))
        if bias is not None:
            added = np.asarray(bias.for_keys(k.shape[1], q))  # [B, 1, K]
            self.bias_seen.append(added)
            logits = logits + added
        self.seen.append((q.shape[1], k.shape[1]))
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        return self.to_out((weights / weights.sum(-1, keepdims=True)) @ v)


class FeedForward(Module):
    def __init__(self, rng, width):
        self.up, self.down = Linear(rng, width, 2 * width), Linear(rng, 2 * width, width)
        self.seen: List[int] = []

    def forward(self, hidden_states):
        self.seen.append(hidden_states.shape[1])
        return self.down(np.tanh(self.up(hidden_states)))


def norm(x):
    return (x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + 1e-5)


class BasicTransformerBlock(Module):
    """diffusers' block layout: the family table knows it by its class name."""

    def __init__(self, rng, width, text_width):
        self.attn1, self.attn2, self.ff = Attention(rng, width), Attention(rng, width, text_width), FeedForward(rng, width)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, timestep=None):
        x = hidden_states + self.attn1(norm(hidden_states))
        x = x + self.attn2(norm(x), encoder_hidden_states=encoder_hidden_states)
        return x + self.ff(norm(x))


class ToyTransformer2DModel(Module):
    """A diffusion transformer: a config with a patch size (1), a timestep, text tokens."""

    def __init__(self, seed=0, blocks=2):
        rng = np.random.default_rng(seed)
        self.config = SimpleNamespace(patch_size=1)
        self.proj_in = Linear(rng, 4, WIDTH)
        self.transformer_blocks = [BasicTransformerBlock(rng, WIDTH, TEXT) for _ in range(blocks)]
        self.proj_out = Linear(rng, WIDTH, 4)

    def forward(self, hidden_states, encoder_hidden_states=None, timestep=None):
        batch, channels, height, width = hidden_states.shape
        x = self.proj_in(hidden_states.reshape(batch, channels, height * width).transpose(0, 2, 1))
        for block in self.transformer_blocks:
            x = block(x, encoder_hidden_states=encoder_hidden_states, timestep=timestep)
        return self.proj_out(x).transpose(0, 2, 1).reshape(batch, channels, height, width)


def inputs(batch=2, side=HEIGHT):
    rng = np.random.default_rng(1)
    return rng.standard_normal((batch, 4, side, side)), rng.standard_normal((batch, 3, TEXT)), np.array([500] * batch)


def run(model, latent, text, timestep):
    for block in model.transformer_blocks:
        block.attn1.seen.clear(), block.attn2.seen.clear(), block.ff.seen.clear(), block.attn1.bias_seen.clear()
    return model(latent, encoder_hidden_states=text, timestep=timestep)


def test_a_patch_merges_what_attention_sees_and_remove_restores_the_model():
    model = ToyTransformer2DModel()
    latent, text, timestep = inputs()
    plain = run(model, latent, text, timestep)
    driver.patch(FW, model, {"ratio": 0.5, "proportional_attn": False})
    merged = run(model, latent, text, timestep)
    tokens = HEIGHT * HEIGHT
    for block in model.transformer_blocks:
        assert block.attn1.seen == [(tokens // 2, tokens // 2)]  # self-attention: half the tokens, as keys too
        assert block.attn2.seen == [(tokens, 3)]  # cross-attention: every query, every text key
        assert block.ff.seen == [tokens]
    assert merged.shape == plain.shape and np.isfinite(merged).all()
    assert 0 < np.linalg.norm(merged - plain) / np.linalg.norm(plain) < 0.5
    np.testing.assert_array_equal(run(model, latent, text, timestep), merged)  # same seed, same output
    [(patched, state)] = driver.patched_models(FW, model)
    assert patched is model
    assert state.stats[1].kept == tokens // 2 and state.stats[1].blocks == 2
    driver.remove(FW, model)
    assert FW.hooks() == 0
    np.testing.assert_array_equal(run(model, latent, text, timestep), plain)


def test_ratio_zero_and_timesteps_outside_the_range_give_the_unpatched_output():
    model = ToyTransformer2DModel(seed=3)
    latent, text, timestep = inputs()
    plain = run(model, latent, text, timestep)
    with pytest.warns(UserWarning, match="merges no tokens"):
        driver.patch(FW, model, {"ratio": 0.0})
    np.testing.assert_array_equal(run(model, latent, text, timestep), plain)
    driver.patch(FW, model, {"ratio": 0.5, "timestep_range": (0, 400)})
    np.testing.assert_array_equal(run(model, latent, text, timestep), plain)
    assert model.transformer_blocks[0].attn1.seen == [(HEIGHT * HEIGHT,) * 2]
    driver.remove(FW, model)


def test_size_aware_attention_gets_each_merged_keys_log_size():
    """The bias the driver arms is log(size) per merged key: the sizes of a batch item sum to its tokens."""
    model = ToyTransformer2DModel(seed=4)
    latent, text, timestep = inputs()
    driver.patch(FW, model, {"ratio": 0.5})
    run(model, latent, text, timestep)
    for block in model.transformer_blocks:
        [bias] = block.attn1.bias_seen
        assert bias.shape == (2, 1, HEIGHT * HEIGHT // 2)
        np.testing.assert_allclose(np.exp(bias).sum(-1), HEIGHT * HEIGHT)
        assert (bias >= 0).all() and (bias > 0).any()
        assert block.attn2.bias_seen == []  # cross-attention's text keys are never merged
    driver.remove(FW, model)


def test_the_default_runs_tome_for_sd_where_attention_takes_no_separate_keys():
    model = ToyTransformer2DModel(seed=5)
    latent, text, timestep = inputs()
    driver.patch(FW, model, {})
    run(model, latent, text, timestep)
    assert model.transformer_blocks[0].attn1.seen == [(HEIGHT * HEIGHT // 2,) * 2]
    with pytest.raises(ValueError, match="mode='kv'"):
        driver.patch(FW, model, {"mode": "kv", "matching": "cell"})
    driver.remove(FW, model)


def test_a_module_without_known_blocks_is_refused_at_patch():
    class Other(Module):
        def __init__(self):
            self.inner = Linear(np.random.default_rng(0), 4, 4)

    with pytest.raises(ValueError, match="nothing to patch: .*Other contains no transformer block"):
        driver.patch(FW, Other(), {})
    assert FW.hooks() == 0

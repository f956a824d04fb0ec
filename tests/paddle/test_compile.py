"""Patching and ``paddle.jit.to_static`` in every order (issue #16): a patch, ``remove`` or re-patch after a
compiled call takes effect on the next call, in SOT mode (the default) and AST mode (``full_graph=True``), with
``to_static`` applied to the layer or to a function that calls it.

The model is ppdiffusers' 2-D ``Transformer2DModel`` with one ``BasicTransformerBlock`` (the unit a UNet
repeats): SOT translates a tiny UNet in ~40 s on one core, this one in a few seconds. The same orders were
checked by hand on the tiny UNet (tests/paddle/conftest.py), with the same results.

Oracles: the eager model in the same state (unpatched, patched with ratio 0.5, with ratio 0.3), with
``use_rand=False``. The states differ by ~1e-1 relative; compiled and eager agree to float tolerance.
"""

from __future__ import annotations

import copy
import gc
import weakref

import numpy as np
import paddle
import pytest
from ppdiffusers.models.transformer_2d import Transformer2DModel

import tome_core.paddle as tome

TOL = 1e-4
STATES = (None, 0.5, 0.3)


def _build():
    paddle.seed(0)
    model = Transformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=32, num_layers=1, cross_attention_dim=16,
        norm_num_groups=8,
    )
    model.eval()
    return model


@pytest.fixture(scope="module")
def pristine():
    return _build()


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(3)
    x = paddle.to_tensor(rng.standard_normal((2, 32, 8, 8)).astype(np.float32))
    text = paddle.to_tensor(rng.standard_normal((2, 5, 16)).astype(np.float32))
    return x, text


def _forward(model, x, text):
    return model(x, encoder_hidden_states=text, return_dict=False)[0]


def _patch(model, state):
    if state is None:
        tome.remove(model)
    else:
        tome.patch(model, ratio=state, use_rand=False)


@pytest.fixture(scope="module")
def eager(pristine, inputs):
    """The eager output of the model in each state."""
    outputs = {}
    for state in STATES:
        model = copy.deepcopy(pristine)
        _patch(model, state)
        with paddle.no_grad():
            outputs[state] = _forward(model, *inputs).numpy()
    return outputs


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class Compiled:
    """``model`` under ``to_static`` (SOT or AST) applied to the layer or to a function calling it; each call
    is checked against the eager model in the state it is expected to be in."""

    def __init__(self, model, inputs, eager, full_graph, target):
        self.inputs, self.eager = inputs, eager
        self.traces = 0
        if target == "layer":
            layer = paddle.jit.to_static(model, full_graph=full_graph)
            self.fn = lambda x, text: _forward(layer, x, text)
        else:
            def step(x, text):
                self.traces += 1  # Python in the function runs when AST traces it
                return _forward(model, x, text)

            self.fn = paddle.jit.to_static(step, full_graph=full_graph)

    def check(self, state):
        with paddle.no_grad():
            out = self.fn(*self.inputs).numpy()
        distances = {s: _rel(out, ref) for s, ref in self.eager.items()}
        assert min(distances, key=distances.get) == state and distances[state] < TOL, (state, distances)


def test_eager_states_differ(eager):
    """The oracle tells the states apart, far above TOL."""
    for a in STATES:
        for b in STATES:
            if a != b:
                assert _rel(eager[a], eager[b]) > 1e-2, (a, b)


@pytest.mark.parametrize("target", ["layer", "function"])
@pytest.mark.parametrize("full_graph", [False, True], ids=["sot", "ast"])
def test_patch_after_compiled_call_takes_effect(pristine, inputs, eager, full_graph, target):
    """compile, call, patch, call, call, remove, call, re-patch with another ratio, call, patch, call: every
    call equals the eager model in its state."""
    model = copy.deepcopy(pristine)
    compiled = Compiled(model, inputs, eager, full_graph, target)
    compiled.check(None)
    for state in (0.5, 0.5, None, 0.3, 0.5):
        _patch(model, state)
        compiled.check(state)
        compiled.check(state)


@pytest.mark.parametrize("target", ["layer", "function"])
@pytest.mark.parametrize("full_graph", [False, True], ids=["sot", "ast"])
def test_patch_before_compiling(pristine, inputs, eager, full_graph, target):
    """patch, compile, call, remove, call, re-patch, call: the compiled model follows the patch both ways."""
    model = copy.deepcopy(pristine)
    _patch(model, 0.5)
    compiled = Compiled(model, inputs, eager, full_graph, target)
    for state in (0.5, None, 0.3):
        _patch(model, state)
        compiled.check(state)


def test_ast_retraces_once_per_patch_and_leaves_other_programs(pristine, inputs, eager):
    """AST mode: a patch or remove costs its static functions that traced the model one trace on their next
    call (and none after), and does not touch the programs of a static function over another model."""
    model, other = copy.deepcopy(pristine), copy.deepcopy(pristine)
    compiled = Compiled(model, inputs, eager, True, "function")
    unrelated = Compiled(other, inputs, eager, True, "function")
    compiled.check(None)
    unrelated.check(None)
    assert (compiled.traces, unrelated.traces) == (1, 1)
    compiled.check(None)
    assert compiled.traces == 1
    expected = 1
    for state in (0.5, None, 0.3):
        _patch(model, state)
        expected += 1
        compiled.check(state)
        compiled.check(state)
        assert compiled.traces == expected
    unrelated.check(None)
    assert unrelated.traces == 1
    tome.remove(other)  # removing from an unpatched model changes nothing: no retrace
    unrelated.check(None)
    assert unrelated.traces == 1


def test_deepcopy_of_a_compiled_patched_model_is_independent(pristine, inputs, eager):
    """The hooks' SOT wrapper is copied with its layer: a deep copy of a patched model stays patched when the
    original is removed, compiled or not."""
    model = copy.deepcopy(pristine)
    _patch(model, 0.5)
    twin = copy.deepcopy(model)
    tome.remove(model)
    compiled = Compiled(twin, inputs, eager, False, "layer")
    compiled.check(0.5)
    with paddle.no_grad():
        assert _rel(_forward(model, *inputs).numpy(), eager[None]) < TOL


def test_patch_passes_over_weak_proxies_whose_objects_died(pristine, inputs, eager):
    """``patch`` looks through the process's objects for ``to_static`` programs that traced the model; a
    ``weakref.proxy`` whose object has died (torch and pytest-xdist leave some) raises on ``isinstance``, and
    once made every patch in that process fail."""

    class Gone:
        pass

    gone = Gone()
    dead = [weakref.proxy(gone)]
    del gone
    assert any(type(o) is weakref.ProxyType for o in gc.get_objects())
    model = copy.deepcopy(pristine)
    _patch(model, 0.5)
    with paddle.no_grad():
        np.testing.assert_allclose(_forward(model, *inputs).numpy(), eager[0.5], rtol=0, atol=0)
    del dead

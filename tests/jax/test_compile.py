"""Patching and ``jax.jit`` in every order (issue #16): no order leaves a patched-looking model running
unpatched compiled code, or the reverse.

Flax modules are immutable: ``patch(unet)`` returns a new module and leaves ``unet`` as it was, so a jitted
function that closes over ``unet`` keeps running the unpatched model, and says so (``is_patched(unet)`` is
False). A module passed as a static argument is part of jax's cache key: a patched module traces once, and
``remove`` gives back the original module, whose compiled code jax reuses without tracing.

Oracles: the eager (un-jitted) model in the same state, patched or not. The patched and unpatched outputs
differ by ~1e-2 relative, far above the jit-vs-eager tolerance.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import pytest

import tome_core.jax as tome

TOL = 1e-4  # jit vs eager, float32
OPTIONS = dict(ratio=0.5, use_rand=False)


def _eager(model, params, inputs):
    sample, timesteps, context = inputs
    with jax.disable_jit():
        return np.asarray(model.apply({"params": params}, sample, timesteps, context).sample)


@pytest.fixture(scope="module")
def eager(small, inputs):
    """The eager outputs of the unpatched model and of the model patched with ratio 0.5 and 0.3."""
    unet, params = small
    outputs = {
        None: _eager(unet, params, inputs),
        0.5: _eager(tome.patch(unet, **OPTIONS), params, inputs),
        0.3: _eager(tome.patch(unet, ratio=0.3, use_rand=False), params, inputs),
    }
    return outputs


def _closest(out, eager, rel):
    """The state (None, 0.5, 0.3) whose eager output ``out`` equals, with the distances to each."""
    distances = {state: rel(out, ref) for state, ref in eager.items()}
    return min(distances, key=distances.get), distances


def test_eager_states_differ(eager, rel):
    """The oracle can tell the states apart: patched and unpatched outputs differ far above TOL."""
    assert rel(eager[0.5], eager[None]) > 1e-3
    assert rel(eager[0.3], eager[None]) > 1e-3
    assert rel(eager[0.5], eager[0.3]) > 1e-3


def test_jit_closing_over_a_module_keeps_that_module(small, inputs, eager, rel):
    """A jitted function closing over the unpatched module, already run, keeps running it after ``patch``,
    and that module is not patched; a jitted function over the returned module runs it patched, and
    ``remove`` gives back the module the first function closed over."""
    unet, params = small
    closed = jax.jit(lambda p, x, t, c: unet.apply({"params": p}, x, t, c).sample)
    before = np.asarray(closed(params, *inputs))
    assert rel(before, eager[None]) < TOL

    patched = tome.patch(unet, **OPTIONS)
    assert not tome.is_patched(unet) and tome.patched_models(unet) == []
    assert tome.is_patched(patched)
    after = np.asarray(closed(params, *inputs))
    assert _closest(after, eager, rel)[0] is None and rel(after, eager[None]) < TOL

    step = jax.jit(lambda p, x, t, c: patched.apply({"params": p}, x, t, c).sample)
    out = np.asarray(step(params, *inputs))
    state, distances = _closest(out, eager, rel)
    assert state == 0.5 and distances[0.5] < TOL, distances

    assert tome.remove(patched) is unet
    assert rel(np.asarray(closed(params, *inputs)), eager[None]) < TOL


def test_static_module_argument_retraces_once_per_patch(small, inputs, eager, rel):
    """``jax.jit`` with the module as a static argument, in the order compile, call, patch, call, remove, call,
    re-patch with another ratio, call, patch as before, call: each output equals the eager model in that
    state; a patch traces once, ``remove`` reuses the unpatched compilation, and an equal patch reuses its own."""
    unet, params = small
    traces = []

    @partial(jax.jit, static_argnums=0)
    def run(model, p, x, t, c):
        traces.append(type(model).__name__ + (f"[{model.tome.ratio}]" if tome.is_patched(model) else ""))
        return model.apply({"params": p}, x, t, c).sample

    def check(model, expected, count):
        out = np.asarray(run(model, params, *inputs))
        state, distances = _closest(out, eager, rel)
        assert state == expected and distances[expected] < TOL, (expected, distances)
        assert len(traces) == count, traces

    check(unet, None, 1)
    check(unet, None, 1)  # no retrace on the same shapes
    patched = tome.patch(unet, **OPTIONS)
    check(patched, 0.5, 2)  # one retrace for the patch
    check(patched, 0.5, 2)
    original = tome.remove(patched)
    assert original is unet
    check(original, None, 2)  # the unpatched compilation is reused
    other = tome.patch(original, ratio=0.3, use_rand=False)
    check(other, 0.3, 3)
    again = tome.patch(other, **OPTIONS)  # re-patching a patched module patches its original
    assert again is not patched and tome.remove(again) is unet
    check(again, 0.5, 3)  # equal to the first patched module: its compilation is reused
    check(unet, None, 3)


def test_modules_in_different_states_never_compare_equal(small):
    """jax's cache matches static arguments by hash and ``==``: the unpatched module and modules patched with
    different options must never be equal (or one would reuse another's compiled code), equal patches must."""
    unet, _ = small
    first = tome.patch(unet, **OPTIONS)
    second = tome.patch(unet, **OPTIONS)
    other = tome.patch(unet, ratio=0.3, use_rand=False)
    assert first == second and hash(first) == hash(second)
    assert first != unet and unet != first
    assert first != other and other != first
    assert tome.remove(first) == unet and hash(tome.remove(first)) == hash(unet)
    clone = first.clone()  # Module.clone() keeps the patch
    assert tome.is_patched(clone) and clone == first and hash(clone) == hash(first)

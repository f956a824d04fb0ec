"""Fixtures of the paddle / ppdiffusers tests: a tiny UNet with random weights and inputs for it."""

from __future__ import annotations

import copy
import threading

import numpy as np
import paddle
import pytest

import tome_core.paddle  # noqa: F401  (installs our apply_tome/remove_tome methods, as users do)
from tome_tools.ppdiffusers_models import build_unet


@pytest.fixture(scope="session")
def tiny_unet():
    """The pristine tiny UNet: tests patch deep copies of it."""
    return build_unet("tiny", seed=0)


@pytest.fixture
def unet(tiny_unet):
    return copy.deepcopy(tiny_unet)


@pytest.fixture(scope="session")
def inputs():
    rng = np.random.default_rng(3)
    sample = paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype(np.float32))
    text = paddle.to_tensor(rng.standard_normal((2, 7, 32)).astype(np.float32))
    return sample, paddle.to_tensor(500), text


def _call(model, inputs, keywords=False) -> np.ndarray:
    sample, timestep, text = inputs
    with paddle.no_grad():
        if keywords:
            return model(sample=sample, timestep=timestep, encoder_hidden_states=text).sample.numpy()
        return model(sample, timestep, text).sample.numpy()


@pytest.fixture(scope="session")
def call():
    """``call(model, inputs, keywords=False)``: the UNet's output as numpy, called positionally or by keyword."""
    return _call


def _sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, training=True,
               attention_op=None):
    """``scaled_dot_product_attention_`` as ppdiffusers calls it (inputs ``[B, L, H, D]``, additive mask
    broadcast to ``[B, H, L, K]``), in plain math: ppdiffusers binds that name only with ppxformers or on NPU."""
    assert dropout_p == 0.0 and not is_causal
    q, k, v = (paddle.transpose(t, [0, 2, 1, 3]) for t in (query, key, value))
    scores = paddle.matmul(q, k, transpose_y=True) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if attn_mask is not None:
        scores = scores + attn_mask
    return paddle.transpose(paddle.matmul(paddle.nn.functional.softmax(scores, axis=-1), v), [0, 2, 1, 3])


@pytest.fixture(scope="module")
def sdpa_shim():
    """Binds ``paddle.nn.functional.scaled_dot_product_attention_`` (SD3's joint attention calls it) to
    :func:`_sdpa_math` while a test module runs, unless paddle has it; yields the function in place."""
    functional = paddle.nn.functional
    if hasattr(functional, "scaled_dot_product_attention_"):
        yield functional.scaled_dot_product_attention_
        return
    functional.scaled_dot_product_attention_ = _sdpa_math
    try:
        yield _sdpa_math
    finally:
        del functional.scaled_dot_product_attention_


def run_in_two_threads(runs):
    """``[runs[0](), runs[1]()]`` run at the same time from two threads (started together at a barrier)."""
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def work(index):
        try:
            barrier.wait()
            results[index] = runs[index]()
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return [results[0], results[1]]


@pytest.fixture(name="run_in_two_threads", scope="session")
def run_in_two_threads_fixture():
    """``run_in_two_threads(runs)``: see :func:`run_in_two_threads`."""
    return run_in_two_threads

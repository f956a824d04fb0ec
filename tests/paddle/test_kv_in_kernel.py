"""``mode="kv"`` on ppdiffusers' SD3 joint attention, whose processor computes its keys from every token: each
``scaled_dot_product_attention_`` call gets its image keys and values merged (``KernelKeys``), text keys and every
query kept. Oracle: the unpatched model with each call's image keys and values picked at the 2x2 cells' first
tokens by index arithmetic (strided downsampling, ``use_rand=False``); the key counts the function receives.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import tome_core.paddle as tome
from tome_tools.ppdiffusers_models import build_transformer, transformer_inputs

pytestmark = pytest.mark.usefixtures("sdpa_shim")

ROWS, COLS, TEXT = 8, 6, 7  # latent 16x12: 8x6 tokens after SD3's 2x2 patches; [image; text] keys
STRIDED = dict(mode="kv", matching="cell", sx=2, sy=2, cell_pool="sample", use_rand=False)


def picking(sdpa, picks, seen):
    """``sdpa`` on the keys and values at ``picks`` of the image's rows (text rows kept); records key counts."""

    def attend(query, key, value, attn_mask=None, *args, **kwargs):
        if picks is not None:
            rows = paddle.to_tensor(picks + list(range(ROWS * COLS, int(key.shape[1]))))
            key, value = paddle.index_select(key, rows, axis=1), paddle.index_select(value, rows, axis=1)
        seen.append(int(key.shape[1]))
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    return attend


def call(model, inputs):
    with paddle.no_grad():
        return model(**inputs).sample.numpy()


def test_joint_attention_keys_merge_inside_the_attention_function(sdpa_shim, monkeypatch):
    model = build_transformer("tiny-sd3")
    inputs = transformer_inputs(model, 16, 12, batch=2, text=TEXT)
    picks = [r * COLS + c for r in range(0, ROWS, 2) for c in range(0, COLS, 2)]
    oracle_seen, seen = [], []
    monkeypatch.setattr(paddle.nn.functional, "scaled_dot_product_attention_", picking(sdpa_shim, picks, oracle_seen))
    expected = call(model, inputs)
    monkeypatch.setattr(paddle.nn.functional, "scaled_dot_product_attention_", picking(sdpa_shim, None, seen))
    tome.patch(model, **STRIDED)
    got = call(model, inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert set(seen) == set(oracle_seen) == {ROWS * COLS // 4 + TEXT}
    tome.remove(model)
    seen.clear()
    call(model, inputs)
    assert set(seen) == {ROWS * COLS + TEXT}

"""Size-aware (proportional) attention: the log-size bias over merged keys equals attention over all tokens
with each merged token physically repeated once per token it stands for. numpy brute force is the oracle."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tome_core import bipartite_match, merge, unmerge
from tome_core.algorithm.merge import size_bias


def attention(q, k, v, bias=None):
    logits = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    logits -= logits.max(-1, keepdims=True)
    weights = np.exp(logits)
    return (weights / weights.sum(-1, keepdims=True)) @ v


@settings(max_examples=25, deadline=None)
@given(
    h=st.integers(2, 9), w=st.integers(2, 9), batch=st.integers(1, 2), fraction=st.floats(0, 1), seed=st.integers(0, 2**31)
)
def test_size_bias_equals_repeating_merged_tokens(xp, h, w, batch, fraction, seed):
    rng = np.random.default_rng(seed)
    n = h * w
    x = rng.standard_normal((batch, n, 6)).astype(np.float32)
    queries = rng.standard_normal((batch, 5, 6))
    num_src = n - (h // 2) * (w // 2)
    match = bipartite_match(xp.ops, xp.asarray(x), h, w, 2, 2, int(num_src * fraction), None)
    merged = merge(xp.asarray(x), match)
    if match.merged == 0:
        return
    keys = xp.numpy(merged).astype(np.float64)
    repeated = xp.numpy(unmerge(merged, match)).astype(np.float64)  # every token holds its slot's value
    bias = xp.numpy(size_bias(match, merged)).astype(np.float64)
    assert bias.shape == (batch, 1, n - match.merged)
    np.testing.assert_allclose(
        attention(queries, keys, keys, bias), attention(queries, repeated, repeated), rtol=1e-5, atol=1e-6
    )
    # Without the bias, merged keys are under-weighted whenever slots stand for different numbers of tokens.
    if np.ptp(bias) > 0:
        assert not np.allclose(attention(queries, keys, keys), attention(queries, repeated, repeated), atol=1e-6)

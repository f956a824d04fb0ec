"""The size bias folded into SDPA's head dimension (``sdpa_with_key_bias``, taken on CUDA in half precision where a
mask would cost the flash kernel) against the same call with the bias as an additive mask, on the CPU in float64."""

import pytest
import torch
import torch.nn.functional as F

from tome_core.adapters.diffusers import key_bias_folds, sdpa_with_key_bias


def _inputs(batch, heads, key_heads, queries, keys, width, three_d=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    query, key, value = draw(batch, heads, queries, width), draw(batch, key_heads, keys, width), draw(batch, key_heads, keys, width)
    sizes = torch.randint(1, 6, (batch, 1, keys), generator=generator).to(torch.float64)
    bias = torch.log(sizes)[:, None]  # [b, 1, 1, K]
    if three_d:  # [B * heads, L, d] with the bias repeated per head, as _SizeBiasMode._rows gives it
        query, key, value = (x.flatten(0, 1) for x in (query, key, value))
        bias = torch.log(sizes).repeat_interleave(heads, dim=0)
    return query, key, value, bias


@pytest.mark.parametrize(
    "shape, extra",
    [
        ((2, 4, 4, 33, 17, 64), {}),  # more queries than keys (kv arrangement), head multiple of 8
        ((1, 3, 3, 20, 20, 40), {"scale": 0.3}),  # a scale of the processor's own
        ((2, 4, 2, 16, 9, 24), {"enable_gqa": True}),  # grouped keys: the column broadcasts over key heads
        ((1, 2, 2, 12, 12, 13), {"is_causal": True}),  # an odd head width, causal
    ],
)
def test_folded_bias_equals_the_additive_mask(shape, extra):
    query, key, value, bias = _inputs(*shape)
    call = {"query": query, "key": key, "value": value, **extra}
    folded = sdpa_with_key_bias(F.scaled_dot_product_attention, (query, key), {"value": value, **extra}, bias)
    if extra.get("is_causal"):  # SDPA refuses a mask together with is_causal: the causal mask spelt out
        causal = torch.ones(shape[3], shape[4], dtype=torch.bool).tril()
        masked = F.scaled_dot_product_attention(
            query, key, value, attn_mask=bias.masked_fill(~causal, float("-inf")), scale=extra.get("scale")
        )
    else:
        masked = F.scaled_dot_product_attention(**call, attn_mask=bias)
    plain = F.scaled_dot_product_attention(**call)
    assert folded.shape == masked.shape
    torch.testing.assert_close(folded, masked, rtol=1e-10, atol=1e-10)
    assert (plain - masked).abs().max() > 1e-3  # the bias changes the result: the check can fail


def test_folded_bias_with_three_dimensional_queries():
    query, key, value, bias = _inputs(2, 3, 3, 10, 7, 16, three_d=True)
    folded = sdpa_with_key_bias(F.scaled_dot_product_attention, (query, key, value), {}, bias)
    torch.testing.assert_close(folded, F.scaled_dot_product_attention(query, key, value, attn_mask=bias), rtol=1e-10, atol=1e-10)


def test_folding_is_taken_only_on_cuda():
    query, key, value, _ = _inputs(1, 2, 2, 8, 8, 64)
    # on the CPU an additive mask costs about nothing (and the wider head more), so the call keeps its mask
    assert not key_bias_folds({"query": query.half(), "key": key.half(), "value": value.half()})

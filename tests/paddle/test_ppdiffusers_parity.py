"""Parity with ppdiffusers' own ToMe port (a tomesd port) with use_rand=False: the same fixed partition.

ppdiffusers' ``apply_tome`` defaults to max_downsample=1 and reads the latent size from the UNet's first
positional argument, so the oracle calls are positional.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from ppdiffusers.patches.tomesd_patch_utils import bipartite_soft_matching_random2d

import tome_core.paddle as tome
from tome_core import bipartite_match, get_ops, merge, unmerge
from tome_tools.ppdiffusers_models import build_pipeline


def by_first_channel(x: np.ndarray) -> np.ndarray:
    """Tokens sorted by their first channel: compares merged sequences up to token order."""
    return np.stack([row[np.argsort(row[:, 0], kind="stable")] for row in x])


@pytest.mark.parametrize(
    "batch, h, w, sx, sy, ratio", [(2, 16, 16, 2, 2, 0.5), (1, 9, 7, 2, 2, 0.3), (3, 8, 12, 3, 2, 0.6), (2, 5, 6, 1, 2, 0.4)]
)
def test_merge_and_unmerge_equal_ppdiffusers(batch, h, w, sx, sy, ratio):
    rng = np.random.default_rng(h * w)
    metric = paddle.to_tensor(rng.standard_normal((batch, h * w, 16)).astype(np.float32))
    x = paddle.to_tensor(rng.standard_normal((batch, h * w, 8)).astype(np.float32))
    r = int(h * w * ratio)
    ref_merge, ref_unmerge = bipartite_soft_matching_random2d(metric, w, h, sx, sy, r, no_rand=True)
    match = bipartite_match(get_ops(metric), metric, h, w, sx, sy, r, None)
    ours, theirs = merge(x, match), ref_merge(x.clone())
    assert ours.shape == theirs.shape == [batch, h * w - r, 8]
    ours_np, theirs_np = ours.numpy(), theirs.numpy()
    np.testing.assert_allclose(by_first_channel(ours_np), by_first_channel(theirs_np), rtol=1e-5, atol=1e-6)
    # Unmerged sources come first in both, in the same (score) order.
    kept_src = h * w - r - (h // sy) * (w // sx)
    np.testing.assert_array_equal(ours_np[:, :kept_src], theirs_np[:, :kept_src])
    np.testing.assert_allclose(unmerge(ours, match).numpy(), ref_unmerge(theirs).numpy(), rtol=1e-5, atol=1e-6)


UNET_CASES = [
    dict(merge_attn=True, merge_crossattn=False, merge_mlp=False, max_downsample=1),
    dict(merge_attn=True, merge_crossattn=True, merge_mlp=True, max_downsample=1),
    dict(merge_attn=False, merge_crossattn=True, merge_mlp=False, max_downsample=2),
    dict(merge_attn=True, merge_crossattn=False, merge_mlp=True, max_downsample=2),
]


@pytest.mark.parametrize("options", UNET_CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_patched_unet_equals_ppdiffusers(unet, tiny_unet, inputs, call, options):
    tome.PPDIFFUSERS_APPLY_TOME(unet, ratio=0.5, use_rand=False, **options)
    reference = call(unet, inputs)
    assert np.abs(reference - call(tiny_unet, inputs)).max() > 1e-4  # the port really merged something here
    tome.patch(unet, ratio=0.5, use_rand=False, proportional_attn=False, **options)
    np.testing.assert_allclose(call(unet, inputs), reference, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(call(unet, inputs, keywords=True), reference, rtol=1e-4, atol=1e-5)


def test_controlnet_pipeline_equals_ppdiffusers():
    pipe = build_pipeline("controlnet")
    pipe.set_progress_bar_config(disable=True)
    paddle.seed(5)
    kwargs = dict(
        prompt="a photo of a cat", image=paddle.rand([1, 3, 64, 64]), height=64, width=64,
        num_inference_steps=2, guidance_scale=5.0, output_type="np",
    )  # fmt: skip

    def run():
        return pipe(**kwargs, generator=paddle.Generator().manual_seed(0)).images

    plain = run()
    tome.PPDIFFUSERS_APPLY_TOME(pipe, ratio=0.5, use_rand=False)
    reference = run()
    assert np.abs(reference - plain).max() > 1e-4
    tome.patch(pipe, ratio=0.5, max_downsample=1, use_rand=False, proportional_attn=False)
    assert len(tome.patched_models(pipe)) == 2  # UNet and ControlNet, like the port
    np.testing.assert_allclose(run(), reference, rtol=1e-4, atol=1e-5)

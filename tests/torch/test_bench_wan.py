"""``python -m tome_tools.bench --preset wan|tiny-wan``: Wan's video transformer through the bench's transformer and
video machinery, on the tiny config (seconds).

Oracles: the video latents and flow-matching noising recomputed in numpy, the token counts and rotary tables each
sub-layer receives (hooks added after the method's own), and the bench's refusals before anything is built."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from tome_tools import bench, bench_video
from tome_tools import bench_core

# tiny-wan's default: 9 frames -> 3 latent frames of 8x12 latents -> 3 grids of 4x6 tokens
LATENT_FRAMES, TOKENS = 3, 3 * 4 * 6
VIDEO_COLUMNS = {"fid@t/frame", "fid@t worst", "tdiff@t", "tdiff@t ratio", "motion err", "tdiff@loop ratio"}


@pytest.fixture(scope="module")
def runner():
    from tome_tools.diffusers_video_bench import Runner

    args = bench.parser().parse_args(["--preset", "tiny-wan", "--batch", "2", "--threads", "1"])
    args.options, args.variants = {}, {}
    bench_video.resolve(args, False)
    return Runner(args)


def test_frames_and_sizes_follow_wans_vae():
    assert bench_video.latent_frames("wan", 81) == 21 and bench_video.latent_frames("wan", 17) == 5
    assert bench_video.latent_frames("animatediff", 16) == 16
    assert bench_video.frame_size("wan", 480) == (480, 832)  # the released 480p size
    assert bench_video.frame_size("wan", 720) == (720, 1248)  # its aspect ratio, multiples of 16 px


def test_inputs_are_panning_video_latents_noised_by_flow_matching(runner):
    """``[B, C, F, H, W]`` at sigma 0.5: ``0.5 clean + 0.5 noise`` per latent frame, the text of umT5's 512 tokens,
    timestep 500 per batch entry; the grid ToMe sees is the frames' latents stacked in rows."""
    clean = np.moveaxis(bench_core.video_latents(2, LATENT_FRAMES, 4, 8, 12, seed=0), 1, 2)
    noise = np.moveaxis(np.random.default_rng(1).standard_normal((2, LATENT_FRAMES, 4, 8, 12)).astype("float32"), 1, 2)
    np.testing.assert_allclose(runner.sample_in.numpy(), 0.5 * clean + 0.5 * noise, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(runner.noise.numpy(), noise)
    assert runner.latent_hw == (LATENT_FRAMES * 8, 12)
    kwargs = runner.transformer_kwargs(runner.sample_in, runner.timestep)
    assert tuple(kwargs["encoder_hidden_states"].shape) == (2, 512, 16)
    assert kwargs["timestep"].tolist() == [500.0, 500.0]
    assert type(runner.scheduler).__name__ == "UniPCMultistepScheduler" and runner.scheduler.config.flow_shift == 3.0


def _sublayers(runner):
    """Every block's sub-layers, as ``(child name, module)``."""
    return [(child, getattr(block, child)) for block in runner.unet.blocks for child in ("attn1", "attn2", "ffn")]


def _tokens_and_rotary(child, args, kwargs):
    """(sub-layer, tokens of its input, rotary rows or None) of one sub-layer call."""
    rotary = args[3] if len(args) > 3 else None
    return child, args[0].shape[1], None if rotary is None else rotary[0].shape[1]


@pytest.mark.parametrize("options", [{}, {"blocks": [0]}, {"merge_crossattn": True, "merge_mlp": True, "mlp_ratio": 0.25}])
def test_oracle_gives_each_sublayer_the_token_counts_of_ours(runner, sublayer_calls, options):
    seen = lambda method, options: sublayer_calls(runner, method, options, lambda: _sublayers(runner), _tokens_and_rotary)
    plain, ours, oracle = seen("unpatched", {}), seen("ours", options), seen("oracle", options)
    assert ours == oracle and ours != plain
    assert ("attn1", TOKENS // 2, TOKENS // 2) in ours  # self-attention: half the clip, one rotary row per token
    assert all(tokens == TOKENS for _, tokens, _ in plain)


def test_oracle_keeps_the_rotary_rows_of_its_first_tokens_and_methods_leave_the_model_unpatched(runner):
    plain = runner.call()
    rows = []
    with runner.method("oracle", 0.5):
        handle = runner.unet.blocks[0].attn1.register_forward_pre_hook(lambda m, a, k: rows.append(a[3]), with_kwargs=True)
        runner.call()
        handle.remove()
    full = runner.unet.rope(runner.sample_in)
    for table, whole in zip(rows[0], full):
        torch.testing.assert_close(table, whole[:, : TOKENS // 2])
    for method in ("ours", "oracle"):
        runner.output(method, 0.5)
        torch.testing.assert_close(runner.call(), plain, rtol=0, atol=0)


def test_main_runs_tiny_wan_with_the_video_columns(capsys):
    rows = bench.main(["--preset", "tiny-wan", "--methods", "unpatched", "ours", "oracle", "--repeats", "1",
                       "--warmup", "0", "--steps", "2", "--threads", "1"])
    text = capsys.readouterr().out
    assert "tiny-wan 9 frames of 64x96px batch 2" in text and "motion err" in text
    assert [r.method for r in rows] == ["unpatched", "ours", "oracle"]
    for row in rows:
        assert set(row.metrics) == VIDEO_COLUMNS, row
        values = [row.median_s, row.fidelity_step, row.fidelity_sampled, *row.metrics.values()]
        assert all(math.isfinite(v) for v in values), row
    ours, oracle = rows[1], rows[2]
    assert 0 < ours.fidelity_step < 1 and 0 < ours.metrics["fid@t/frame"] <= ours.metrics["fid@t worst"]
    assert oracle.fidelity_step > 0 and oracle.fidelity_sampled > 0 and ours.fidelity_sampled > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "tiny-wan", "--frames", "8"], "--frames 8: --preset tiny-wan takes 4k + 1 frames"),
        (["--preset", "wan", "--frames", "1"], "from 5 (2 latent frames) to 4093: 5, 9, 13, ..."),
        (["--preset", "tiny-wan", "--frames", "129"], "to 125"),  # its 32 rotary positions
        (["--preset", "wan", "--backend", "paddle"], "the video presets run on torch, not --backend paddle"),
        (["--preset", "tiny-wan", "--resolution", "72"], "multiples of 16 px"),
        (["--preset", "tiny-wan", "--methods", "unpatched", "peer"], "no other ToMe implementation exists"),
        (["--preset", "tiny-wan", "--option", "frames_per_chunk=2"], "frames_per_chunk > 1 in --option"),
        (["--preset", "tiny-wan", "--variant", "c:frames_per_chunk=2"], "leave frames_per_chunk out"),
    ],
)
def test_bad_wan_arguments_fail_before_anything_is_built(monkeypatch, argv, message):
    from tome_tools import diffusers_video_bench

    monkeypatch.setattr(diffusers_video_bench, "build_video_transformer", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(SystemExit, match=re.escape(message)):
        bench.main(argv)

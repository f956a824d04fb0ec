"""The benchmark's video presets (tome_core.bench_video): metrics recomputed by brute force in numpy, inputs,
rows and argument errors, on the tiny AnimateDiff and SVD presets."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

from tome_core import bench, bench_video
from tome_core.config import ToMeConfig

TINY = ["--resolution", "64", "--repeats", "1", "--warmup", "0", "--threads", "1"]


def brute_force(output, reference, frame_axis):
    """Per-frame relative L2, mean |consecutive difference| and the relative L2 of the differences, by loops."""
    out = np.moveaxis(np.asarray(output, dtype=np.float64), frame_axis, 1)
    ref = np.moveaxis(np.asarray(reference, dtype=np.float64), frame_axis, 1)
    batch, frames = out.shape[:2]
    per_frame = []
    for f in range(frames):
        num = sum(((out[b, f] - ref[b, f]) ** 2).sum() for b in range(batch))
        den = sum((ref[b, f] ** 2).sum() for b in range(batch))
        per_frame.append(math.sqrt(num / den))

    def tdiff(x):
        total, count = 0.0, 0
        for b in range(batch):
            for f in range(frames - 1):
                total += np.abs(x[b, f + 1] - x[b, f]).sum()
                count += x[b, f].size
        return total / count

    d_out = np.stack([out[:, f + 1] - out[:, f] for f in range(frames - 1)], axis=1)
    d_ref = np.stack([ref[:, f + 1] - ref[:, f] for f in range(frames - 1)], axis=1)
    motion = math.sqrt(((d_out - d_ref) ** 2).sum() / (d_ref**2).sum())
    return per_frame, tdiff(out), tdiff(ref), motion


@pytest.mark.parametrize("frame_axis", [1, 2])
def test_video_metrics_match_a_brute_force_computation(frame_axis):
    rng = np.random.default_rng(0)
    shape = [2, 3, 5, 4, 6]  # batch 2, then the frames (5) on frame_axis among 3 channels x 4 x 6
    shape[frame_axis], shape[1 if frame_axis == 2 else 2] = 5, 3
    reference = rng.standard_normal(shape).astype("float32")
    output = (reference + 0.1 * rng.standard_normal(shape)).astype("float32")
    sampled, reference_sampled = 2 * output, reference
    per_frame, t_out, t_ref, motion = brute_force(output, reference, frame_axis)
    metrics = bench_video.video_metrics(output, reference, frame_axis, sampled, reference_sampled)
    assert metrics["fid@t/frame"] == pytest.approx(np.mean(per_frame), rel=1e-12)
    assert metrics["fid@t worst"] == pytest.approx(max(per_frame), rel=1e-12)
    assert metrics["tdiff@t"] == pytest.approx(t_out, rel=1e-12)
    assert metrics["tdiff@t ratio"] == pytest.approx(t_out / t_ref, rel=1e-12)
    assert metrics["motion err"] == pytest.approx(motion, rel=1e-12)
    assert metrics["tdiff@loop ratio"] == pytest.approx(brute_force(sampled, reference_sampled, frame_axis)[1] / t_ref, rel=1e-12)
    same = bench_video.video_metrics(reference, reference, frame_axis)
    assert same == {"fid@t/frame": 0.0, "fid@t worst": 0.0, "tdiff@t": t_ref, "tdiff@t ratio": 1.0, "motion err": 0.0}


def test_video_latents_pan_one_latent_pixel_per_frame():
    video = bench_video.video_latents(2, 5, 4, 8, 12, seed=0)
    assert video.shape == (2, 5, 4, 8, 12) and video.dtype == np.float32
    assert abs(video.mean()) < 1e-5 and abs(video.std() - 1) < 1e-4
    np.testing.assert_allclose(video[:, 1:, ..., :-1], video[:, :-1, ..., 1:], rtol=1e-6, atol=1e-6)
    assert not np.allclose(video[:, 1:], video[:, :-1])


def test_frame_size_keeps_the_presets_aspect_ratio():
    assert bench_video.frame_size("animatediff", 512) == (512, 512)
    assert bench_video.frame_size("svd", 256) == (256, 448)  # its default
    assert bench_video.frame_size("svd", 576) == (576, 1024)  # the released size
    assert bench_video.frame_size("tiny-svd", 64) == (64, 96)


def _run(capsys, preset, *extra):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # ratio 0 "merges no tokens"
        rows = bench.main(["--preset", preset, *TINY, *extra])
    return rows, capsys.readouterr().out


def test_tiny_animatediff_rows_metrics_and_json(tmp_path, capsys):
    out = tmp_path / "video.json"
    rows, text = _run(capsys, "tiny-animatediff", "--steps", "1", "--ratio", "0", "0.5", "--batch", "2", "--json", str(out))
    assert [r.method for r in rows] == ["unpatched", "ours", "oracle"] * 2  # the peer skipped, said why
    assert "4 frames of 64x64px batch 2" in text and "peer skipped: tomesd does not apply to video UNets" in text
    for row in rows:
        values = [row.fidelity_step, row.fidelity_sampled, *row.metrics.values()]
        assert all(math.isfinite(v) for v in values) and math.isfinite(row.speedup), row
        assert set(row.metrics) == {"fid@t/frame", "fid@t worst", "tdiff@t", "tdiff@t ratio", "motion err", "tdiff@loop ratio"}
        if row.method == "unpatched" or row.ratio == 0:  # ratio 0 merges and slices nothing: exact
            assert row.fidelity_step == 0 and row.metrics["fid@t worst"] == 0 and row.metrics["motion err"] == 0
            assert row.metrics["tdiff@t ratio"] == 1
        else:
            assert 0 < row.metrics["fid@t/frame"] <= row.metrics["fid@t worst"] < 1
    assert "tdiff@t ratio" in text and "motion err" in text
    saved = json.loads(out.read_text())
    assert saved["args"]["frames"] == 4 and saved["rows"][4]["metrics"]["fid@t worst"] > 0


def _attention_tokens(runner, name):
    """``{attention module: (sequences, tokens)}`` of each attn1 call with method ``name`` at ratio 0.5."""
    seen = {}

    def record(name):
        def hook(module, args, kwargs):
            seen.setdefault(name, tuple((args[0] if args else kwargs["hidden_states"]).shape[:2]))

        return hook

    with runner.method(name, 0.5):  # hooks added after the method's see what the attention really gets
        handles = [
            m.register_forward_pre_hook(record(n), with_kwargs=True)
            for n, m in runner.unet.named_modules() if n.endswith("attn1")
        ]
        try:
            runner.call()
        finally:
            for handle in handles:
                handle.remove()
    return seen


def test_svd_oracle_cuts_the_spatial_tokens_of_ours_per_frame_and_never_the_temporal_ones():
    from tome_core.adapters.diffusers_video_bench import Runner

    args = bench.parser().parse_args(["--preset", "tiny-svd", "--resolution", "64", "--batch", "1", "--frames", "3"])
    args.options, args.variants = {}, {}
    bench_video.resolve(args, False)
    runner = Runner(args)
    assert runner.latent_hw == (8, 12) and tuple(runner.sample_in.shape) == (1, 3, 4, 8, 12)
    plain, ours, oracle = (_attention_tokens(runner, m) for m in ("unpatched", "ours", "oracle"))
    assert ours == oracle and ours != plain
    assert any(tokens == 96 for _, tokens in plain.values()) and any("temporal" in name for name in plain)
    for name, (sequences, tokens) in plain.items():
        if "temporal" in name:
            assert tokens == 3 and ours[name] == plain[name]  # frames, untouched
        elif tokens == 96:  # the 8x12 level: every frame merged alike
            assert sequences == 3 and ours[name] == (3, 96 - 48)


@pytest.mark.skipif("frames_per_chunk" not in ToMeConfig.__dataclass_fields__, reason="cross-frame merging not in the core yet")
def test_a_cross_frame_variant_runs_beside_per_frame_merging(capsys):
    rows, text = _run(capsys, "tiny-animatediff", "--steps", "0", "--batch", "1", "--methods", "unpatched", "ours",
                      "--variant", "cross2:frames_per_chunk=2")
    cross = [r for r in rows if r.method == "ours:cross2"]
    assert len(cross) == 1 and "frames_per_chunk=2" in cross[0].note
    assert all(math.isfinite(v) for v in cross[0].metrics.values())
    assert cross[0].fidelity_step != [r for r in rows if r.method == "ours"][0].fidelity_step


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "tiny", "--frames", "4"], "only the video presets"),
        (["--preset", "tiny-animatediff", "--frames", "1"], "at least 2 frames"),
        (["--preset", "tiny-animatediff", "--frames", "40"], "at most 32"),
        (["--preset", "tiny-svd", "--methods", "unpatched", "peer"], "tomesd does not apply to video UNets"),
        (["--preset", "tiny-svd", "--stack", "deepcache"], "leave out --stack"),
        (["--preset", "tiny-svd", "--micro"], "leave out --micro"),
        (["--preset", "tiny-svd", "--backend", "paddle"], "run on torch"),
        (["--preset", "tiny-svd", "--resolution", "100"], "multiples of 64"),
        (["--preset", "tiny-animatediff", "--variant", "c:frames_per_chunk=4", "--variant-oracles", "c"], "cannot follow cross-frame"),
        (["--preset", "tiny-animatediff", "--option", "frames_per_chunk=4"], "--methods unpatched ours"),
    ],
)
def test_bad_video_arguments_fail_before_anything_is_built(monkeypatch, argv, message):
    from tome_core.adapters import diffusers_video_bench

    monkeypatch.setattr(diffusers_video_bench, "build_video_preset", lambda *a: pytest.fail("built a model"))
    with pytest.raises(SystemExit, match=message.replace("(", r"\(")):
        bench.main(argv)

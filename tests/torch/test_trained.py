"""The small trained models and the benchmark's sample fidelity (tome_tools.trained).

Oracles: a numpy PSNR and a brute-force SSIM for the metrics; the unpatched model for identical samples;
labels of real crops for the classifier; a second run of the training script for its reproducibility.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tome_core.torch as tome
from tome_tools import bench, trained
from tome_tools import diffusers_trained

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models")


@pytest.fixture(autouse=True)
def shipped_models(monkeypatch):
    """Tests run against an installed package: point it at this checkout's models/."""
    monkeypatch.setenv("TOME_CORE_MODELS", MODELS)


@pytest.fixture(scope="module", params=["trained-unet", "trained-dit", "trained-mmdit"])
def model(request):
    return diffusers_trained.load(os.path.join(MODELS, request.param))


@pytest.fixture(scope="module")
def classifier():
    return diffusers_trained.load_classifier(os.path.join(MODELS, "classifier"))


def numpy_psnr(a: np.ndarray, b: np.ndarray) -> float:
    a, b = (np.clip((x.astype(np.float64) + 1) / 2, 0, 1) for x in (a, b))
    return float(np.mean([10 * np.log10(1 / np.mean((x - y) ** 2)) for x, y in zip(a, b)]))


def brute_force_ssim(a: np.ndarray, b: np.ndarray, window: int = 7) -> float:
    """SSIM as Wang et al. define it, window by window: 7x7 uniform windows, sample (co)variances, constants
    (0.01 L)^2 and (0.03 L)^2 with L = 1, the mean over every full window and channel, then over images."""
    c1, c2, n = 0.01**2, 0.03**2, window * window
    scores = []
    for x, y in zip(*(np.clip((z.astype(np.float64) + 1) / 2, 0, 1) for z in (a, b))):
        values = []
        for channel in range(x.shape[0]):
            for i in range(x.shape[1] - window + 1):
                for j in range(x.shape[2] - window + 1):
                    p = x[channel, i : i + window, j : j + window].ravel()
                    q = y[channel, i : i + window, j : j + window].ravel()
                    mp, mq = p.mean(), q.mean()
                    vp, vq = p.var() * n / (n - 1), q.var() * n / (n - 1)
                    cov = ((p - mp) * (q - mq)).sum() / (n - 1)
                    values.append((2 * mp * mq + c1) * (2 * cov + c2) / ((mp**2 + mq**2 + c1) * (vp + vq + c2)))
        scores.append(np.mean(values))
    return float(np.mean(scores))


def test_metrics_equal_a_numpy_reference_on_known_inputs():
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (3, 3, 12, 12)).astype(np.float32)
    b = np.clip(a + rng.normal(0, 0.2, a.shape), -1, 1).astype(np.float32)
    assert trained.psnr(a, b) == pytest.approx(numpy_psnr(a, b), rel=1e-9)
    assert trained.ssim(a, b) == pytest.approx(brute_force_ssim(a, b), rel=1e-9)
    assert trained.psnr(a, a) == float("inf") and trained.ssim(a, a) == pytest.approx(1.0)
    # A uniform offset of 0.1 in [0, 1] units is exactly 20 dB.
    assert trained.psnr(np.zeros_like(a), np.full_like(a, 0.2)) == pytest.approx(20.0)
    assert trained.accuracy([0, 1, 2, 2], [0, 1, 1, 2]) == 0.75


def test_crops_are_seeded_labelled_and_in_range():
    images, labels = trained.crops(2, seed=3)
    again, _ = trained.crops(2, seed=3)
    np.testing.assert_array_equal(images, again)
    assert images.shape == (2 * len(trained.CLASSES), 3, 32, 32) and images.min() >= -1 and images.max() <= 1
    np.testing.assert_array_equal(labels, np.repeat(np.arange(len(trained.CLASSES)), 2))
    assert not np.array_equal(images, trained.crops(2, seed=4)[0])


def test_classifier_recognises_fresh_real_crops(classifier):
    images, labels = trained.crops(6, seed=123)  # crops it was not trained on
    assert trained.accuracy(diffusers_trained.predict(classifier, images), labels) >= 0.9  # chance: 1/8


def test_shipped_model_loads_with_from_pretrained_and_samples_deterministically(model):
    labels = trained.sample_labels(1)
    first = diffusers_trained.generate(model, labels, steps=3)
    np.testing.assert_array_equal(first, diffusers_trained.generate(model, labels, steps=3))
    assert first.shape == (len(labels), 3, 32, 32) and np.abs(first).max() <= 1
    assert trained.psnr(first, first) == float("inf")
    # Sample i starts from seed i whatever else is in the batch.
    np.testing.assert_allclose(diffusers_trained.generate(model, labels[:2], steps=3), first[:2], atol=1e-5)


def test_unpatched_samples_are_recognised_far_better_than_chance(model, classifier):
    labels = trained.sample_labels(2)
    samples = diffusers_trained.generate(model, labels, steps=10)
    assert trained.accuracy(diffusers_trained.predict(classifier, samples), labels) >= 0.5  # chance: 0.125


def test_ratio_zero_gives_identical_samples_and_merging_finite_psnr(model):
    labels = trained.sample_labels(1)
    reference = diffusers_trained.generate(model, labels, steps=4)
    tome.patch(model.model, ratio=0.0)
    try:
        assert trained.psnr(reference, diffusers_trained.generate(model, labels, steps=4)) == float("inf")
    finally:
        tome.remove(model.model)
    tome.patch(model.model, ratio=0.5)
    try:
        merged = trained.psnr(reference, diffusers_trained.generate(model, labels, steps=4))
    finally:
        tome.remove(model.model)
    assert 10 < merged < float("inf")


def test_training_script_is_reproducible_and_prints_its_loss_curve(tmp_path, capsys):
    from tome_tools import train

    args = ["--steps", "2", "--batch", "2", "--per-class", "1", "--threads", "1"]
    for kind in ("unet", "mmdit"):
        for name in ("a", "b"):
            train.main([kind, "--out", str(tmp_path / kind / name), *args])
        assert "step     2/2  loss" in capsys.readouterr().out
        a, b = (diffusers_trained.load(str(tmp_path / kind / name)) for name in ("a", "b"))
        for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(a.conditioning, b.conditioning, rtol=0, atol=0)
        assert [step for step, _ in a.info["training"]["loss_curve"]] == [2] and a.info["kind"] == kind


def test_bench_reports_sample_fidelity_for_every_method_on_a_trained_preset():
    rows = bench.main([
        "--preset", "trained-dit", "--repeats", "0", "--steps", "0", "--samples-per-class", "1",
        "--sample-steps", "3", "--methods", "unpatched", "ours", "oracle", "--variant", "kv:mode=auto",
    ])
    by = {row.method: row for row in rows}
    assert by["unpatched"].psnr == float("inf") and by["unpatched"].ssim == pytest.approx(1.0)
    for method in ("ours", "ours:kv", "oracle"):
        assert 0 < by[method].psnr < float("inf") and by[method].ssim < 1 and 0 <= by[method].accuracy <= 1
    assert by["ours:kv"].note == "mode=kv cell 2x2 (L1)" and by["ours:kv"].ratio == 0.75
    assert all(row.resolution == 32 for row in rows)


def test_trained_preset_outside_a_checkout_says_where_the_models_are(monkeypatch, tmp_path):
    monkeypatch.setenv("TOME_CORE_MODELS", str(tmp_path))
    with pytest.raises(SystemExit, match="ships with the repository.*TOME_CORE_MODELS"):
        bench.main(["--preset", "trained-unet", "--repeats", "0"])

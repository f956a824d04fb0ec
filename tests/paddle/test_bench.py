"""The paddle side of the benchmark: its numbers are computed correctly (independent recomputation), and
``python -m tome_tools.bench --backend paddle`` runs on a small preset.

The framework-free parts (formulas, latents, option parsing) are tested in tests/torch/test_bench.py.
No ``--plot`` here: matplotlib is not part of the paddle session.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tome_tools import bench
from tome_tools import bench_core
from tome_tools.ppdiffusers_bench import Runner, micro


@pytest.fixture(scope="module")
def runner():
    args = bench.parser().parse_args(["--backend", "paddle", "--preset", "tiny", "--resolution", "128"])
    args.options = {}
    return Runner(args)


def _attn1_token_counts(runner, name, ratio):
    counts = []
    with runner.method(name, ratio):  # hooks added after the method's run after it: they see its tokens
        helpers = [
            m.register_forward_pre_hook(lambda layer, inputs: counts.append(int(inputs[0].shape[1])))
            for n, m in runner.unet.named_sublayers()
            if n.endswith("attn1")
        ]
        runner.call()
    for helper in helpers:
        helper.remove()
    return counts


def test_oracle_runs_attention_on_the_same_token_counts_as_tome(runner):
    ours, oracle = _attn1_token_counts(runner, "ours", 0.5), _attn1_token_counts(runner, "oracle", 0.5)
    plain = _attn1_token_counts(runner, "unpatched", 0.5)
    assert ours == oracle and ours != plain
    # 16x16 latent: the finest level's 256 tokens -> 128, the coarser levels (8x8, mid block 4x4) untouched.
    assert sorted(set(plain)) == [16, 64, 256]
    assert [128 if c == 256 else c for c in plain] == oracle


def test_methods_leave_the_model_unpatched_and_fidelity_matches_recomputation(runner):
    plain = runner.call()
    outputs = {name: runner.output(name, 0.5) for name in ("ours", "peer", "oracle")}
    np.testing.assert_array_equal(runner.output("unpatched", 0.0), plain)
    np.testing.assert_array_equal(runner.call(), plain)  # nothing left attached
    assert not any(type(m).__name__.startswith("ToMe") or "_tome_info" in m.__dict__ for m in runner.unet.sublayers())
    for name, out in outputs.items():
        expected = float(np.linalg.norm(out.astype(np.float64) - plain) / np.linalg.norm(plain.astype(np.float64)))
        assert bench_core.relative_l2(out, plain) == pytest.approx(expected) and expected > 0, name
    np.testing.assert_array_equal(runner.output("oracle", 0.0), plain)  # dropping no tokens changes nothing


def test_micro_matches_ppdiffusers_builtin_and_reports_its_ratio():
    result = micro(height=16, width=16, channels=32, repeats=2)
    assert result["identical_outputs"] is True and result["ops"] is None
    assert result["shape"] == [2, 256, 32]
    assert result["time_ratio"] == pytest.approx(result["median_ms"]["ours"] / result["median_ms"]["ppdiffusers"])


def test_main_on_the_tiny_preset_writes_table_and_json(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    rows = bench.main(
        ["--backend", "paddle", "--preset", "tiny", "--resolution", "64", "--repeats", "1", "--warmup", "0",
         "--steps", "1", "--ratio", "0.3", "0.6", "--json", str(out_json), "--variant", "plain:proportional_attn=False"]
    )
    text = capsys.readouterr().out
    assert [r.method for r in rows[:5]] == ["unpatched", "ours", "ours:plain", "peer", "oracle"] and len(rows) == 10
    for row in rows:
        assert len(row.times_s) == 1 and row.median_s == row.times_s[0]
        if row.method == "unpatched":
            assert row.speedup == 1.0 and row.fidelity_step == 0.0
        if row.method == "oracle":  # by definition, unless timing noise made the oracle no faster (NaN)
            assert np.isnan(row.oracle_share) or row.oracle_share == pytest.approx(1.0)
        if row.method in ("ours", "ours:plain", "peer"):
            assert row.fidelity_step > 0 and row.fidelity_sampled > 0
        unpatched = next(r for r in rows if r.ratio == row.ratio and r.method == "unpatched")
        assert row.speedup == pytest.approx(unpatched.median_s / row.median_s)
    assert "oracle share" in text and "ours:plain" in text and "paddle tiny 64px" in text
    saved = json.loads(out_json.read_text())
    assert len(saved["rows"]) == 10 and saved["rows"][2]["method"] == "ours:plain"
    assert saved["args"]["backend"] == "paddle"
    variant = [r for r in rows if r.method == "ours:plain"]
    default = [r for r in rows if r.method == "ours"]
    assert all(p.fidelity_step != q.fidelity_step for p, q in zip(variant, default))  # the variant really differs


ARRANGEMENTS = {
    "kv": {"mode": "kv"},
    "kvl": {"mode": "kv", "matching": "cell", "level_cells": {1: 4, 2: 2}, "max_downsample": 2},
    "q": {"mode": "queries"},
}


@pytest.mark.parametrize(
    "variant, expected",
    [
        ("kv", {(256, 128), (64, 64), (16, 16)}),
        ("kvl", {(256, 16), (64, 16), (16, 16)}),  # 4x4 cells at level 1, 2x2 at level 2
        ("q", {(128, 256), (64, 64), (16, 16)}),
    ],
)
def test_the_oracle_of_kv_and_queries_gives_attention_the_token_counts_of_ours(runner, variant, expected):
    """(queries, keys) of every self-attention under the oracle of a kv / queries variant, read at attn1's
    to_q and to_k (paddle's hooks do not see keyword arguments; the oracle passes keys/values by keyword)."""
    runner.args.variants = ARRANGEMENTS
    queries, keys = [], []
    try:
        with runner.method(f"oracle:{variant}", 0.5):
            helpers = []
            for n, m in runner.unet.named_sublayers():
                if n.endswith("attn1"):
                    helpers.append(m.to_q.register_forward_pre_hook(lambda layer, inputs: queries.append(int(inputs[0].shape[1]))))
                    helpers.append(m.to_k.register_forward_pre_hook(lambda layer, inputs: keys.append(int(inputs[0].shape[1]))))
            out = runner.call()
        for helper in helpers:
            helper.remove()
    finally:
        runner.args.variants = {}
    assert set(zip(queries, keys)) == expected
    assert out.shape == runner.call().shape and not any("forward" in m.__dict__ for m in runner.unet.sublayers())

"""The benchmark: its numbers are computed correctly (independent recomputation), and it runs on a small preset."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tome_core import bench
from tome_core.adapters.diffusers_bench import Runner, count_ops, micro


def test_relative_l2_and_oracle_share_formulas():
    a, b = np.array([3.0, 4.0]), np.array([0.0, 8.0])
    assert bench.relative_l2(a, b) == pytest.approx(5.0 / 8.0)
    assert bench.oracle_share(10.0, 7.0, 4.0) == pytest.approx(0.5)  # saved 3 of the oracle's 6
    assert np.isnan(bench.oracle_share(10.0, 7.0, 11.0))  # the oracle saved nothing: no share to speak of


def test_image_like_latents_are_normalised_and_spatially_smooth():
    x = bench.image_like_latents(2, 4, 32, 48, seed=0)
    assert x.shape == (2, 4, 32, 48) and x.dtype == np.float32
    assert abs(x.mean()) < 1e-5 and abs(x.std() - 1) < 1e-4
    neighbour = np.corrcoef(x[..., :, 1:].ravel(), x[..., :, :-1].ravel())[0, 1]
    white = np.random.default_rng(0).standard_normal(x.shape)
    assert neighbour > 0.7 > abs(np.corrcoef(white[..., 1:].ravel(), white[..., :-1].ravel())[0, 1])
    np.testing.assert_array_equal(x, bench.image_like_latents(2, 4, 32, 48, seed=0))


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable high-water mark")
def test_peak_memory_restarts_at_the_current_size_and_sees_what_the_call_adds():
    """The fresh-process memory helper's arithmetic: an earlier, larger peak is forgotten (it would hide the
    call's peak under it), a new allocation counts."""
    earlier = np.ones(160 * 2**20 // 8)  # 160 MB, written (resident), then returned to the system
    del earlier
    before = bench._restart_peak_kb()
    call = np.ones(40 * 2**20 // 8)  # 40 MB
    added_mb = (bench._peak_kb() - before) / 1024
    del call
    assert 35 < added_mb < 150


def test_variant_options_parse_into_named_option_sets():
    assert bench.variant_options(["prop:proportional_attn=True,ratio=0.3"]) == {
        "prop": {"proportional_attn": True, "ratio": 0.3}
    }
    with pytest.raises(ValueError, match="NAME:OPT=VAL"):
        bench.variant_options(["proportional_attn=True"])


def test_parse_options_reads_python_literals():
    assert bench.parse_options(["use_rand=False", "sx=3", "ratio=0.25"]) == {"use_rand": False, "sx": 3, "ratio": 0.25}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        bench.parse_options(["use_rand"])


@pytest.fixture(scope="module")
def runner():
    args = bench.parser().parse_args(["--preset", "tiny", "--resolution", "128"])
    args.options = {}
    return Runner(args)


def test_oracle_runs_attention_on_the_same_token_counts_as_tome(runner):
    seen = {}
    for name in ("ours", "oracle"):
        counts = []
        with runner.method(name, 0.5):  # hooks added after the method's run after it: they see its tokens
            handles = [
                m.register_forward_pre_hook(lambda m, args, kw: counts.append(args[0].shape[1]), with_kwargs=True)
                for n, m in runner.unet.named_modules()
                if n.endswith("attn1")
            ]
            runner.call()
        for h in handles:
            h.remove()
        seen[name] = counts
    assert seen["ours"] == seen["oracle"] and 128 in seen["ours"]  # 16x16 latent: 256 tokens -> 128


def test_methods_leave_the_model_unpatched_and_fidelity_matches_recomputation(runner):
    plain = runner.call().numpy()
    ours = runner.output("ours", 0.5)
    np.testing.assert_array_equal(runner.output("unpatched", 0.0), plain)
    np.testing.assert_array_equal(runner.call().numpy(), plain)  # nothing left attached
    assert bench.relative_l2(ours, plain) == pytest.approx(
        float(np.linalg.norm(ours.astype(np.float64) - plain) / np.linalg.norm(plain.astype(np.float64)))
    )
    assert bench.relative_l2(ours, plain) > 0


def test_micro_counts_ops_and_reports_identical_outputs():
    result = micro(height=16, width=16, channels=32, repeats=2)
    assert result["identical_outputs"] is True
    assert result["ops"]["ours"] < result["ops"]["tomesd"]
    assert count_ops(lambda: torch.ones(3) + 1) == 2


def test_main_on_the_tiny_preset_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rows = bench.main(
        ["--preset", "tiny", "--resolution", "64", "--repeats", "1", "--warmup", "0", "--steps", "1",
         "--ratio", "0.3", "0.6", "--json", str(out_json), "--plot", str(out_png),
         "--variant", "plain:proportional_attn=False"]
    )
    text = capsys.readouterr().out
    assert [r.method for r in rows[:5]] == ["unpatched", "ours", "ours:plain", "peer", "oracle"] and len(rows) == 10
    for row in rows:
        if row.method == "unpatched":
            assert row.speedup == 1.0 and row.fidelity_step == 0.0
        if row.method == "oracle":  # by definition, unless timing noise made the oracle no faster (NaN)
            assert np.isnan(row.oracle_share) or row.oracle_share == pytest.approx(1.0)
        if row.method in ("ours", "ours:plain", "peer"):
            assert row.fidelity_step > 0 and row.fidelity_sampled > 0
    assert "oracle share" in text and "ours" in text
    saved = json.loads(out_json.read_text())
    assert len(saved["rows"]) == 10 and saved["rows"][2]["method"] == "ours:plain"
    variant = [r for r in rows if r.method == "ours:plain"]
    default = [r for r in rows if r.method == "ours"]
    assert all(p.fidelity_step != q.fidelity_step for p, q in zip(variant, default))  # the variant really differs
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- diffusion transformers ------------------------------------------------------------------------------
TRANSFORMER_PRESETS = ("tiny-sd3", "tiny-flux", "tiny-pixart")


@pytest.fixture(scope="module", params=TRANSFORMER_PRESETS)
def transformer_runner(request):
    args = bench.parser().parse_args(["--preset", request.param, "--resolution", "64", "--batch", "2", "--text-tokens", "5"])
    args.options = {}
    return Runner(args)


def _sublayer_tokens(runner, name, ratio, options=None):
    """Per merged sub-layer call: (tokens of its hidden_states, tokens of its encoder_hidden_states or None),
    counted by hooks added after the method's own (so they see what the sub-layer really gets)."""
    from tome_core import driver
    from tome_core.adapters.diffusers import FRAMEWORK

    runner.options = dict(options or {})
    seen = []

    def count(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        context = kwargs.get("encoder_hidden_states")
        seen.append((x.shape[1], None if context is None else context.shape[1]))

    try:
        with runner.method(name, ratio):
            handles = [
                getattr(block, sublayer.child).register_forward_pre_hook(count, with_kwargs=True)
                for block, family in driver.blocks_of(FRAMEWORK, runner.unet)
                for sublayer in family.sublayers
                if sublayer.kind == "attn" and getattr(block, sublayer.child, None) is not None
            ]
            runner.call()
        for handle in handles:
            handle.remove()
    finally:
        runner.options = {}
    return seen


@pytest.mark.parametrize("options", [{}, {"blocks": [0]}, {"merge_mlp": True}])
def test_transformer_oracle_runs_on_the_token_counts_of_tome_with_text_untouched(transformer_runner, options):
    plain = _sublayer_tokens(transformer_runner, "unpatched", 0.5)
    ours = _sublayer_tokens(transformer_runner, "ours", 0.5, options)
    oracle = _sublayer_tokens(transformer_runner, "oracle", 0.5, options)
    assert ours == oracle and ours != plain
    for (tokens, text), (full, full_text) in zip(ours, plain):
        assert text == full_text  # the text stream keeps every token
    if options.get("blocks") == [0]:
        assert ours[1:] == plain[1:]  # only block 0 merges


def test_transformer_oracle_keeps_flux_rotary_positions_of_the_kept_tokens():
    """The oracle's rotary tables have one row per token the attention sees: text rows, then the kept image
    tokens' own rows."""
    args = bench.parser().parse_args(["--preset", "tiny-flux", "--resolution", "64", "--batch", "1", "--text-tokens", "3"])
    args.options = {}
    runner = Runner(args)
    rows = []
    attention = runner.unet.single_transformer_blocks[0].attn
    with runner.method("oracle", 0.5):
        handle = attention.register_forward_pre_hook(
            lambda m, a, kw: rows.append((kw["hidden_states"].shape[1], kw["image_rotary_emb"][0].shape[0])), with_kwargs=True
        )
        runner.call()
        handle.remove()
    assert rows == [(3 + 8, 3 + 8)]  # 64 px: 8x8 latent, 4x4 packed tokens, 8 kept


def test_transformer_methods_leave_the_model_unpatched(transformer_runner):
    runner = transformer_runner
    plain = runner.call().numpy()
    assert np.isfinite(plain).all()
    for name in ("ours", "oracle", "unpatched"):
        out = runner.output(name, 0.5)
        assert np.isfinite(out).all() and out.shape == plain.shape
        np.testing.assert_array_equal(runner.call().numpy(), plain)  # nothing left attached
    assert bench.relative_l2(runner.output("ours", 0.5), plain) > 0
    np.testing.assert_array_equal(runner.output("oracle", 0.0), plain)  # dropping no tokens changes nothing


def test_transformer_inputs_follow_the_pipelines():
    from tome_core.bench_runner import flux_mu, pack_latents, packed_ids

    x = np.arange(2 * 3 * 4 * 6, dtype="float32").reshape(2, 3, 4, 6)
    packed = pack_latents(x)
    assert packed.shape == (2, 6, 12)
    np.testing.assert_array_equal(packed[1, 4], x[1, :, 2:4, 2:4].reshape(3, 4).ravel())  # token (1, 1): C x 2 x 2
    assert packed_ids(2, 3).tolist()[-1] == [0, 1, 2]
    assert flux_mu(256) == pytest.approx(0.5) and flux_mu(4096) == pytest.approx(1.15)


@pytest.mark.parametrize("preset", TRANSFORMER_PRESETS)
def test_main_on_tiny_transformers_writes_json_rows(preset, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    rows = bench.main(
        ["--preset", preset, "--resolution", "64", "--repeats", "1", "--warmup", "0", "--steps", "2",
         "--text-tokens", "5", "--json", str(out_json), "--variant", "rb2:reuse_blocks=2", "--variant", "rs2:reuse_steps=2"]
    )
    text = capsys.readouterr().out
    assert [r.method for r in rows] == ["unpatched", "ours", "ours:rb2", "ours:rs2", "oracle"]
    assert "peer skipped: no other ToMe implementation exists for diffusion transformers" in text
    for row in rows:
        assert np.isfinite(row.median_s) and np.isfinite(row.fidelity_sampled)
        if row.method != "unpatched":
            assert row.fidelity_step > 0 and row.fidelity_sampled > 0
    by_method = {r.method: r for r in rows}
    assert by_method["ours:rs2"].fidelity_step == by_method["ours"].fidelity_step  # one call: nothing to reuse
    assert by_method["ours:rs2"].fidelity_sampled != by_method["ours"].fidelity_sampled  # the loop's 2nd step reuses
    saved = json.loads(out_json.read_text())
    assert [r["method"] for r in saved["rows"]] == [r.method for r in rows]


def test_micro_transformer_reports_block_times_and_overhead_shares(capsys):
    result = bench.main(["--micro", "--preset", "tiny-flux", "--resolution", "64", "--batch", "1", "--repeats", "1",
                         "--warmup", "0", "--text-tokens", "3"])
    assert [b["block"] for b in result["blocks"]] == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    for block in result["blocks"]:
        assert block["kept"] == 8 and block["merged_sublayers"] == ["attn"]
        assert set(block["median_ms"]) == {"block_unpatched", "block_ours", "block_ours_reused_match", "block_ours_plain_softmax", "block_oracle", "match", "merge_unmerge"}
        shares = block["share_of_block"]
        assert shares["reuse_1"] > shares["reuse_2"] > shares["reuse_4"] > 0
    assert json.loads(capsys.readouterr().out)["preset"] == "tiny-flux"

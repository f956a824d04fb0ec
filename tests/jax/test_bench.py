"""The jax side of the benchmark: its numbers are computed correctly (independent recomputation), compilation
never lands in a timed call, and ``python -m tome_tools.bench --backend jax`` runs on a small preset.

The framework-free parts (formulas, latents, option parsing) are tested in tests/torch/test_bench.py. The
bench builds "tiny" cut to two levels here (half the compilation time); every test uses the same resolution
and ratio, so the compiled calls are shared (jax caches them per model, interceptor and shapes).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tome_tools import bench
from tome_tools import bench_core
from tome_tools import flax_bench
from tome_tools.flax_models import TWO_LEVELS, build_unet

ARGS = ["--backend", "jax", "--preset", "tiny", "--resolution", "64"]
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax records one per XLA compilation


@pytest.fixture(scope="module", autouse=True)
def two_level_tiny():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flax_bench, "build_unet", lambda preset: build_unet(preset, **TWO_LEVELS))
        yield


@pytest.fixture(scope="module")
def runner():
    args = bench.parser().parse_args(ARGS)
    args.options = {}
    return flax_bench.Runner(args)


def test_a_method_compiles_on_entry_and_its_calls_never_compile(runner):
    compiles = []

    def listen(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(duration)

    jax.clear_caches()  # under xdist another test may have entered 'ours' on this worker already
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        with runner.method("ours", 0.5):
            on_entry = len(compiles)
            runner.call()  # the warm-up round: the timestep's dtype conversion compiles on first use
        warm = len(compiles)
        with runner.method("ours", 0.5):
            runner.call()
            runner.call()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert on_entry >= 1 and warm - on_entry <= 1 and len(compiles) == warm


def _attn1_counts(runner, attn1_tokens, name):
    """Tokens reaching each self-attention under method ``name`` at ratio 0.5, from an abstract trace."""
    with runner.method(name, 0.5):
        seen = attn1_tokens(
            flax_bench.unet_output, runner.model, runner.interceptor, runner.params, runner.sample_in,
            runner.timestep, runner.text, runner.added,
        )
    return [tokens for _, _, tokens in seen]


def test_oracle_runs_attention_on_the_same_token_counts_as_tome(runner, attn1_tokens):
    ours, oracle = _attn1_counts(runner, attn1_tokens, "ours"), _attn1_counts(runner, attn1_tokens, "oracle")
    plain = _attn1_counts(runner, attn1_tokens, "unpatched")
    assert ours == oracle and ours != plain
    # 8x8 latent: the finest level's 64 tokens -> 32; the middle block (4x4, level 2) is not merged.
    assert sorted(set(plain)) == [16, 64]
    assert [32 if c == 64 else c for c in plain] == oracle


def test_methods_leave_the_model_unpatched_and_fidelity_matches_recomputation(runner):
    plain = np.asarray(runner.call())
    outputs = {name: runner.output(name, 0.5) for name in ("ours", "oracle")}
    assert runner.model is runner.unet and runner.interceptor is None
    np.testing.assert_array_equal(runner.output("unpatched", 0.0), plain)
    np.testing.assert_array_equal(np.asarray(runner.call()), plain)  # nothing left in place
    for name, out in outputs.items():
        expected = float(np.linalg.norm(out.astype(np.float64) - plain) / np.linalg.norm(plain.astype(np.float64)))
        assert bench_core.relative_l2(out, plain) == pytest.approx(expected) and expected > 0, name
    with pytest.raises(ValueError, match="no other ToMe implementation exists for Flax"):
        with runner.method("peer", 0.5):
            pass


def test_model_folder_loads_a_saved_unet_with_or_without_the_pipeline_layout(runner, tmp_path):
    runner.unet.save_pretrained(tmp_path / "unet", params=runner.params)
    for folder in (tmp_path, tmp_path / "unet"):
        loading = object.__new__(flax_bench.Runner)  # only its loader: no inputs, no compilation
        loading.args = bench.parser().parse_args([*ARGS, "--model", str(folder)])
        unet = loading.load_unet()
        assert unet == runner.unet and hash(unet) == hash(runner.unet)  # hashable: a static jit argument
        for got, want in zip(jax.tree_util.tree_leaves(loading.params), jax.tree_util.tree_leaves(runner.params)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_threads_after_jax_started_is_a_clear_error(runner, monkeypatch):
    monkeypatch.delenv("PJRT_NPROC", raising=False)  # the runner fixture has started jax's backend
    args = bench.parser().parse_args([*ARGS, "--threads", "3"])
    with pytest.raises(RuntimeError, match="--threads 3: jax's CPU backend is already running.*PJRT_NPROC=3"):
        flax_bench.Runner(args)


def test_micro_matches_the_numpy_backend_and_counts_primitives():
    result = flax_bench.micro(height=16, width=16, channels=32, repeats=2)
    assert result["identical_outputs"] is True and result["time_ratio"] is None
    assert result["shape"] == [2, 256, 32] and result["ops"]["ours"] > 10
    ones = jnp.ones(3)
    assert flax_bench.count_ops(lambda x: jnp.sin(x) + 1, ones) == 2
    assert flax_bench.count_ops(lambda x: jax.jit(lambda y: jnp.sin(y) * 2)(x) + 1, ones) == 3  # nested: contents


def test_main_on_the_tiny_preset_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rows = bench.main(
        [*ARGS, "--repeats", "1", "--warmup", "0", "--steps", "1", "--ratio", "0.5",
         "--json", str(out_json), "--plot", str(out_png)]
    )
    text = capsys.readouterr().out
    assert [r.method for r in rows] == ["unpatched", "ours", "oracle"]
    assert "peer skipped: no other ToMe implementation exists for Flax" in text
    for row in rows:
        assert len(row.times_s) == 1 and row.median_s == row.times_s[0]
        assert row.speedup == pytest.approx(rows[0].median_s / row.median_s)
        if row.method == "unpatched":
            assert row.fidelity_step == 0.0 and row.fidelity_sampled == 0.0
        else:
            assert row.fidelity_step > 0 and row.fidelity_sampled > 0
    assert "oracle share" in text and "jax tiny 64px" in text
    saved = json.loads(out_json.read_text())
    assert saved["args"]["backend"] == "jax" and [r["method"] for r in saved["rows"]] == ["unpatched", "ours", "oracle"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "variant, options, expected",
    [
        ("kv", {"mode": "kv"}, {(64, 32), (16, 16)}),  # 8x8 latent: level 1's 64 keys -> 32, queries all
        ("kvc", {"mode": "kv", "matching": "cell", "sx": 4, "sy": 4}, {(64, 4), (16, 16)}),
        ("q", {"mode": "queries"}, {(32, 64), (16, 16)}),
    ],
)
def test_the_oracle_of_kv_and_queries_gives_attention_the_token_counts_of_ours(runner, variant, options, expected):
    """(queries, keys) of every self-attention under the oracle of a kv / queries variant, read at attn1's
    to_q and to_k in an abstract trace."""
    import flax.linen as nn

    seen = {"to_q": [], "to_k": []}

    def spy(next_fun, call_args, call_kwargs, context):
        module = context.module
        if context.method_name == "__call__" and module.name in seen and module.parent.name == "attn1":
            seen[module.name].append(int(call_args[0].shape[1]))
        return next_fun(*call_args, **call_kwargs)

    runner.args.variants = {variant: options}
    try:
        with runner.method(f"oracle:{variant}", 0.5):
            with nn.intercept_methods(spy):
                jax.eval_shape(
                    lambda: flax_bench.unet_output(runner.model, runner.interceptor, runner.params, runner.sample_in,
                                                   runner.timestep, runner.text, runner.added)
                )
            out = np.asarray(runner.call())
    finally:
        runner.args.variants = {}
    assert set(zip(seen["to_q"], seen["to_k"])) == expected
    assert out.shape == np.asarray(runner.call()).shape and np.isfinite(out).all()

"""The benchmark: its numbers are computed correctly (independent recomputation), and it runs on a small preset
(image, transformer and video presets)."""

from __future__ import annotations

import json
import math
import os
import warnings

import numpy as np
import pytest
import torch

from tome_tools import bench, bench_video
from tome_tools import bench_core
from tome_core.config import ToMeConfig
from tome_core.models.families import child_at
from tome_tools.diffusers_bench import Runner, SdpaCalls, count_ops, micro

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models")


@pytest.fixture(autouse=True)
def checkout_models(monkeypatch):
    """The trained models ship with the checkout, not with the installed package that nox tests."""
    monkeypatch.setenv("TOME_CORE_MODELS", MODELS)


def test_relative_l2_and_oracle_share_formulas():
    a, b = np.array([3.0, 4.0]), np.array([0.0, 8.0])
    assert bench_core.relative_l2(a, b) == pytest.approx(5.0 / 8.0)
    assert bench_core.oracle_share(10.0, 7.0, 4.0) == pytest.approx(0.5)  # saved 3 of the oracle's 6
    assert np.isnan(bench_core.oracle_share(10.0, 7.0, 11.0))  # the oracle saved nothing: no share to speak of


def test_image_like_latents_are_normalised_and_spatially_smooth():
    x = bench_core.image_like_latents(2, 4, 32, 48, seed=0)
    assert x.shape == (2, 4, 32, 48) and x.dtype == np.float32
    assert abs(x.mean()) < 1e-5 and abs(x.std() - 1) < 1e-4
    neighbour = np.corrcoef(x[..., :, 1:].ravel(), x[..., :, :-1].ravel())[0, 1]
    white = np.random.default_rng(0).standard_normal(x.shape)
    assert neighbour > 0.7 > abs(np.corrcoef(white[..., 1:].ravel(), white[..., :-1].ravel())[0, 1])
    np.testing.assert_array_equal(x, bench_core.image_like_latents(2, 4, 32, 48, seed=0))


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable high-water mark")
def test_peak_memory_restarts_at_the_current_size_and_sees_what_the_call_adds():
    """The fresh-process memory helper's arithmetic: an earlier, larger peak is forgotten (it would hide the
    call's peak under it), a new allocation counts."""
    earlier = np.ones(160 * 2**20 // 8)  # 160 MB, written (resident), then returned to the system
    del earlier
    before = bench_core._restart_peak_kb()
    call = np.ones(40 * 2**20 // 8)  # 40 MB
    added_mb = (bench_core._peak_kb() - before) / 1024
    del call
    assert 35 < added_mb < 150


def test_tensor_peak_counts_the_bytes_held_at_once_and_what_stays():
    """Brute force: float32 tensors of known sizes, allocated and freed in a known order."""
    from tome_tools.diffusers_bench import tensor_peak_mib

    kept = []

    def call():
        a = torch.ones(1000, 250)  # 1 MB
        b = torch.ones(1000, 500)  # 2 MB: 3 MB held
        del a
        c = torch.ones(1000, 250)  # b, c: 3 MB
        kept.append(torch.ones(1000, 125))  # b, c and 0.5 MB that stays: the peak, 3.5 MB
        return b.sum() + c.sum()

    peak, retained = tensor_peak_mib(call)
    assert peak == pytest.approx(3.5e6 / 2**20, abs=1e-3)
    assert retained == pytest.approx(0.5e6 / 2**20, abs=1e-3)
    assert tensor_peak_mib(lambda: None) == (0, 0)


def test_variant_options_parse_into_named_option_sets():
    assert bench_core.variant_options(["prop:proportional_attn=True,ratio=0.3"]) == {
        "prop": {"proportional_attn": True, "ratio": 0.3}
    }
    with pytest.raises(ValueError, match="NAME:OPT=VAL"):
        bench_core.variant_options(["proportional_attn=True"])


def test_parse_options_reads_python_literals():
    assert bench_core.parse_options(["use_rand=False", "sx=3", "ratio=0.25"]) == {"use_rand": False, "sx": 3, "ratio": 0.25}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        bench_core.parse_options(["use_rand"])


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
    assert bench_core.relative_l2(ours, plain) == pytest.approx(
        float(np.linalg.norm(ours.astype(np.float64) - plain) / np.linalg.norm(plain.astype(np.float64)))
    )
    assert bench_core.relative_l2(ours, plain) > 0


def test_micro_counts_ops_and_reports_identical_outputs():
    result = micro(height=16, width=16, channels=32, repeats=2)
    assert result["identical_outputs"] is True
    assert result["ops"]["ours"] < result["ops"]["tomesd"]
    assert count_ops(lambda: torch.ones(3) + 1) == 2
    # cell matching: 2x2 average pooling (checked against avg_pool2d), a few ops, no similarity
    assert result["cell_equals_avg_pool2d"] is True
    assert result["ops"]["cell_merge"] < result["ops"]["cell_merge_unmerge"] < result["ops"]["ours"]
    assert set(result["cell_vs_tomesd"]) == {"cell_merge", "cell_merge_unmerge", "ours"}


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


def _attention_modules(runner):
    """Every merged self-attention sub-layer of the runner's model, as ``(child name, module)``."""
    from tome_core.models.model_tree import blocks_of
    from tome_core.adapters.diffusers import FRAMEWORK

    return [
        (sublayer.child, child_at(block, sublayer.child))
        for block, family in blocks_of(FRAMEWORK, runner.unet)
        for sublayer in family.sublayers
        if sublayer.kind == "attn" and child_at(block, sublayer.child) is not None
    ]


def _tokens(name, args, kwargs):
    """(tokens of hidden_states, tokens of encoder_hidden_states or None) of one sub-layer call."""
    x = args[0] if args else kwargs["hidden_states"]
    context = kwargs.get("encoder_hidden_states")
    return x.shape[1], None if context is None else context.shape[1]


@pytest.mark.parametrize("options", [{}, {"blocks": [0]}, {"merge_mlp": True}])
def test_transformer_oracle_runs_on_the_token_counts_of_tome_with_text_untouched(transformer_runner, sublayer_calls, options):
    seen = lambda method, options: sublayer_calls(
        transformer_runner, method, options, lambda: _attention_modules(transformer_runner), _tokens
    )
    plain, ours, oracle = seen("unpatched", {}), seen("ours", options), seen("oracle", options)
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
    assert bench_core.relative_l2(runner.output("ours", 0.5), plain) > 0
    np.testing.assert_array_equal(runner.output("oracle", 0.0), plain)  # dropping no tokens changes nothing


def test_transformer_inputs_follow_the_pipelines():
    from tome_tools.bench_runner import flux_mu, pack_latents, packed_ids

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


# The newer families (tiny kin of the real-width presets): Flux.2 ([text; image] single stream, 4-column ids),
# Qwen-Image (img_shapes, rotary (image, text) tables), Z-Image (lists; [image; text] stream, one complex table,
# a key mask), HunyuanVideo ([image; text] MLP input, key mask, video grid) and LTX (packed video tokens, sizes).
NEW_FAMILY_PRESETS = ("tiny-flux2", "tiny-qwen-image", "tiny-z-image", "tiny-hunyuan-video-t", "tiny-ltx-t")


@pytest.fixture(scope="module", params=NEW_FAMILY_PRESETS)
def new_family_runner(request):
    args = bench.parser().parse_args(["--preset", request.param, "--resolution", "64", "--batch", "1", "--text-tokens", "5"])
    args.options = {}
    return Runner(args)


def _merged_sublayers(runner, options):
    """Every sub-layer ``options`` merge in the runner's model, as ``(block index/child, module)``."""
    from tome_core.models.model_tree import blocks_of
    from tome_core.adapters.diffusers import FRAMEWORK

    config = ToMeConfig.from_options({"ratio": 0.5, **options})
    return [
        (f"{index}/{sublayer.child}", child_at(block, sublayer.child))
        for index, (block, family) in enumerate(blocks_of(FRAMEWORK, runner.unet))
        for sublayer in family.sublayers
        if config.sublayers[sublayer.kind] and child_at(block, sublayer.child) is not None
    ]


def _shapes(name, args, kwargs):
    """The name and the shape of every tensor (and of every tensor in a tuple or list) a sub-layer call gets."""
    def shape(value):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
        if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
            return tuple(shape(v) for v in value)
        if isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values()):
            return tuple((k, shape(v)) for k, v in sorted(value.items()))
        return None

    given = [("#%d" % i, shape(v)) for i, v in enumerate(args)] + [(k, shape(v)) for k, v in sorted(kwargs.items())]
    return name, tuple((k, v) for k, v in given if v is not None)


@pytest.mark.parametrize("options", [{}, {"merge_mlp": True}])
def test_new_families_oracle_gives_every_sublayer_the_shapes_of_ours(new_family_runner, sublayer_calls, options):
    """Sub-layer by sub-layer, the oracle hands each merged sub-layer inputs of the shapes ours hands it (image
    tokens, text, rotary tables, token masks), and both differ from the unpatched call's."""
    runner = new_family_runner
    seen = lambda method: sublayer_calls(runner, method, options, lambda: _merged_sublayers(runner, options), _shapes)
    plain, ours, oracle = seen("unpatched"), seen("ours"), seen("oracle")
    assert ours == oracle and ours != plain
    out = runner.output("oracle", 0.5)
    assert np.isfinite(out).all() and out.shape == runner.output("unpatched", 0.5).shape


def test_new_families_run_whole_calls_and_the_micro_path(tmp_path, capsys):
    """A Flux.2 and a Z-Image tiny preset through --micro (every block kind; Z-Image's noise refiner apart from
    its main blocks) and a tiny LTX video through whole calls with its loop."""
    out_json = tmp_path / "micro.json"
    result = bench.main(["--micro", "--preset", "tiny-flux2", "--resolution", "64", "--batch", "1", "--repeats", "1",
                         "--warmup", "0", "--text-tokens", "3", "--json", str(out_json)])
    assert [b["block"] for b in result["blocks"]] == ["Flux2TransformerBlock", "Flux2SingleTransformerBlock"]
    assert [b["stream_tokens"] for b in result["blocks"]] == [16, 3 + 16]  # the single block's input is [text; image]
    for block in result["blocks"]:
        assert block["kept"] == 8 and block["image_tokens"][1] == 16
        assert set(block["ratios"]) == set(block["paired_ratios"]) == {"ours/unpatched", "oracle/unpatched", "share_of_oracle_saving"}
        assert [len(times) for times in block["times_ms"].values()] == [1] * 5  # every timed call, per row
    assert json.loads(out_json.read_text())["command"].startswith("python -m tome_tools.bench --micro")
    result = bench.main(["--micro", "--preset", "tiny-z-image", "--resolution", "64", "--batch", "1", "--repeats", "1",
                         "--warmup", "0", "--micro-methods", "unpatched", "ours", "oracle"])
    assert [b["kind"] for b in result["blocks"]] == ["z-image (noise_refiner)", "z-image (layers)"]
    assert set(result["blocks"][0]["median_ms"]) == {"block_unpatched", "block_ours", "block_oracle", "match", "merge_unmerge"}
    rows = bench.main(["--preset", "tiny-ltx-t", "--resolution", "64", "--batch", "1", "--repeats", "1", "--warmup", "0",
                       "--steps", "2", "--text-tokens", "5", "--methods", "unpatched", "ours", "oracle"])
    assert [r.method for r in rows] == ["unpatched", "ours", "oracle"]
    for row in rows[1:]:
        assert row.fidelity_step > 0 and np.isfinite(row.fidelity_sampled) and row.fidelity_sampled > 0
    capsys.readouterr()


# One model class per mechanism the oracle follows from the family table: [text; image] single streams (Flux.2,
# AuraFlow), img_shapes and (image, text) rotary tables (Qwen-Image), [image; text] streams with one complex
# table and a key mask (Z-Image), masks on two axes (Chroma), a text-only mask (HunyuanVideo 1.5), [image; text]
# MLP inputs (HunyuanVideo), packed video tokens with sizes (LTX), audio beside the video (LTX-2), aligned inputs
# (Lumina 2, Nucleus-MoE), a sub-layer run again on the text (CogView4), nested rotary positions (Allegro), tables
# by name (AnyFlow), head tokens before the grid (FramePack), tokens past the grid (FLUX.3), a mask it cannot
# place (SkyReels-V2), rotation matrices and an MoE feed-forward viewing its input (HiDream), queries' and keys'
# rotary tables apart and attention outputs [B, N, heads, d] (Lumina-Next), a grid from a shape list over 6-D
# patches with references and padding after it (JoyImage-Edit-Plus), sub-layers of a nested block beside an audio
# path (Kandinsky 6), a stream whose text goes before or after the image by the call (Bria-FIBO 2), the grid last in
# one stream after text and condition images, attention prefilled segment by segment (Qwen-Image 2.1), the image's
# run in packed rows told by a per-token role indicator, a segment mask on both axes (Ideogram 4), one batchless
# layout and rotary table for the batch, the video's run after text, condition frames and audio (MiniMax-H3),
# blocks matched on their second input (Z-Image's ControlNet), a grid from a module's output (aMUSEd's UVit).
ZOO_ORACLE_CLASSES = (
    "Flux2Transformer2DModel", "AuraFlowTransformer2DModel", "QwenImageTransformer2DModel", "ZImageTransformer2DModel",
    "ChromaTransformer2DModel", "HunyuanVideo15Transformer3DModel", "HunyuanVideoTransformer3DModel",
    "LTXVideoTransformer3DModel", "LTX2VideoTransformer3DModel", "Lumina2Transformer2DModel",
    "NucleusMoEImageTransformer2DModel", "CogView4Transformer2DModel", "AllegroTransformer3DModel",
    "AnyFlowTransformer3DModel", "HunyuanVideoFramepackTransformer3DModel", "Flux3Transformer2DModel",
    "SkyReelsV2Transformer3DModel", "HiDreamImageTransformer2DModel", "LuminaNextDiT2DModel",
    "JoyImageEditPlusTransformer3DModel", "Kandinsky6Transformer3DModel", "BriaFibo2Transformer2DModel",
    "QwenImage21Transformer2DModel", "Ideogram4Transformer2DModel",
    "MiniMaxH3Transformer3DModel", "ZImageControlNetModel", "UVit2DModel",
)


def _zoo_builders():
    """The zoo test's tiny model builders (tests/torch/test_zoo.py's MERGED), imported from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_zoo_models", os.path.join(os.path.dirname(__file__), "test_zoo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MERGED


@pytest.mark.parametrize("name", ZOO_ORACLE_CLASSES)
def test_the_oracle_gives_every_merged_sublayer_of_the_zoo_the_shapes_of_ours(name):
    """Model classes of the zoo, the oracle installed on its own (its call hook reads the grid, tail and head as
    the patch does): every sub-layer call gets inputs of the shapes ours gives it (tokens, rotary tables, masks),
    attention alone and with the MLPs."""
    import tome_core.torch as tome
    from tome_core.models.model_tree import blocks_of
    from tome_core.adapters.diffusers import FRAMEWORK
    from tome_tools.bench_runner import hook_oracle

    builders = _zoo_builders()
    if name not in builders:
        pytest.skip(f"the zoo builds no {name} here")
    model, inputs = builders[name]()

    def calls(setup):
        seen, undo = [], setup()
        handles = [
            child_at(block, sublayer.child).register_forward_pre_hook(
                lambda m, a, k, where=f"{index}/{sublayer.child}": seen.append(_shapes(where, a, k)), with_kwargs=True
            )
            for index, (block, family) in enumerate(blocks_of(FRAMEWORK, model))
            for sublayer in family.sublayers
            if isinstance(child_at(block, sublayer.child), torch.nn.Module)
        ]
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model(**inputs)
        finally:
            for handle in handles:
                handle.remove()
            undo()
        return seen

    plain = calls(lambda: (lambda: None))
    for options in ({}, {"merge_mlp": True}):
        def ours():
            tome.patch(model, ratio=0.5, **options)
            return lambda: tome.remove(model)

        config = ToMeConfig.from_options({"ratio": 0.5, **options})
        merged = calls(ours)
        assert merged != plain
        assert calls(lambda: hook_oracle(FRAMEWORK, model, config)) == merged


# Families with mechanisms the bench's own copy of the merge hooks lacked (issue 44): the grid's token count given
# by an argument (Helios' counts), a sequence-first block stream (ERNIE-Image), an attention merging inside its
# own projections on a feature map (UNet2DModel: the copy's attention saw every token there). The oracle runs the
# library's hooks, so it follows them all.
@pytest.mark.parametrize("name", ("HeliosTransformer3DModel", "ErnieImageTransformer2DModel", "UNet2DModel"))
def test_the_oracle_gives_attention_the_token_counts_of_ours_in_families_the_copy_missed(name):
    """Every attention call (SDPA) gets queries and keys of the shapes ours gives it, in ToMe for SD's
    arrangement and in the default's (keys and values in cells where the attention takes them apart)."""
    import tome_core.torch as tome
    from tome_core.adapters.diffusers import FRAMEWORK
    from tome_tools.bench_runner import hook_oracle

    model, inputs = _zoo_builders()[name]()

    def attention(setup):
        spy, undo = SdpaCalls(), setup()  # shapes, not masks: ours adds the size bias there
        try:
            with torch.no_grad(), warnings.catch_warnings(), spy:
                warnings.simplefilter("ignore")
                model(**inputs)
        finally:
            undo()
        return spy.shapes

    plain = attention(lambda: (lambda: None))
    for options in ({"ratio": 0.5}, {}):
        def ours():
            tome.patch(model, **options)
            return lambda: tome.remove(model)

        merged = attention(ours)
        assert merged != plain
        assert attention(lambda: hook_oracle(FRAMEWORK, model, ToMeConfig.from_options(options))) == merged


# -- arrangements (mode), cell matching, several resolutions, missing dependencies -------------------------
def test_variants_split_on_commas_outside_brackets_and_read_bare_strings():
    parsed = bench_core.variant_options(
        ["todo:mode='kv',matching=cell,level_cells={1:4,2:2},max_downsample=2", "q:mode=queries", 'c:level_cells={1: (4, 2)}']
    )
    assert parsed == {
        "todo": {"mode": "kv", "matching": "cell", "level_cells": {1: 4, 2: 2}, "max_downsample": 2},
        "q": {"mode": "queries"},
        "c": {"level_cells": {1: (4, 2)}},
    }
    assert bench_core.parse_options(["mode=kv", "level_cells={1:4,2:2}"]) == {"mode": "kv", "level_cells": {1: 4, 2: 2}}
    with pytest.raises(ValueError, match="unbalanced"):
        bench_core.variant_options(["x:level_cells={1:4"])


def _query_kv(module_name, x, kwargs):
    context = kwargs.get("encoder_hidden_states")
    return x.shape[1], x.shape[1] if context is None else context.shape[1]


def _attn1_lengths(runner, name, ratio=0.5, view=_query_kv):
    """``view(module name, hidden states, keyword arguments)`` of every attn1 call under method ``name`` (by
    default: query tokens, key/value tokens), seen by hooks added after the method's own (so they see what
    attention really gets)."""
    seen = []

    def spy(module_name):
        def hook(module, args, kwargs):
            seen.append(view(module_name, args[0] if args else kwargs["hidden_states"], kwargs))

        return hook

    with runner.method(name, ratio):
        handles = [m.register_forward_pre_hook(spy(n), with_kwargs=True) for n, m in runner.unet.named_modules() if n.endswith("attn1")]
        try:
            runner.call()
        finally:
            for handle in handles:
                handle.remove()
    return seen


ARRANGEMENTS = {
    "kv": {"mode": "kv"},
    "kv75": {"mode": "kv", "ratio": 0.75},
    "kvc": {"mode": "kv", "matching": "cell"},
    "kvl": {"mode": "kv", "matching": "cell", "level_cells": {1: 4, 2: 2}, "max_downsample": 2},
    "q": {"mode": "queries"},
    "qc": {"mode": "queries", "matching": "cell", "sx": 4, "sy": 2},
    "tc": {"matching": "cell", "level_cells": {1: (2, 4)}},
    "c1": {"mode": "kv", "matching": "cell", "sx": 1, "sy": 1},
}


@pytest.fixture(scope="module")
def arrangement_runner():
    args = bench.parser().parse_args(["--preset", "tiny", "--resolution", "128", "--batch", "1"])
    args.options = {"use_rand": False}
    args.variants = dict(ARRANGEMENTS)
    return Runner(args)


@pytest.mark.filterwarnings("ignore:ToMe patch")
@pytest.mark.parametrize("variant", sorted(ARRANGEMENTS))
def test_the_oracle_of_each_arrangement_gives_attention_the_token_counts_of_ours(arrangement_runner, variant):
    """The kv oracle hands attn1 every query and the kept keys/values; the queries oracle the kept queries and
    every key; cell matching keeps one token per cell of its level (16x16 latent: 256 tokens at level 1, 64 at
    level 2)."""
    runner = arrangement_runner
    ours = _attn1_lengths(runner, f"ours:{variant}")
    oracle = _attn1_lengths(runner, f"oracle:{variant}")
    plain = _attn1_lengths(runner, "unpatched")
    assert ours == oracle
    expected = {
        "kv": {(256, 128), (64, 64)},
        "kv75": {(256, 64), (64, 64)},
        "kvc": {(256, 64), (64, 64)},
        "kvl": {(256, 16), (64, 16)},  # 4x4 cells at level 1, 2x2 at level 2
        "q": {(128, 256), (64, 64)},
        "qc": {(32, 256), (64, 64)},
        "tc": {(32, 32), (64, 64)},  # 2x4 cells, tokens mode
        "c1": {(256, 256), (64, 64)},
    }[variant] | {(16, 16)}  # level 4 is never merged here
    assert set(ours) == expected and len(ours) == len(plain)


def test_cell_options_do_not_get_the_bench_ratio_and_rows_show_the_cells_reduction(arrangement_runner):
    runner = arrangement_runner
    assert "ratio" not in runner.options_for("ours:kvl", 0.5) and runner.options_for("ours:kv", 0.3)["ratio"] == 0.3
    assert runner.options_for("ours:kv75", 0.3)["ratio"] == 0.75  # a variant's own ratio wins
    assert runner.effective("ours:kvl", 0.5) == (pytest.approx(15 / 16), "mode=kv cell 4x4 (L1), 2x2 (L2)")
    assert runner.effective("oracle:qc", 0.5) == (pytest.approx(7 / 8), "mode=queries cell 4x2 (L1)")
    assert runner.effective("ours:kv75", 0.5) == (0.75, "mode=kv")
    assert runner.effective("peer", 0.5)[0] == 0.5


@pytest.mark.filterwarnings("ignore:ToMe patch")
def test_main_runs_every_arrangement_with_sane_fidelity_and_several_resolutions(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--resolution", "64", "128", "--repeats", "1", "--warmup", "0", "--steps", "1",
            "--methods", "unpatched", "ours", "oracle", "--json", str(out_json), "--option", "use_rand=False",
            "--variant-oracles", "kv", "kvl"]
    for name, options in ARRANGEMENTS.items():
        argv += ["--variant", f"{name}:" + ",".join(f"{k}={v!r}".replace(" ", "") for k, v in options.items())]
    rows = bench.main(argv)
    text = capsys.readouterr().out
    assert [r.resolution for r in rows] == [64] * 13 + [128] * 13
    assert "64px" in text and "128px" in text and text.count("oracle share") == 2
    for row in rows:
        if row.method in ("ours:c1", "oracle:c1", "unpatched"):
            assert row.fidelity_step == 0.0 and row.fidelity_sampled == 0.0  # 1x1 cells pool nothing
        else:
            assert 0 < row.fidelity_step < 0.5 and 0 < row.fidelity_sampled < 0.5
    by = {(r.resolution, r.method): r for r in rows}
    assert by[(128, "ours:kvl")].ratio == pytest.approx(15 / 16) and "cell 4x4 (L1), 2x2 (L2)" in by[(128, "ours:kvl")].note
    assert by[(128, "oracle:kv")].oracle_share == pytest.approx(1.0) or np.isnan(by[(128, "oracle:kv")].oracle_share)
    saved = json.loads(out_json.read_text())
    assert [run["args"]["resolution"] for run in saved["runs"]] == [64, 128]
    assert [r["method"] for r in saved["runs"][1]["rows"]][:3] == ["unpatched", "ours", "ours:kv"]


def test_missing_optional_dependencies_fail_before_anything_is_built(monkeypatch, tmp_path):
    """--plot without matplotlib (the import made to fail), or a peer named in --methods but not installed,
    stops the bench before a model is built, with the command that installs it."""
    import sys

    def no_build(self, args):
        raise AssertionError("the runner was built before the dependency check")

    monkeypatch.setattr(Runner, "__init__", no_build)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match=r'pip install "\.\[bench\]" \(from the clone\)'):
        bench.main(["--preset", "tiny", "--plot", str(tmp_path / "x.png")])
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(SystemExit, match=r'needs tqdm, not installed: pip install "\.\[bench\]"'):
        bench.main(["--preset", "tiny"])
    monkeypatch.delitem(sys.modules, "tqdm")
    monkeypatch.setattr(Runner, "has_peer", False)
    with pytest.raises(SystemExit, match="pip install tomesd"):
        bench.main(["--preset", "tiny", "--methods", "unpatched", "peer"])
    with pytest.raises(SystemExit, match="no such --variant"):
        bench.main(["--preset", "tiny", "--variant-oracles", "nope"])
    monkeypatch.setitem(sys.modules, "skimage", None)
    with pytest.raises(SystemExit, match=r'scikit-image, not installed: pip install "\.\[trained\]"'):
        bench.main(["--preset", "trained-unet"])


# -- stacked speed-ups (--stack): whole pipeline loops with DeepCache, T-GATE, diffusers' caching hooks -------
STACK_ARGS = ["--preset", "tiny", "--resolution", "128", "--steps", "4", "--threads", "1"]


@pytest.fixture(scope="module")
def stack_runner():
    args = bench.parser().parse_args(STACK_ARGS + ["--stack", "deepcache", "tgate"])
    args.options, args.variants = {}, {}
    args.stacks = bench.parse_stacks(args.stack)
    bench.resolve_stacks(args.stacks, args.steps)
    return Runner(args)


def test_stack_rows_exist_for_each_speedup_with_finite_speedups(tmp_path, capsys):
    out_json = tmp_path / "stacked.json"
    rows = bench.main(STACK_ARGS + ["--repeats", "1", "--warmup", "0", "--stack", "deepcache", "tgate", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert [r.method for r in rows] == ["unpatched", "ours", "deepcache", "deepcache+ours", "tgate", "tgate+ours"]
    for row in rows:
        assert row.stacked and np.isfinite(row.median_s) and np.isfinite(row.speedup) and row.speedup > 0
        assert len(row.times_s) == 1 and np.isnan(row.fidelity_step) and np.isnan(row.oracle_share)
        if row.method == "unpatched":
            assert row.speedup == 1.0 and row.fidelity_sampled == 0.0
        else:
            assert 0 < row.fidelity_sampled < 1
    by = {r.method: r for r in rows}
    assert "cache_interval=3" in by["deepcache+ours"].note and "gate_step=2" in by["tgate"].note  # 40% of 4 steps
    assert "4-step pipeline loops" in text and "fid@out" in text and "tgate+ours" in text
    saved = json.loads(out_json.read_text())
    assert [r["method"] for r in saved["rows"]] == [r.method for r in rows]
    assert saved["args"]["stacks"]["tgate"] == {"gate_step": 2, "sp_interval": 1, "fi_interval": 1, "warm_up": 2}


def test_stack_with_ours_differs_from_each_alone_and_each_method_is_taken_off(stack_runner):
    runner = stack_runner
    plain = runner.loop_output("unpatched", 0.5)
    for stack in ("deepcache", "tgate"):
        alone, ours, both = (runner.loop_output(m, 0.5) for m in (stack, "ours", f"{stack}+ours"))
        assert np.isfinite(both).all() and both.shape == plain.shape
        assert bench_core.relative_l2(both, alone) > 1e-4 and bench_core.relative_l2(both, ours) > 1e-4
        assert bench_core.relative_l2(alone, plain) > 1e-4  # the speed-up really ran
        np.testing.assert_array_equal(runner.loop_output("unpatched", 0.5), plain)  # nothing left attached
    assert runner.split_stack("tgate+ours:reuse+prop") == ("tgate", "ours:reuse+prop")
    assert runner.split_stack("ours:reuse+prop") == (None, "ours:reuse+prop")


def _direct_pipeline(runner):
    """A StableDiffusionPipeline around the runner's UNet, set up here (not by the bench), and the call on the
    runner's inputs."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False, set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=None, text_encoder=None, tokenizer=None, unet=runner.unet, scheduler=scheduler, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    runner.stack_pipeline()
    inputs = {k: runner._loop_kwargs[k] for k in ("prompt_embeds", "negative_prompt_embeds")}
    call = dict(
        inputs, latents=runner.noise[:1].clone(), num_inference_steps=4, guidance_scale=7.5, height=128, width=128,
        output_type="latent",
    )
    return pipe, call


def test_stack_alone_matches_deepcache_and_tgate_set_up_directly(stack_runner):
    """The oracle: DeepCache and T-GATE set up on a pipeline as their READMEs say, run on the same inputs."""
    from DeepCache import DeepCacheSDHelper
    import tgate

    runner = stack_runner
    pipe, call = _direct_pipeline(runner)
    with torch.no_grad():
        plain = pipe(**call).images
        helper = DeepCacheSDHelper(pipe=pipe)
        helper.set_params(cache_interval=3, cache_branch_id=0)
        helper.enable()
        deepcache = pipe(**call).images
        helper.disable()
        pipe = tgate.TgateSDLoader(pipe)
        gated = pipe.tgate(**call, gate_step=2, sp_interval=1, fi_interval=1, warm_up=2).images
    for module in runner.unet.modules():  # what T-GATE left on the attention modules
        module.__dict__.pop("forward", None), module.__dict__.pop("cache", None)
    np.testing.assert_array_equal(runner.loop_output("unpatched", 0.5), plain.numpy())
    np.testing.assert_array_equal(runner.loop_output("deepcache", 0.5), deepcache.numpy())
    np.testing.assert_array_equal(runner.loop_output("tgate", 0.5), gated.numpy())
    assert not torch.equal(deepcache, plain) and not torch.equal(gated, plain)


def test_trained_unet_stack_reports_sample_fidelity_of_the_pipeline_loop(capsys):
    """On the trained UNet the loop is its class sample set; the unpatched pipeline loop is the bench's own
    sampler (``diffusers_trained.generate``), and each row gets PSNR, SSIM and classifier accuracy."""
    from tome_tools import diffusers_trained
    from tome_tools.trained import sample_labels

    rows = bench.main(["--preset", "trained-unet", "--steps", "4", "--samples-per-class", "1", "--repeats", "1",
                       "--warmup", "0", "--threads", "1", "--stack", "deepcache"])
    assert [r.method for r in rows] == ["unpatched", "ours", "deepcache", "deepcache+ours"]
    by = {r.method: r for r in rows}
    assert by["unpatched"].psnr == np.inf and by["unpatched"].ssim == pytest.approx(1.0)
    for name in ("ours", "deepcache", "deepcache+ours"):
        row = by[name]
        assert np.isfinite(row.psnr) and row.psnr > 10 and 0 < row.ssim < 1 and 0 <= row.accuracy <= 1
    assert "PSNR" in capsys.readouterr().out
    args = bench.parser().parse_args(["--preset", "trained-unet", "--steps", "4", "--samples-per-class", "1"])
    bench.resolve_trained(args)
    args.options, args.variants, args.stacks = {}, {}, {}
    runner = Runner(args)
    expected = diffusers_trained.generate(runner.trained, sample_labels(1), 4)
    np.testing.assert_allclose(runner.loop_output("unpatched", 0.5), expected, atol=1e-4)


def test_transformer_caching_hooks_stack_on_flux(capsys):
    rows = bench.main(["--preset", "tiny-flux", "--resolution", "64", "--text-tokens", "5", "--steps", "4",
                       "--repeats", "1", "--warmup", "0", "--threads", "1", "--stack", "first-block-cache", "pab"])
    assert [r.method for r in rows] == ["unpatched", "ours", "first-block-cache", "first-block-cache+ours", "pab", "pab+ours"]
    assert all(np.isfinite(r.speedup) and np.isfinite(r.fidelity_sampled) for r in rows)
    by = {r.method: r for r in rows}
    assert by["pab+ours"].fidelity_sampled != by["pab"].fidelity_sampled
    assert by["pab+ours"].fidelity_sampled != by["ours"].fidelity_sampled


def test_flux_pab_alone_matches_enable_cache_set_up_directly():
    from diffusers import PyramidAttentionBroadcastConfig

    args = bench.parser().parse_args(["--preset", "tiny-flux", "--resolution", "64", "--text-tokens", "5", "--steps", "4", "--stack", "pab"])
    args.options, args.variants = {}, {}
    args.stacks = bench.parse_stacks(args.stack)
    runner = Runner(args)
    ours = runner.loop_output("pab", 0.5)
    pipe = runner.stack_pipeline()
    pipe.transformer.enable_cache(PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(100, 800),
        current_timestep_callback=lambda: pipe.current_timestep,
    ))
    call = {**runner._loop_kwargs, "latents": runner.noise[:1].clone()}
    with torch.no_grad():
        direct = pipe(**call)[0]
    pipe.transformer.disable_cache()
    np.testing.assert_array_equal(ours, direct.numpy())
    assert bench_core.relative_l2(ours, runner.loop_output("unpatched", 0.5)) > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--stack", "hidiffusion"], r"--stack hidiffusion: unknown speed-up 'hidiffusion'; allowed: deepcache, tgate \(UNets\); first-block-cache, pab"),
        (["--stack", "deepcache", "--backend", "paddle"], r"--stack deepcache: stacked speed-ups run on the torch backend only, not --backend paddle"),
        (["--stack", "pab"], r"--stack pab: pab serves diffusion transformers, and --preset tiny is a UNet; allowed here: deepcache, tgate"),
        (["--stack", "deepcache", "--preset", "tiny-flux"], r"--stack deepcache: deepcache serves UNets, and --preset tiny-flux is a diffusion transformer; allowed here: first-block-cache, pab"),
        (["--stack", "pab", "--preset", "tiny-sd3"], r"--stack pab: SD3Transformer2DModel has no enable_cache .* allowed: the presets flux-small, tiny-flux"),
        (["--stack", "tgate", "--preset", "tiny-xl"], r"--stack tgate: --preset tiny-xl is an SDXL UNet"),
        (["--stack", "tgate:sp_interval=5"], r"--stack tgate:sp_interval=5: beside ToMe tgate must run with sp_interval=1, fi_interval=1"),
        (["--stack", "deepcache:interval=3"], r"--stack deepcache:interval=3: deepcache has no setting interval; allowed: cache_interval, cache_branch_id"),
        (["--stack", "deepcache", "--methods", "unpatched", "ours"], r"--stack deepcache with --methods: .* leave out --methods"),
        (["--stack", "deepcache", "--steps", "0"], r"--steps 0: a --stack run times sampling loops of at least 1 step"),
        (["--stack", "tgate", "--preset", "trained-dit"], r"--stack tgate: --preset trained-dit is a trained diffusion transformer"),
    ],
)
def test_bad_stack_input_fails_before_anything_is_built(monkeypatch, argv, message):
    def no_build(self, args):
        raise AssertionError("the runner was built before --stack was checked")

    monkeypatch.setattr(Runner, "__init__", no_build)
    with pytest.raises(SystemExit, match=message):
        bench.main(["--preset", "tiny", *argv])


@pytest.mark.parametrize("stack, module, install", [("deepcache", "DeepCache", "pip install DeepCache==0.1.1"), ("tgate", "tgate", "pip install tgate==1.0.0")])
def test_a_missing_stack_package_is_named_with_its_install_command(monkeypatch, stack, module, install):
    import sys

    monkeypatch.setattr(Runner, "__init__", lambda self, args: pytest.fail("built before the check"))
    monkeypatch.setitem(sys.modules, module, None)  # import -> ImportError
    with pytest.raises(SystemExit, match=rf"--stack {stack} needs {module} .*not installed: {install}"):
        bench.main(["--preset", "tiny", "--stack", stack])


# -- video presets (tome_tools.bench_video) ---------------------------------------------------------------
VIDEO_TINY = ["--resolution", "64", "--repeats", "1", "--warmup", "0", "--threads", "1"]


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
    video = bench_core.video_latents(2, 5, 4, 8, 12, seed=0)
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
        rows = bench.main(["--preset", preset, *VIDEO_TINY, *extra])
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


def test_svd_oracle_cuts_the_spatial_tokens_of_ours_per_frame_and_never_the_temporal_ones():
    from tome_tools.diffusers_video_bench import Runner

    args = bench.parser().parse_args(["--preset", "tiny-svd", "--resolution", "64", "--batch", "1", "--frames", "3"])
    args.options, args.variants = {}, {}
    bench_video.resolve(args, False)
    runner = Runner(args)
    assert runner.latent_hw == (8, 12) and tuple(runner.sample_in.shape) == (1, 3, 4, 8, 12)
    per_module = lambda module_name, x, kwargs: (module_name, tuple(x.shape[:2]))  # (sequences, tokens)
    plain, ours, oracle = (dict(_attn1_lengths(runner, m, view=per_module)) for m in ("unpatched", "ours", "oracle"))
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
    from tome_tools import diffusers_video_bench

    monkeypatch.setattr(diffusers_video_bench, "build_video_preset", lambda *a: pytest.fail("built a model"))
    with pytest.raises(SystemExit, match=message.replace("(", r"\(")):
        bench.main(argv)


def test_an_unknown_preset_is_refused_by_name_with_every_choice(capsys):
    """No traceback: argparse's error names the preset, the closest one and every choice; --help lists them."""
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--preset", "sd15x"])
    error = capsys.readouterr().err
    assert stopped.value.code == 2 and "--preset 'sd15x' is none of the presets (did you mean 'sd15'?)" in error
    every = [name for names in bench.preset_names().values() for name in names]
    assert all(name in error for name in every)
    shown = bench.parser()._option_string_actions["--preset"].help
    assert all(name in shown for kind in ("unet", "transformer", "video", "trained") for name in bench.preset_names()[kind])

"""``python -m tome_tools.bench --train``: training steps per method on the tiny preset. The rows exist and are
finite, 'ours' trains on fewer tokens and backward runs, the unpatched step equals a hand-written forward +
backward (independent recomputation), the model is left as it was, and what a step cannot honour is refused
before anything is built."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler

from tome_tools import bench, bench_train
from tome_tools import bench_core
from tome_tools import diffusers_bench
from tome_tools.diffusers_bench import Runner
from tome_tools.diffusers_models import build_unet

TINY = ["--preset", "tiny", "--resolution", "128", "--batch", "2"]


def train_runner(*argv: str) -> Runner:
    args = bench.parser().parse_args([*TINY, *argv])
    args.options = bench_core.parse_options(args.option)
    args.variants = bench_core.variant_options(args.variant)
    return Runner(args)


@pytest.fixture(scope="module")
def runner() -> Runner:
    return train_runner("--train")


def hooks_of(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_main_writes_finite_train_rows_for_each_method(tmp_path, capsys):
    out = tmp_path / "train.json"
    rows = bench.main([
        "--train", "--preset", "tiny", "--resolution", "64", "--batch", "1", "--repeats", "2", "--warmup", "0",
        "--methods", "unpatched", "ours", "oracle", "--variant", "kv:mode=auto", "--json", str(out),
    ])
    text = capsys.readouterr().out
    assert "training steps (full)" in text and "grad L2" in text
    saved = json.loads(out.read_text())
    assert [r["method"] for r in saved["rows"]] == ["unpatched", "ours", "ours:kv", "oracle"]
    assert [r.method for r in rows] == [r["method"] for r in saved["rows"]]
    for row in saved["rows"]:
        assert row["train"] == "full" and len(row["times_s"]) == 2
        assert all(math.isfinite(v) and v > 0 for v in (row["median_s"], row["speedup"]))
        assert math.isfinite(row["grad_l2"])
        assert (row["grad_l2"] == 0) == (row["method"] == "unpatched")  # reduction changes the training signal
    assert saved["rows"][0]["speedup"] == 1.0


def test_ours_trains_on_fewer_self_attention_tokens_and_backward_reaches_every_weight(runner):
    """Self-attention's query and key projections count the tokens it computes with (ToMe's own hooks sit on
    attn1, around them)."""
    seen = []
    queries = {}

    def count(module, args):
        if module in queries:  # to_k: pairs with the query count of the same call
            seen.append((queries.pop(module), args[0].shape[1]))
        else:
            queries[pairs[module]] = args[0].shape[1]

    attn1 = [m.attn1 for m in runner.unet.modules() if hasattr(m, "attn1")]
    pairs = {a.to_q: a.to_k for a in attn1}
    handles = [lin.register_forward_pre_hook(count) for a in attn1 for lin in (a.to_q, a.to_k)]
    try:
        counts = {}
        for method, options in (("unpatched", {}), ("ours", {}), ("ours:kv", {"mode": "auto"})):
            runner.args.variants["kv"] = options
            seen.clear()
            with runner.method(method, 0.5):
                runner.train_step(keep_grads=True)
            counts[method] = list(seen)
            params = dict(runner.unet.named_parameters())
            assert all(p.grad is not None for p in params.values()), method
            for name in ("conv_in.weight", "conv_out.weight"):
                assert params[name].grad.abs().sum() > 0, (method, name)
            assert all(params[f"{n}.attn1.to_q.weight"].grad.abs().sum() > 0 for n, m in runner.unet.named_modules() if hasattr(m, "attn1"))
            runner.unet.zero_grad(set_to_none=True)
    finally:
        for handle in handles:
            handle.remove()
        runner.args.variants.pop("kv", None)
    full = counts["unpatched"]
    assert all(q == kv for q, kv in full) and full[0][0] == 16 * 16
    # tokens mode at ratio 0.5: half the queries of the finest level; kv (auto: 2x2 cells): a quarter of the keys
    assert counts["ours"][0][0] == 16 * 16 - int(16 * 16 * 0.5) and len(counts["ours"]) == len(full)
    assert counts["ours:kv"][0] == (16 * 16, 8 * 8)
    finest = [i for i, (q, _) in enumerate(full) if q == 256]
    assert all(counts["ours"][i] == (128, 128) for i in finest) and all(counts["ours:kv"][i] == (256, 64) for i in finest)
    for i, (q, kv) in enumerate(full):  # coarser levels (8 x 8, the mid block's 4 x 4) unmerged: max_downsample=1
        if i not in finest:
            assert counts["ours"][i] == counts["ours:kv"][i] == (q, kv) and q in (64, 16)


def test_unpatched_step_equals_a_hand_written_forward_and_backward(runner):
    """The recipe of bench_train, written out: seeded clean latents and noise, a seeded timestep per sample,
    DDIM's add_noise, mse to the noise, backward; an independently built copy of the tiny UNet."""
    with runner.method("unpatched", 0.5):
        grad = runner.train_step(keep_grads=True)
    weights = {n: p.grad.clone() for n, p in runner.unet.named_parameters() if n.endswith("attn1.to_k.weight")}
    runner.unet.zero_grad(set_to_none=True)

    unet = build_unet("tiny")
    clean = torch.from_numpy(bench_core.image_like_latents(2, 4, 16, 16, seed=0))
    noise = torch.from_numpy(np.random.default_rng(1).standard_normal((2, 4, 16, 16)).astype("float32"))
    t = torch.from_numpy(np.random.default_rng(3).integers(0, 1000, size=2))
    scheduler = DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    x = scheduler.add_noise(clean, noise, t).requires_grad_(True)
    text = torch.randn(2, 77, 32, generator=torch.Generator().manual_seed(2))
    F.mse_loss(unet.train()(x, t, text).sample, noise).backward()

    torch.testing.assert_close(grad, x.grad, rtol=1e-4, atol=1e-7)
    mine = dict(unet.named_parameters())
    assert weights
    for name, value in weights.items():
        torch.testing.assert_close(value, mine[name].grad, rtol=1e-4, atol=1e-7)


def test_steps_leave_the_model_as_it_was(runner):
    unet = runner.unet
    hooks = hooks_of(unet)
    frozen = "conv_in.weight"
    dict(unet.named_parameters())[frozen].requires_grad_(False)
    flags = {n: p.requires_grad for n, p in unet.named_parameters()}
    try:
        for method in ("unpatched", "ours", "oracle"):
            with runner.method(method, 0.5):
                runner.train_step()
        assert hooks_of(unet) == hooks
        assert {n: p.requires_grad for n, p in unet.named_parameters()} == flags
        assert not unet.training
        assert all(p.grad is None for p in unet.parameters())
        assert runner.train_inputs.sample.grad is None and not runner.train_inputs.sample.requires_grad
    finally:
        dict(unet.named_parameters())[frozen].requires_grad_(True)


def test_lora_steps_train_only_the_adapters():
    lora = train_runner("--train", "lora", "--resolution", "64", "--batch", "1")
    with lora.method("ours", 0.5):
        lora.train_step(keep_grads=True)
    grads = {n: p.grad for n, p in lora.unet.named_parameters()}
    assert any("lora_" in n for n in grads)
    assert all((g is not None) == ("lora_" in n) for n, g in grads.items())
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n or "lora_A" in n)


def test_gradient_checkpointing_recomputes_blocks_and_gives_the_same_gradients(runner):
    """``--gradient-checkpointing``: every self-attention runs twice per step (forward, then again in backward),
    and the gradients of the input and of every weight equal those of the step without checkpointing, for the
    unpatched step and for ToMe's seeded random partition (the recomputed forward merges the same tokens)."""
    checkpointed = train_runner("--train", "--gradient-checkpointing")
    assert checkpointed.unet.is_gradient_checkpointing and not runner.unet.is_gradient_checkpointing
    calls = []
    attn1 = next(m.attn1 for m in checkpointed.unet.modules() if hasattr(m, "attn1"))
    handle = attn1.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        for method in ("unpatched", "ours"):
            grads = []
            for one in (runner, checkpointed):
                with one.method(method, 0.5):
                    x = one.train_step(keep_grads=True)
                grads.append((x, {n: p.grad for n, p in one.unet.named_parameters()}))
                one.unet.zero_grad(set_to_none=True)
            (x, weights), (x_ck, weights_ck) = grads
            torch.testing.assert_close(x_ck, x, rtol=1e-5, atol=1e-8)
            assert weights.keys() == weights_ck.keys()
            for name, grad in weights.items():
                torch.testing.assert_close(weights_ck[name], grad, rtol=1e-5, atol=1e-8, msg=f"{method} {name}")
    finally:
        handle.remove()
    assert len(calls) == 4  # two steps, each with its recomputation


def test_gradient_checkpointing_without_train_is_refused():
    with pytest.raises(SystemExit, match="--gradient-checkpointing without --train: .* add --train or leave it out"):
        bench.main(["--preset", "tiny", "--gradient-checkpointing"])


def test_the_fresh_process_runs_a_training_step_for_memory(runner, monkeypatch, capsys):
    """serve_peak_request's --train branch, run in this process: it times a step, not an inference call."""
    args = {**vars(runner.args), "resolution": 64}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"args": args, "method": "ours", "ratio": 0.5})))
    monkeypatch.setattr(Runner, "call", lambda self: pytest.fail("ran an inference call"))
    steps = []
    original = Runner.train_step
    monkeypatch.setattr(Runner, "train_step", lambda self, **k: steps.append(1) or original(self, **k))
    bench_core.serve_peak_request(Runner)
    assert steps == [1] and float(capsys.readouterr().out.strip()) >= 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backend", "paddle"], "--train full with --backend paddle: training steps run on torch only; allowed: --backend torch"),
        (["--backend", "jax"], "--backend jax: training steps run on torch only"),
        (["--stack", "deepcache"], "--train full with --stack deepcache: .* leave out --stack"),
        (["--micro"], "with --micro: .* leave out --micro"),
        (["--steps", "2"], "--train full with --steps 2: a training step samples nothing"),
        (["--sample-methods", "ours"], "with --sample-methods ours: .* leave out --sample-methods"),
        (["--samples-per-class", "2"], "with --samples-per-class 2"),
        (["--preset", "tiny-flux"], "--preset tiny-flux: a diffusion transformer; training steps run on UNets only"),
        (["--preset", "trained-dit"], "--preset trained-dit: a diffusion transformer"),
        (["--preset", "tiny-animatediff"], "--preset tiny-animatediff: training steps run on image UNets"),
    ],
)
def test_what_a_training_step_cannot_honour_is_refused_before_anything_is_built(monkeypatch, argv, message):
    monkeypatch.setattr(diffusers_bench, "build_unet", lambda *a: pytest.fail("built a model"))
    monkeypatch.setattr(diffusers_bench, "build_transformer", lambda *a: pytest.fail("built a model"))
    with pytest.raises(SystemExit, match=message):
        bench.main(["--train", "--preset", "tiny", *argv])


def test_train_modes_are_named_in_the_parser_error(capsys):
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["--train", "half"])
    assert "invalid choice: 'half' (choose from 'full', 'lora')" in capsys.readouterr().err
    assert bench_train.TRAIN_MODES == ("full", "lora")

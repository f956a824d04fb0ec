"""Training through a patched torch model (issue #19, torch part): what trainers stack on a diffusers UNet.

Each test names its oracle:

* ``torch.autograd.gradcheck`` in float64 through a patched 2-D ``Transformer2DModel`` (a UNet's transformer,
  continuous input), for every arrangement (``tokens``, ``kv``, ``queries``; and ``kv`` with cell pooling),
  ``use_rand=False``, size-aware attention on: analytic gradients with respect to the input, the text and a few
  weights (``torch.func.functional_call``) equal finite differences.
* Gradient checkpointing: the gradients of the same model without checkpointing (the random partition is a hash
  of seed, timestep and block, so the recomputed forward draws the same one).
* peft LoRA: the weights before training (only adapter weights move) and an unpatched LoRA UNet (the keys of its
  state dict and of ``get_peft_model_state_dict``, its hooks and module classes, after ``remove``).
* Two-process DDP (gloo, CPU, 127.0.0.1): each other (ranks stay identical) and one process that averages the
  two ranks' gradients itself.
* autocast bfloat16: finiteness, and the float32 gradients of the same patched model.
* ``torch.compile(backend="aot_eager")``: the eager patched model's gradients.
* ``accelerate``'s ``Accelerator.prepare`` (bf16 mixed precision): a hand-written autocast SGD step.
* The unpatched model: a ratio-0 patch gives its gradients exactly, ratio 0.5 different ones.
* The match is a discrete choice: gradients and the output's autograd graph equal those of a match computed
  from a detached metric.
"""

from __future__ import annotations

import collections
import datetime
import functools
import os
import pathlib
import time
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.utils.checkpoint
from diffusers import Transformer2DModel
from torch.func import functional_call

import tome_core.torch as tome
from tome_tools.diffusers_parallel_bench import cpu_process_group, free_port
from tome_tools.diffusers_models import build_unet
from tome_core.hooks.state import ToMeState

Batch = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # latent, timesteps, text, target
Grads = Dict[str, torch.Tensor]

# One option set per arrangement (the similarity ones at ratio 0.5; kv-cell: 2x2 cells, the UNet default).
ARRANGEMENTS = {
    "tokens": dict(mode="tokens", ratio=0.5),
    "kv": dict(mode="kv", ratio=0.5),
    "queries": dict(mode="queries", ratio=0.5),
    "kv-cell": dict(mode="kv", matching="cell"),
    "kv-cell-sample": dict(mode="kv", matching="cell", cell_pool="sample"),
}


# ---------------------------------------------------------------------------------------------------------
# Builders


def tiny_transformer2d(seed: int = 0, channels: int = 8, dtype: torch.dtype = torch.float32) -> Transformer2DModel:
    """A UNet-style 2-D transformer (continuous input, one BasicTransformerBlock, 2 heads, cross-attention)."""
    torch.manual_seed(seed)
    model = Transformer2DModel(
        num_attention_heads=2, attention_head_dim=channels // 2, in_channels=channels, num_layers=1,
        cross_attention_dim=8, norm_num_groups=4,
    )
    return model.to(dtype)


def unet_batch(seed: int, batch: int = 2) -> Batch:
    """Inputs of one training step of the tiny UNet on 8x8 latents: latent, timesteps, text, target."""
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn(batch, 4, 8, 8, generator=generator)
    timesteps = torch.randint(0, 1000, (batch,), generator=generator)
    text = torch.randn(batch, 7, 32, generator=generator)
    return latent, timesteps, text, torch.randn(batch, 4, 8, 8, generator=generator)


def unet_loss(model: Callable[..., Any], batch: Batch) -> torch.Tensor:
    latent, timesteps, text, target = batch
    prediction = model(latent, timesteps, text).sample
    return torch.nn.functional.mse_loss(prediction.float(), target)


def step_grads(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor]) -> Tuple[torch.Tensor, Grads]:
    """The loss and every parameter gradient of one backward pass (gradients zeroed first)."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def relative_error(a: Grads, b: Grads) -> float:
    """Relative L2 distance of two gradient sets over all their tensors (same keys)."""
    assert a.keys() == b.keys()
    flat = lambda g: torch.cat([g[k].flatten().double() for k in sorted(g)])
    return float((flat(a) - flat(b)).norm() / flat(b).norm())


def merged_summary(model: Any) -> str:
    """The patched model's last-call summary; asserts that some level ran on fewer tokens."""
    summary = tome.patched_models(model)[0][1].summary()
    assert "merged;" in summary and "no block merged" not in summary, summary
    return summary


# ---------------------------------------------------------------------------------------------------------
# 1. gradcheck through every arrangement


GRADCHECK_WEIGHTS = (
    "proj_in.weight",  # feeds the block input, i.e. the match's metric
    "transformer_blocks.0.norm1.weight",
    "transformer_blocks.0.attn1.to_q.weight",  # queries: merged in tokens/queries
    "transformer_blocks.0.attn1.to_k.weight",  # keys: merged (size-aware) in tokens/kv
)


@pytest.mark.parametrize("arrangement", list(ARRANGEMENTS))
def test_gradcheck_through_each_arrangement(arrangement: str):
    """Analytic gradients w.r.t. the input hidden states, the text and four weights equal finite differences."""
    model = tiny_transformer2d(dtype=torch.float64).eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    text = torch.randn(2, 3, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    params = dict(model.named_parameters())
    weights = [params[name].detach().clone().requires_grad_() for name in GRADCHECK_WEIGHTS]

    def call(x, text, *weights):
        swapped = dict(zip(GRADCHECK_WEIGHTS, weights))
        return functional_call(model, swapped, (x,), {"encoder_hidden_states": text, "return_dict": False})[0]

    unpatched = call(x, text, *weights)
    tome.patch(model, use_rand=False, **ARRANGEMENTS[arrangement])
    assert tome.patched_models(model)[0][1].config.proportional_attn
    patched = call(x, text, *weights)
    merged_summary(model)
    # the checked function is the merged one: it moves the output, and the input gradient
    assert float((patched - unpatched).detach().norm() / unpatched.detach().norm()) > 1e-3
    (grad_patched,) = torch.autograd.grad(patched.sum(), x)
    (grad_unpatched,) = torch.autograd.grad(unpatched.sum(), x)
    assert not torch.allclose(grad_patched, grad_unpatched, rtol=1e-3, atol=1e-6)
    assert torch.autograd.gradcheck(call, (x, text, *weights), eps=1e-6, atol=1e-5, rtol=1e-3)


# ---------------------------------------------------------------------------------------------------------
# 2. gradient checkpointing


def count_block_calls(unet: torch.nn.Module) -> List[int]:
    """A counter of the calls of the UNet's first transformer block (forwards plus recomputations)."""
    counter = [0]
    block = next(m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock")
    block.register_forward_pre_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    return counter


def enable_checkpointing(unet: torch.nn.Module, reentrant: bool) -> None:
    """diffusers' checkpointing: non-reentrant (its default), or torch's reentrant variant (which runs the forward
    without grad and recomputes from detached copies of the inputs)."""
    if reentrant:
        checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
        unet.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint)
    else:
        unet.enable_gradient_checkpointing()


@pytest.mark.parametrize("options", [{"ratio": 0.5}, ARRANGEMENTS["kv-cell-sample"]], ids=["tokens", "kv-cell-sample"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_gives_the_same_gradients(reentrant: bool, options: Dict[str, Any]):
    """With use_rand=True the recomputed forward draws the same partition (or the same sampled cells):
    gradients equal those without checkpointing; another seed (another draw) gives other gradients, so the
    comparison can fail."""
    unet = build_unet("tiny", seed=0).train()
    calls = count_block_calls(unet)
    batch = unet_batch(1)
    tome.patch(unet, use_rand=True, **options)
    loss_plain, plain = step_grads(unet, lambda: unet_loss(unet, batch))
    summary = merged_summary(unet)
    assert calls[0] == 1
    enable_checkpointing(unet, reentrant)
    loss_checkpointed, checkpointed = step_grads(unet, lambda: unet_loss(unet, batch))
    assert calls[0] == 3  # forward + recomputation in backward: checkpointing was on
    assert merged_summary(unet) == summary  # recomputed blocks are not counted twice
    torch.testing.assert_close(loss_checkpointed, loss_plain, rtol=1e-6, atol=0)
    assert relative_error(checkpointed, plain) < 1e-6
    unet.disable_gradient_checkpointing()
    tome.patch(unet, use_rand=True, seed=1, **options)
    _, other_partition = step_grads(unet, lambda: unet_loss(unet, batch))
    assert relative_error(other_partition, plain) > 1e-3


def test_gradient_checkpointing_of_frozen_blocks_gives_the_same_gradients():
    """As a LoRA fine-tune trains: only the attention's query projections train, so a block's input needs no
    gradient. Recomputed in backward (diffusers' non-reentrant checkpointing; the reentrant variant gives no
    gradients at all through inputs that need none), after the UNet's call returned, the block still merges as its
    forward did: gradients equal those without checkpointing."""
    unet = build_unet("tiny", seed=0).train()
    for name, parameter in unet.named_parameters():
        parameter.requires_grad_(".attn1.to_q." in name)
    batch = unet_batch(1)
    tome.patch(unet, use_rand=True, ratio=0.5)
    _, plain = step_grads(unet, lambda: unet_loss(unet, batch))
    enable_checkpointing(unet, reentrant=False)
    calls = count_block_calls(unet)
    _, checkpointed = step_grads(unet, lambda: unet_loss(unet, batch))
    assert calls[0] == 2 and plain and all(".attn1.to_q." in name for name in plain)
    assert relative_error(checkpointed, plain) < 1e-6


def test_only_calls_that_may_be_recomputed_remember_their_matches():
    """Inference (no gradients recorded, input needs none) keeps nothing per input: only a call that records
    gradients, or whose input needs them (reentrant checkpointing's forward), may be recomputed in backward."""
    unet = build_unet("tiny", seed=0)
    batch = unet_batch(1)
    tome.patch(unet, ratio=0.5)
    runs = {hook.__self__ for m in unet.modules() for hook in m._forward_pre_hooks.values()
            if type(getattr(hook, "__self__", None)).__name__ == "BlockRun"}
    assert len(runs) == 3  # the blocks at the finest level of 7: the others, above max_downsample, get no hooks
    with torch.no_grad():
        unet_loss(unet, batch)
    assert all(run.ran == {} for run in runs)
    enable_checkpointing(unet, reentrant=True)  # runs each block's forward without gradients, on inputs needing them
    unet_loss(unet, batch)
    assert all(len(run.ran) == 1 for run in runs)
    unet_loss(unet, batch)
    assert all(len(run.ran) >= 1 for run in runs)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("second", ["other-timestep", "other-size"])
def test_gradient_checkpointing_two_calls_before_backward(second: str, reentrant: bool):
    """Two UNet calls, one backward (a loss over two noise levels, or two resolutions): checkpointed gradients
    equal the plain ones. The first call's blocks are recomputed after the second call has run, when the
    model's state is the second call's: a recomputed block must use the match of its own forward (reading the
    state instead drew another partition at another timestep, or judged the 8x8 call's blocks by the 16x16
    latent and raised torch's CheckpointError). Reentrant checkpointing recomputes from a detached copy of the
    block's input, recognised by its data."""
    unet = build_unet("tiny", seed=0).train()
    first = unet_batch(1)
    if second == "other-timestep":  # another first timestep: another partition (use_rand=True)
        tome.patch(unet, ratio=0.5, use_rand=True)
        other = unet_batch(2)
        if first[1][0] == other[1][0]:
            pytest.fail("the two calls must start with different timesteps")
    else:  # a 16x16 latent: the 8x8 call's 64-token blocks would be judged level 2 (not merged) on recomputation
        tome.patch(unet, ratio=0.5, use_rand=False)
        generator = torch.Generator().manual_seed(2)
        latent, target = (torch.randn(2, 4, 16, 16, generator=generator) for _ in range(2))
        other = (latent, first[1], first[2], target)
    loss = lambda: unet_loss(unet, first) + unet_loss(unet, other)
    _, plain = step_grads(unet, loss)
    enable_checkpointing(unet, reentrant)
    _, checkpointed = step_grads(unet, loss)
    assert relative_error(checkpointed, plain) < 1e-6


# ---------------------------------------------------------------------------------------------------------
# 3. peft LoRA: only adapters train; remove leaves an unpatched LoRA UNet


def add_lora(unet: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig

    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=targets))
    return unet


def hooks_and_classes(model: torch.nn.Module) -> List[Tuple[str, type, int]]:
    """``(name, class, number of forward hooks)`` of every module."""
    return [
        (name, type(module), len(module._forward_pre_hooks) + len(module._forward_hooks))
        for name, module in model.named_modules()
    ]


@pytest.mark.parametrize("order", ["lora-then-patch", "patch-then-lora"])
def test_lora_trains_only_adapters_and_remove_leaves_an_unpatched_lora_unet(order: str, tmp_path):
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    reference = add_lora(build_unet("tiny", seed=0))
    if order == "lora-then-patch":
        unet = tome.patch(add_lora(build_unet("tiny", seed=0).train()), ratio=0.5)
    else:
        unet = add_lora(tome.patch(build_unet("tiny", seed=0).train(), ratio=0.5))
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    assert list(unet.state_dict()) == list(reference.state_dict())  # hooks add no state
    trainable = [p for p in unet.parameters() if p.requires_grad]
    assert len(trainable) == sum("lora_" in n for n, _ in unet.named_parameters()) > 0
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    for step in range(2):  # lora_B starts at zero (so does lora_A's gradient): two steps move both
        loss = unet_loss(unet, unet_batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        merged_summary(unet)
    after = unet.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {k for k in before if "lora_" in k}
    assert all(p.grad is None for p in unet.parameters() if not p.requires_grad)

    tome.remove(unet)
    assert list(unet.state_dict()) == list(reference.state_dict())
    assert hooks_and_classes(unet) == hooks_and_classes(reference)
    assert not any(count for *_, count in hooks_and_classes(unet))
    lora = get_peft_model_state_dict(unet)
    assert list(lora) == list(get_peft_model_state_dict(reference))
    save_file(lora, str(tmp_path / "lora.safetensors"))
    # the saved file loads into a LoRA UNet that was never patched and reproduces the trained model
    fresh = add_lora(build_unet("tiny", seed=0))
    assert not set_peft_model_state_dict(fresh, load_file(str(tmp_path / "lora.safetensors"))).unexpected_keys
    latent, timesteps, text, _ = unet_batch(5)
    with torch.no_grad():
        assert torch.equal(fresh(latent, timesteps, text).sample, unet.eval()(latent, timesteps, text).sample)


# ---------------------------------------------------------------------------------------------------------
# 4. DistributedDataParallel on gloo


DDP_STEPS = 2
DDP_LR = 0.1


def ddp_batch(rank: int, step: int) -> Batch:
    return unet_batch(100 * step + rank, batch=1)


def _ddp_worker(rank: int, world: int, port: int, out_dir: str, wrap: str = "ddp") -> None:
    """One rank: a patched tiny UNet under DistributedDataParallel (``wrap="ddp"``) or FSDP2's
    ``fully_shard`` on each of its down, middle and up blocks and on the whole (``"fsdp"``), DDP_STEPS SGD
    steps on this rank's own data, full weights saved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    with cpu_process_group(rank, world, port, datetime.timedelta(seconds=60)):
        unet = tome.patch(build_unet("tiny", seed=0).train(), ratio=0.5)
        if wrap == "ddp":
            model = DistributedDataParallel(unet)
        else:
            mesh = init_device_mesh("cpu", (world,))
            for part in [*unet.down_blocks, unet.mid_block, *unet.up_blocks]:
                fully_shard(part, mesh=mesh)
            model = fully_shard(unet, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=DDP_LR)
        for step in range(DDP_STEPS):
            unet_loss(model, ddp_batch(rank, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        merged_summary(unet)
        weights = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in unet.state_dict().items()}
        torch.save(weights, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_ddp_gloo_ranks_stay_identical_and_equal_the_mean_gradient(tmp_path, monkeypatch, wrap):
    """DistributedDataParallel, and FSDP2 (``fully_shard``, parameters sharded across the ranks and gathered
    around each block), with no change to the patch."""
    import torch.multiprocessing as mp

    # spawned ranks unpickle the worker from this module (tests.torch.test_training): the checkout's root must
    # be on their path, also when pytest runs as a script (nox) rather than as ``python -m pytest``
    root = str(pathlib.Path(__file__).resolve().parents[2])
    monkeypatch.syspath_prepend(root)  # spawn gives the children a copy of this process's sys.path
    world = 2
    arguments = (world, free_port(), str(tmp_path), wrap)
    context = mp.start_processes(_ddp_worker, args=arguments, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):  # raises if a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("DDP ranks did not finish in 240 s")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])

    # one process: the same steps with the mean of the two ranks' gradients
    unet = tome.patch(build_unet("tiny", seed=0).train(), ratio=0.5)
    initial = {k: v.clone() for k, v in unet.state_dict().items()}
    optimizer = torch.optim.SGD(unet.parameters(), lr=DDP_LR)
    for step in range(DDP_STEPS):
        for rank in range(world):
            (unet_loss(unet, ddp_batch(rank, step)) / world).backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = unet.state_dict()
    assert any(not torch.equal(initial[k], expected[k]) for k in expected)
    for key in expected:
        torch.testing.assert_close(ranks[0][key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


# ---------------------------------------------------------------------------------------------------------
# 5. autocast bfloat16


@pytest.mark.parametrize("arrangement", ["tokens", "kv", "queries", "auto"])
def test_autocast_bfloat16_step(arrangement: str):
    """A bf16-autocast training step runs merged, with finite loss and gradients close to float32's (the
    unpatched model's bf16 gradients are ~3% from its float32 ones)."""
    unet = tome.patch(build_unet("tiny", seed=0).train(), **ARRANGEMENTS.get(arrangement, {}))  # auto: {}
    batch = unet_batch(1)
    dtypes = []

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            prediction = unet(*batch[:3]).sample
        dtypes.append(prediction.dtype)
        return torch.nn.functional.mse_loss(prediction.float(), batch[3])

    loss_bf16, bf16 = step_grads(unet, loss)
    merged_summary(unet)
    assert dtypes == [torch.bfloat16]
    assert torch.isfinite(loss_bf16) and all(torch.isfinite(g).all() for g in bf16.values())
    assert len(bf16) == len(list(unet.parameters()))
    _, float32 = step_grads(unet, lambda: unet_loss(unet, batch))
    assert relative_error(bf16, float32) < 0.1


# ---------------------------------------------------------------------------------------------------------
# 6. torch.compile of the training step


@pytest.fixture()
def fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_training_step_matches_eager(fresh_dynamo):
    """Forward and backward compiled (AOTAutograd, aot_eager, fullgraph) give the eager patched gradients,
    which differ from the unpatched ones (so the compiled graph merges). use_rand=True: the partition's
    timestep hash is traced too."""
    model = tiny_transformer2d(channels=16).train()
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(2, 16, 8, 8, generator=generator), torch.randn(2, 16, 8, 8, generator=generator)
    text, timesteps = torch.randn(2, 5, 8, generator=generator), torch.tensor([700, 300])

    def loss(module):
        return lambda: torch.nn.functional.mse_loss(
            module(x, encoder_hidden_states=text, timestep=timesteps, return_dict=False)[0], target
        )

    _, unpatched = step_grads(model, loss(model))
    tome.patch(model, ratio=0.5, use_rand=True)
    loss_eager, eager = step_grads(model, loss(model))
    merged_summary(model)
    assert relative_error(eager, unpatched) > 1e-3
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss_compiled, compiled_grads = step_grads(model, loss(compiled))
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-5, atol=1e-6)
    assert relative_error(compiled_grads, eager) < 1e-5


# ---------------------------------------------------------------------------------------------------------
# 7. accelerate


def test_accelerate_prepare_trains_a_patched_unet():
    """``Accelerator(mixed_precision="bf16").prepare(model, optimizer)`` (accelerate wraps ``forward`` in
    autocast): one step equals a hand-written autocast SGD step of the same patched model."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    batch = unet_batch(1)
    reference = tome.patch(build_unet("tiny", seed=0).train(), ratio=0.5)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prediction = reference(*batch[:3]).sample
    torch.nn.functional.mse_loss(prediction.float(), batch[3]).backward()
    optimizer.step()

    unet = tome.patch(build_unet("tiny", seed=0).train(), ratio=0.5)
    initial = {k: v.clone() for k, v in unet.state_dict().items()}
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        model, optimizer = accelerator.prepare(unet, torch.optim.SGD(unet.parameters(), lr=0.1))
        loss = unet_loss(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    finally:
        AcceleratorState._reset_state(True)
    merged_summary(model)
    assert torch.isfinite(loss)
    trained, expected = unet.state_dict(), reference.state_dict()
    assert any(not torch.equal(initial[k], trained[k]) for k in trained)
    for key in expected:
        torch.testing.assert_close(trained[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


# ---------------------------------------------------------------------------------------------------------
# 8. against the unpatched model


def test_ratio_zero_gives_the_unpatched_gradients_and_half_does_not():
    """Oracle: the unpatched model. Ratio 0 (and remove) give its loss and gradients bit for bit; ratio 0.5
    gives others."""
    unet = build_unet("tiny", seed=0).train()
    batch = unet_batch(1)
    loss_unpatched, unpatched = step_grads(unet, lambda: unet_loss(unet, batch))
    with pytest.warns(UserWarning, match="merges no tokens"):
        tome.patch(unet, ratio=0.0)
    loss_zero, zero = step_grads(unet, lambda: unet_loss(unet, batch))
    assert torch.equal(loss_zero, loss_unpatched)
    assert all(torch.equal(zero[k], unpatched[k]) for k in unpatched)
    tome.patch(unet, ratio=0.5)
    loss_half, half = step_grads(unet, lambda: unet_loss(unet, batch))
    merged_summary(unet)
    assert not torch.equal(loss_half, loss_unpatched)
    assert half.keys() == unpatched.keys()
    assert relative_error(half, unpatched) > 1e-3
    tome.remove(unet)
    loss_removed, removed = step_grads(unet, lambda: unet_loss(unet, batch))
    assert torch.equal(loss_removed, loss_unpatched) and all(torch.equal(removed[k], unpatched[k]) for k in unpatched)


# ---------------------------------------------------------------------------------------------------------
# 9. the match is a discrete choice


def graph_nodes(output: torch.Tensor) -> collections.Counter:
    """How many autograd nodes of each type the graph of ``output`` holds."""
    seen, stack, counts = set(), [output.grad_fn], collections.Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        counts[type(node).__name__] += 1
        stack.extend(next_node for next_node, _ in node.next_functions)
    return counts


@pytest.mark.parametrize("arrangement", ["tokens", "kv", "queries"])
def test_match_from_a_detached_metric_changes_no_gradient(arrangement: str, monkeypatch):
    """Gradients (input and weights) and the output's autograd graph are the same whether the similarity
    match is computed from the block input or from a detached copy: the match enters the output only through
    integer indices and sizes, which carry no gradient. (Holds whether or not the library detaches itself.)"""
    model = tiny_transformer2d(channels=16).train()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 8, 8, generator=generator, requires_grad=True)
    text = torch.randn(2, 5, 8, generator=generator)
    tome.patch(model, **ARRANGEMENTS[arrangement])
    matches = []
    original = ToMeState.block_matches

    def run() -> Tuple[collections.Counter, Grads]:
        model.zero_grad(set_to_none=True)
        x.grad = None
        output = model(x, encoder_hidden_states=text, return_dict=False)[0]
        nodes = graph_nodes(output)
        output.square().sum().backward()
        return nodes, {"input": x.grad.clone(), **{n: p.grad.clone() for n, p in model.named_parameters()}}

    def recording(self, metric, *args, **kwargs):
        found = original(self, metric, *args, **kwargs)
        matches.extend(found.values())
        return found

    monkeypatch.setattr(ToMeState, "block_matches", recording)
    nodes, grads = run()
    merged_summary(model)
    assert matches and all(m.merged > 0 for m in matches)
    assert not any(t is not None and t.requires_grad for m in matches for t in (m.rows, m.sizes))
    detaching = lambda self, metric, *args, **kwargs: recording(self, metric.detach(), *args, **kwargs)
    monkeypatch.setattr(ToMeState, "block_matches", detaching)
    nodes_detached, grads_detached = run()
    assert nodes == nodes_detached
    assert grads.keys() == grads_detached.keys()
    assert all(torch.equal(grads[k], grads_detached[k]) for k in grads)

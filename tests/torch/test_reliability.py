"""Reliability of the torch adapter (issue 6): odd shapes, dtypes, saving, threads, LoRA, CPU offload,
torch.compile and global RNG state. Every test checks against an oracle: the unpatched model, the same model
run another way, or the token counts the merge must produce.

Not repeated here (covered in test_api.py / test_pipelines.py / test_tomesd_parity.py): option errors,
patch twice, remove, deepcopy, seed/timestep partitions, float32 parity with tomesd, pipeline kinds.
"""

from __future__ import annotations

import copy
import random
import threading
import warnings
from typing import List, Optional, Tuple

import numpy as np
import pytest
import torch
import torch._dynamo
from diffusers import UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tome_core.torch as tome
from tome_tools.diffusers_models import build_pipeline, build_unet

TEXT_TOKENS, TEXT_DIM = 7, 32  # the tiny UNet's cross_attention_dim


@pytest.fixture(scope="module")
def unet():
    return build_unet("tiny", seed=0)


def make_inputs(batch: int, h: int, w: int, seed: int = 0, dtype=torch.float32, timestep: int = 500):
    generator = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, 4, h, w, generator=generator).to(dtype)
    text = torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=generator).to(dtype)
    return sample, torch.tensor(timestep), text


def call(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(*inputs).sample


def patched_copy(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # ratio=0 / nothing-merges warnings are tested elsewhere
        return tome.patch(copy.deepcopy(model), **options)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _hidden(args, kwargs):
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


class Observer:
    """Records, for every self-attention call, the grid its transformer saw and what reached ``attn1``.

    Registered after ``tome.patch``, so its ``attn1`` pre-hook runs after ToMe's and sees merged tokens.
    """

    def __init__(self, model: torch.nn.Module):
        self.grid: Optional[Tuple[int, int]] = None
        self.blocks: List[Tuple[Tuple[int, int], int, torch.dtype]] = []  # (grid, tokens at attn1, dtype)
        self.handles = []
        for module in model.modules():
            if isinstance(module, Transformer2DModel):
                self.handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            if isinstance(module, BasicTransformerBlock):
                self.handles.append(module.attn1.register_forward_pre_hook(self._attn1, with_kwargs=True))

    def _enter(self, module, args, kwargs):
        self.grid = tuple(_hidden(args, kwargs).shape[-2:])

    def _attn1(self, module, args, kwargs):
        x = _hidden(args, kwargs)
        self.blocks.append((self.grid, x.shape[1], x.dtype))

    def close(self):
        for handle in self.handles:
            handle.remove()


def expected_tokens(grid: Tuple[int, int], ratio: float, sx: int = 2, sy: int = 2) -> int:
    """Tokens left after merging an h x w grid: tomesd's r = int(N * ratio), none without a full cell."""
    h, w = grid
    n = h * w
    if (h // sy) * (w // sx) == 0:
        return n
    return n - int(n * ratio)


def check_shape_case(unet, batch: int, h: int, w: int, ratio: float, use_rand: bool, seed: int = 0):
    """Patched (every level merging: max_downsample=8) against unpatched; returns the observed blocks."""
    inputs = make_inputs(batch, h, w, seed=seed)
    plain = call(unet, inputs)
    model = patched_copy(unet, ratio=ratio, max_downsample=8, use_rand=use_rand)
    observer = Observer(model)
    out = call(model, inputs)
    observer.close()
    assert out.shape == plain.shape and out.dtype == plain.dtype
    assert torch.isfinite(out).all()
    assert len(observer.blocks) == 7  # tiny UNet: 1 + 1 down, 1 mid, 2 + 2 up transformer blocks
    for grid, tokens, _ in observer.blocks:
        assert tokens == expected_tokens(grid, ratio), (grid, tokens)
    any_merged = any(tokens < grid[0] * grid[1] for grid, tokens, _ in observer.blocks)
    if any_merged:
        assert not torch.equal(out, plain)
    else:  # nothing merged anywhere: hooks must be exact no-ops
        assert torch.equal(out, plain)
    return observer.blocks, plain


# --------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    "batch, h, w, merged_grids",
    [
        pytest.param(1, 16, 16, {(16, 16), (8, 8), (4, 4)}, id="batch1-square"),
        pytest.param(3, 16, 24, {(16, 24), (8, 12), (4, 6)}, id="odd-batch3-non-square"),
        pytest.param(1, 63, 65, {(63, 65), (32, 33), (16, 17)}, id="63x65-odd-at-every-level"),
        pytest.param(2, 12, 48, {(12, 48), (6, 24), (3, 12)}, id="cfg-batch2-aspect-1:4"),
        pytest.param(2, 40, 10, {(40, 10), (20, 5), (10, 3)}, id="cfg-batch2-aspect-4:1"),
        pytest.param(2, 2, 8, {(2, 8)}, id="2x8-h1-at-deep-levels"),
        pytest.param(1, 1, 3, set(), id="1x3-no-full-cell-anywhere"),
    ],
)
def test_shapes_match_unpatched_and_merge_every_level_that_has_a_cell(unet, batch, h, w, merged_grids):
    blocks, plain = check_shape_case(unet, batch, h, w, ratio=0.5, use_rand=True)
    assert {grid for grid, tokens, _ in blocks if tokens < grid[0] * grid[1]} == merged_grids
    zero = patched_copy(unet, ratio=0.0, max_downsample=8)
    assert torch.equal(call(zero, make_inputs(batch, h, w)), plain)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 3),
    h=st.integers(1, 22),
    w=st.integers(1, 22),
    ratio=st.sampled_from([0.0, 0.2, 0.5, 0.75]),
    use_rand=st.booleans(),
)
def test_any_small_latent_gives_the_unpatched_shape_and_exact_token_counts(unet, batch, h, w, ratio, use_rand):
    # The unpatched tiny UNet itself rejects batch 1 with h, w <= 2 (GroupNorm over one value per group).
    assume(batch > 1 or max(h, w) > 2)
    blocks, _ = check_shape_case(unet, batch, h, w, ratio, use_rand, seed=h * 100 + w)
    if ratio == 0:
        assert all(tokens == grid[0] * grid[1] for grid, tokens, _ in blocks)


def test_max_downsample_1_never_merges_a_downsampled_grid_even_when_it_is_one_token_high(unet):
    inputs = make_inputs(1, 1, 3)
    model = patched_copy(unet, ratio=0.5, max_downsample=1, sx=2, sy=1)
    observer = Observer(model)
    call(model, inputs)
    observer.close()
    full = [tokens for grid, tokens, _ in observer.blocks if grid == (1, 3)]
    below = [(grid, tokens) for grid, tokens, _ in observer.blocks if grid != (1, 3)]
    assert full and all(tokens == 2 for tokens in full)  # level 1 (one 1x2 cell + 1 leftover) does merge
    assert below and all(tokens == grid[0] * grid[1] for grid, tokens in below)


# --------------------------------------------------------------------------------------------- dtypes


@pytest.fixture(scope="module")
def fp32_reference(unet):
    inputs = make_inputs(2, 16, 16, seed=5)
    return inputs, call(unet, inputs), call(patched_copy(unet, ratio=0.5), inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dtype_is_preserved_and_output_close_to_unpatched(unet, fp32_reference, dtype):
    (sample, timestep, text), plain32, patched32 = fp32_reference
    inputs = (sample.to(dtype), timestep, text.to(dtype))
    model = copy.deepcopy(unet).to(dtype)
    plain = call(model, inputs)
    tome.patch(model, ratio=0.5)
    observer = Observer(model)
    out = call(model, inputs)
    observer.close()
    assert out.dtype == dtype and out.shape == plain.shape
    assert torch.isfinite(out).all()
    # Merged tokens reach attn1 in the model's dtype (a float32 upcast would also break the Linear layers).
    assert {d for _, _, d in observer.blocks} == {dtype}
    assert any(tokens == 128 for grid, tokens, _ in observer.blocks if grid == (16, 16))
    assert not torch.equal(out, plain)
    assert rel_l2(out, plain) < 0.1  # float32 merging changes this output by ~0.03 relative
    assert rel_l2(out, patched32) < 0.05  # rounding only: bf16 ~0.015, fp16 ~0.002


# --------------------------------------------------------------------------------------------- lifecycle


def _saved_files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_state_dict_and_save_pretrained_never_change_and_a_patched_save_loads_unpatched(unet, tmp_path):
    from safetensors.torch import load_file

    model = copy.deepcopy(unet)
    inputs = make_inputs(2, 16, 16, seed=9)
    plain = call(model, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "plain")

    tome.patch(model, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    patched = call(model, inputs)
    assert not torch.equal(patched, plain)
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], v) for k, v in state.items())
    model.save_pretrained(tmp_path / "patched")

    plain_files, patched_files = _saved_files(tmp_path / "plain"), _saved_files(tmp_path / "patched")
    assert sorted(patched_files) == sorted(plain_files)
    weights = [name for name in plain_files if name.endswith(".safetensors")]
    assert weights
    for name in weights:
        saved = load_file(tmp_path / "patched" / name)
        assert saved.keys() == load_file(tmp_path / "plain" / name).keys() == state.keys()
        assert all(torch.equal(saved[k], state[k]) for k in saved)
    assert patched_files == plain_files  # byte for byte, config.json included

    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "patched").eval()
    assert tome.patched_models(loaded) == []
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in loaded.modules())
    assert torch.equal(call(loaded, inputs), plain)
    assert torch.equal(call(model, inputs), patched)  # saving did not unpatch the original either


def test_two_models_with_different_options_share_no_state_across_threads(unet):
    models = {
        "a": patched_copy(unet, ratio=0.5, seed=1),
        "b": patched_copy(unet, ratio=0.3, max_downsample=8, merge_mlp=True, seed=2),
    }
    inputs = {
        "a": [make_inputs(2, 16, 16, seed=s, timestep=t) for s, t in ((1, 900), (2, 500), (3, 100))],
        "b": [make_inputs(1, 10, 22, seed=s, timestep=t) for s, t in ((4, 800), (5, 400), (6, 50))],
    }

    def run(name):
        return [call(models[name], x) for x in inputs[name]]

    alone = {name: run(name) for name in models}  # each model on its own: the oracle
    for _ in range(3):
        results, errors = {}, []
        barrier = threading.Barrier(2)

        def work(name):
            try:
                barrier.wait()
                results[name] = run(name)
            except BaseException as error:  # pragma: no cover - reported below
                errors.append(error)

        threads = [threading.Thread(target=work, args=(name,)) for name in models]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        for name in models:
            for got, want in zip(results[name], alone[name]):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    states = {name: tome.patched_models(model)[0][1] for name, model in models.items()}
    assert states["a"].call.latent_hw == (16, 16) and states["b"].call.latent_hw == (10, 22)
    assert states["a"].config.ratio == 0.5 and states["b"].config.ratio == 0.3


def test_lora_loaded_after_patching_still_applies(unet):
    peft = pytest.importorskip("peft", reason="LoRA goes through peft (pin it in noxfile TORCH)")
    from peft.utils import get_peft_model_state_dict

    inputs = make_inputs(2, 16, 16, seed=11)
    lora_config = peft.LoraConfig(
        r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False
    )
    with_lora = copy.deepcopy(unet)
    torch.manual_seed(5)  # init_lora_weights=False: random, non-zero lora_B
    with_lora.add_adapter(lora_config)
    lora_weights = get_peft_model_state_dict(with_lora)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in lora_weights.items())
    lora_plain = call(with_lora, inputs)
    assert not torch.equal(lora_plain, call(unet, inputs))

    model = patched_copy(unet, ratio=0.5)
    patched_no_lora = call(model, inputs)
    model.load_lora_adapter(lora_weights, prefix=None, adapter_name="test")  # diffusers' PEFT loading path
    after = call(model, inputs)
    assert rel_l2(after, patched_no_lora) > 0.05  # the LoRA applies to the patched model
    patched_first = patched_copy(with_lora, ratio=0.5)  # LoRA loaded before patching: the oracle
    torch.testing.assert_close(after, call(patched_first, inputs), rtol=0, atol=0)
    assert not torch.equal(after, lora_plain)  # and merging still happens around the LoRA layers
    tome.remove(model)
    torch.testing.assert_close(call(model, inputs), lora_plain, rtol=0, atol=0)


def _pipe_kwargs():
    return dict(prompt="a photo of a cat", num_inference_steps=2, guidance_scale=5.0, output_type="np", height=32, width=32)


def _run_pipe(pipe):
    return pipe(**_pipe_kwargs(), generator=torch.Generator().manual_seed(0)).images


def test_model_cpu_offload_hooks_keep_working_with_the_patch():
    pytest.importorskip("accelerate", reason="enable_model_cpu_offload needs accelerate (pin it in noxfile TORCH)")
    pipe = build_pipeline("sd")
    pipe.set_progress_bar_config(disable=True)
    plain = _run_pipe(pipe)
    tome.patch(pipe, ratio=0.5)
    patched = _run_pipe(pipe)
    assert np.abs(patched - plain).max() > 1e-4

    # CPU-only machine: offload "to" the CPU still wraps every component in accelerate's hooks.
    pipe.enable_model_cpu_offload(device="cpu")
    assert hasattr(pipe.unet, "_hf_hook")
    np.testing.assert_array_equal(_run_pipe(pipe), patched)
    (_, state), = tome.patched_models(pipe)
    assert state.ledger.stats and state.ledger.stats[1].kept < state.ledger.stats[1].tokens  # merging ran under the offload hooks

    tome.patch(pipe, ratio=0.5)  # patching a pipeline whose models already carry offload hooks
    np.testing.assert_array_equal(_run_pipe(pipe), patched)
    tome.remove(pipe)
    assert hasattr(pipe.unet, "_hf_hook")  # remove leaves accelerate's hooks alone
    np.testing.assert_array_equal(_run_pipe(pipe), plain)
    pipe.remove_all_hooks()


# --------------------------------------------------------------------------------------------- torch.compile

# One level, three transformer blocks: the smallest UNet whose blocks merge, to keep compile time down.
ONE_LEVEL = dict(
    block_out_channels=(32,),
    down_block_types=("CrossAttnDownBlock2D",),
    up_block_types=("CrossAttnUpBlock2D",),
    mid_block_type=None,
)


def test_torch_compile_equals_eager_without_graph_breaks_or_per_step_recompiles():
    """aot_eager, not inductor: inductor compiles this UNet in ~3 min on the 2 shared CPU cores here,
    aot_eager in ~15 s, and still traces the merge path through dynamo and AOTAutograd."""
    from torch._dynamo.utils import counters

    unet = build_unet("tiny", seed=0, **ONE_LEVEL)
    model = patched_copy(unet, ratio=0.5)
    steps = [make_inputs(2, 8, 8, seed=13, timestep=t) for t in (500, 400, 300)]
    eager = [call(model, x) for x in steps]  # eager first (also the oracle)
    assert not torch.equal(eager[0], call(unet, steps[0]))
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # fullgraph: a break raises
        outputs = [call(compiled, steps[0]), call(compiled, steps[1])]
        graphs = counters["stats"]["unique_graphs"]
        outputs.append(call(compiled, steps[2]))
        assert counters["stats"]["unique_graphs"] == graphs  # a new timestep value does not recompile
        assert not counters["graph_break"], dict(counters["graph_break"])
        for got, want in zip(outputs, eager):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()


def test_compiling_a_freshly_patched_model_in_a_fresh_process_has_no_graph_break(monkeypatch):
    import tome_core.algorithm.backend

    monkeypatch.setattr(tome_core.algorithm.backend, "_cache", {})  # as in a process that never ran ToMe eagerly
    torch.manual_seed(0)
    transformer = Transformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=32, norm_num_groups=32, cross_attention_dim=32
    ).eval()
    tome.patch(transformer, ratio=0.5)
    x, text = torch.randn(2, 32, 8, 8), torch.randn(2, 7, 32)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            compiled = torch.compile(transformer, backend="eager", fullgraph=True)
            out = compiled(x, encoder_hidden_states=text, return_dict=False)[0]
            eager = transformer(x, encoder_hidden_states=text, return_dict=False)[0]
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()


# --------------------------------------------------------------------------------------------- randomness


def _global_rng_states():
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _assert_same_rng(before, after):
    assert torch.equal(before[0], after[0])
    assert before[1][0] == after[1][0] and np.array_equal(before[1][1], after[1][1]) and before[1][2:] == after[1][2:]
    assert before[2] == after[2]


def test_a_patched_pipeline_call_leaves_every_global_rng_untouched():
    pipe = build_pipeline("sd")
    pipe.set_progress_bar_config(disable=True)
    before = _global_rng_states()
    plain = _run_pipe(pipe)  # precondition: the pipeline itself (explicit generator) draws nothing globally
    _assert_same_rng(before, _global_rng_states())
    tome.patch(pipe, ratio=0.5, use_rand=True, max_downsample=8)
    before = _global_rng_states()
    patched = _run_pipe(pipe)
    _assert_same_rng(before, _global_rng_states())
    assert np.abs(patched - plain).max() > 1e-4


@pytest.mark.parametrize("copies", [2, 3], ids=["cfg-batch2", "odd-batch3"])
def test_every_item_of_a_batch_shares_one_partition(unet, copies):
    """Identical cond/uncond items give identical outputs only if they are merged with the same partition."""
    sample, timestep, text = make_inputs(1, 16, 16, seed=17)
    model = patched_copy(unet, ratio=0.5, use_rand=True, max_downsample=8)
    single = call(model, (sample, timestep, text))
    batched = call(model, (sample.repeat(copies, 1, 1, 1), timestep, text.repeat(copies, 1, 1)))
    for item in batched[1:]:
        torch.testing.assert_close(item, batched[0], rtol=0, atol=0)
    # A batch of one draws the same partition as the CFG batch (only float batching noise differs).
    torch.testing.assert_close(batched[0:1], single, rtol=1e-5, atol=1e-5)
    assert rel_l2(single, call(unet, (sample, timestep, text))) > 1e-3

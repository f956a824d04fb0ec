"""Context parallelism (issue #34): diffusers' ``enable_parallelism`` with Ulysses attention, 2 and 4 gloo
processes on the CPU.

Each process runs its scenarios once (the fixtures below) and saves what it saw; the tests compare:

* the processes with each other (every process ends with the whole output, so they must agree);
* the parallel patched output with the unpatched output (single process and parallel: diffusers' split
  changes nothing unpatched), its distance next to the single-process patched output's;
* the tokens attention really sees on each process (the key count of every SDPA call), patched and unpatched;
* the size bias each SDPA call gets, against each process's own piece: text keys 0, and over each process's
  merged keys log sizes that add up to that process's tokens;
* ``remove``: the exact unpatched parallel output; patching before and after ``enable_parallelism`` alike;
* set-ups merging cannot follow, refused with their reason;
* the Flux and Wan pipelines end to end.

Ring attention needs an attention backend that returns log-sum-exp, which diffusers' native (CPU) one does
not: it runs only on GPUs, and is not run here (its refusal with size-aware attention is).
"""

from __future__ import annotations

import datetime
import os
import pathlib
import time
from typing import Any, Callable, Dict, List

import pytest
import torch
from torch.overrides import TorchFunctionMode

import tome_core.torch as tome
from tome_tools.diffusers_parallel_bench import cpu_process_group, free_port
from tome_tools.diffusers_models import (
    build_transformer, build_transformer_pipeline, build_video_transformer, build_wan_pipeline, transformer_inputs,
    video_transformer_inputs,
)

TEXT = 8  # prompt tokens: diffusers splits Flux's text too, so its length divides by the processes


class _KeysSeen(TorchFunctionMode):
    """Records each SDPA call's key count and the additive mask it was given (the size bias, when armed)."""

    def __init__(self):
        super().__init__()
        self.keys: List[int] = []
        self.masks: List[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            key = args[1] if len(args) > 1 else kwargs["key"]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            self.keys.append(key.shape[-2])
            self.masks.append(None if mask is None else mask.detach().clone())
        return func(*args, **kwargs)


def _call(model: torch.nn.Module, inputs: Dict[str, Any]) -> Dict[str, Any]:
    with torch.no_grad(), _KeysSeen() as seen:
        out = model(**inputs, return_dict=False)[0]
    return dict(out=out, keys=seen.keys, masks=seen.masks)


def _parallel(model: torch.nn.Module, world: int, **options: Any) -> torch.nn.Module:
    from diffusers import ContextParallelConfig

    model.enable_parallelism(config=ContextParallelConfig(**{"ulysses_degree": world, **options}))
    return model


def _error(action: Callable[[], Any]) -> str:
    try:
        action()
    except ValueError as error:
        return str(error)
    return ""


def _model_scenarios(build: Callable[[], torch.nn.Module], inputs: Dict[str, Any], world: int) -> Dict[str, Any]:
    """One model: single process unpatched and patched, then parallel unpatched, patched (ratio 0.5 and the
    default), removed; and a second copy patched before ``enable_parallelism``."""
    model = build()
    seen = dict(ref=_call(model, inputs))
    tome.patch(model, ratio=0.5)
    seen["one"] = _call(model, inputs)
    tome.remove(model)
    _parallel(model, world)
    seen["cp"] = _call(model, inputs)
    tome.patch(model, ratio=0.5)
    seen["cpp"] = _call(model, inputs)
    state = tome.patched_models(model)[0].state
    seen["grid"], seen["stats"], seen["summary"] = state.grid_hw, dict(state.ledger.stats), state.summary()
    tome.patch(model)
    seen["cpd"] = _call(model, inputs)
    tome.remove(model)
    seen["removed"] = _call(model, inputs)
    before = tome.patch(build(), ratio=0.5)  # the other order of set-up
    seen["before"] = _call(_parallel(before, world), inputs)
    return seen


def _flux_inputs(height: int = 32, width: int = 32) -> Dict[str, Any]:
    return transformer_inputs(build_transformer("tiny-flux"), height, width, text=TEXT)


def _refusals(world: int) -> Dict[str, str]:
    """The messages of set-ups merging cannot follow ("" where nothing was raised)."""
    flux = lambda: build_transformer("tiny-flux")  # noqa: E731
    found = {}
    odd_rows = _parallel(tome.patch(flux(), ratio=0.5), world)  # 15 x 16 tokens: 240 divide, 15 rows do not
    found["rows"] = _error(lambda: odd_rows(**_flux_inputs(30, 32), return_dict=False))
    thin = _parallel(tome.patch(flux(), ratio=0.5), world)  # 2 x 16 tokens: a piece of 1 row, under a 2x2 cell
    found["cell"] = _error(lambda: thin(**_flux_inputs(4, 32), return_dict=False))
    kontext = _parallel(tome.patch(flux(), ratio=0.5), world)  # a reference image's tokens after the output's
    inputs = _flux_inputs(32, 32)
    reference = inputs["img_ids"].clone()
    reference[:, 0] = 1
    inputs.update(img_ids=torch.cat([inputs["img_ids"], reference]), hidden_states=inputs["hidden_states"].repeat(1, 2, 1))
    found["tail"] = _error(lambda: kontext(**inputs, return_dict=False))
    anything = _parallel(flux(), world, ulysses_anything=True)
    found["anything"] = _error(lambda: tome.patch(anything, ratio=0.5))
    late = _parallel(tome.patch(flux(), ratio=0.5), world, ulysses_anything=True)  # enabled after patch
    found["anything_late"] = _error(lambda: late(**_flux_inputs(), return_dict=False))
    ring = _parallel(flux(), 1, ring_degree=world)
    found["ring"] = _error(lambda: tome.patch(ring, ratio=0.5))
    found["ring_unbiased"] = _error(lambda: tome.patch(ring, ratio=0.5, proportional_attn=False))
    return found


def _pipelines(world: int) -> Dict[str, Any]:
    """FluxPipeline and WanPipeline, 2 steps, unpatched and patched (ratio 0.5) under context parallelism."""
    found = {}
    pipe, call = build_transformer_pipeline("flux", text=TEXT)
    call.update(height=64, width=64, num_inference_steps=2, output_type="latent")
    _parallel(pipe.transformer, world)
    wan, wan_call = build_wan_pipeline()
    wan_call.update(height=32, width=32, num_frames=3, num_inference_steps=2, output_type="latent")
    _parallel(wan.transformer, world)
    for name, (p, kwargs) in dict(flux=(pipe, call), wan=(wan, wan_call)).items():
        run = lambda: p(**kwargs, generator=torch.Generator().manual_seed(0))[0]  # noqa: E731
        with torch.no_grad():
            found[f"{name}_cp"] = run()
            tome.patch(p, ratio=0.5)
            found[f"{name}_cpp"] = run()
            found[f"{name}_summary"] = tome.patched_models(p)[0].state.summary()
            tome.remove(p)
    return found


def _worker(rank: int, world: int, port: int, out_dir: str, full: bool) -> None:
    from tome_core.models import cost
    cost.MIN_TOKENS = dict.fromkeys(cost.MIN_TOKENS, 0)  # tiny models merge, as tests/conftest.py has it
    with cpu_process_group(rank, world, port, datetime.timedelta(seconds=120)):
        # Ulysses hands each process a share of the heads: as many heads as processes at least
        flux = lambda: build_transformer("tiny-flux", num_attention_heads=max(2, world))  # noqa: E731
        seen: Dict[str, Any] = dict(flux=_model_scenarios(flux, _flux_inputs(), world))
        if full:
            wan = lambda: build_video_transformer("tiny-wan")  # noqa: E731
            seen["wan"] = _model_scenarios(wan, video_transformer_inputs(wan(), 3, 16, 16, text=TEXT), world)
            for preset in ("tiny-flux2", "tiny-qwen-image"):
                build = lambda: build_transformer(preset)  # noqa: E731
                inputs = transformer_inputs(build(), 32, 32, text=TEXT)
                if "flux2" in preset:  # diffusers' plan splits Flux.2's ids along their token axis: batched ids
                    inputs.update(img_ids=inputs["img_ids"][None], txt_ids=inputs["txt_ids"][None])
                seen[preset[5:]] = _model_scenarios(build, inputs, world)
            seen["refused"] = _refusals(world)
            seen["pipelines"] = _pipelines(world)
        torch.save(seen, os.path.join(out_dir, f"rank{rank}.pt"))


def _run(world: int, full: bool, out_dir: pathlib.Path) -> List[Dict[str, Any]]:
    import torch.multiprocessing as mp

    context = mp.start_processes(_worker, args=(world, free_port(), str(out_dir), full), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + 300
    while not context.join(timeout=5):  # raises if a process failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} processes did not finish in 300 s")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


@pytest.fixture(scope="module")
def spawnable(request):
    # spawned processes unpickle the worker from this module: the checkout's root must be on their path
    root = str(pathlib.Path(__file__).resolve().parents[2])
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.syspath_prepend(root)
    request.addfinalizer(monkeypatch.undo)


@pytest.fixture(scope="module")
def two(spawnable, tmp_path_factory):
    return _run(2, True, tmp_path_factory.mktemp("cp2"))


@pytest.fixture(scope="module")
def four(spawnable, tmp_path_factory):
    return _run(4, False, tmp_path_factory.mktemp("cp4"))


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().mean().item()


MODELS = ["flux", "wan", "flux2", "qwen-image"]


@pytest.mark.parametrize("family", MODELS)
def test_every_process_merges_its_piece_and_they_agree(two, family):
    ranks = [seen[family] for seen in two]
    for name in ("cp", "cpp", "cpd", "removed", "before"):
        for other in ranks[1:]:
            torch.testing.assert_close(other[name]["out"], ranks[0][name]["out"], rtol=0, atol=1e-6)
    for seen in ranks:
        (level,) = seen["stats"].values()
        assert level.blocks == 2 and level.kept == level.tokens // 2
        assert level.tokens == seen["grid"][0] * seen["grid"][1]
        assert "each of 2 processes" in seen["summary"]


@pytest.mark.parametrize("family", MODELS)
def test_parallel_patched_output_is_as_close_to_unpatched_as_one_process(two, family):
    seen = two[0][family]
    torch.testing.assert_close(seen["cp"]["out"], seen["ref"]["out"], rtol=0, atol=1e-5)  # the split alone
    one, parallel = _distance(seen["one"]["out"], seen["ref"]["out"]), _distance(seen["cpp"]["out"], seen["ref"]["out"])
    assert one > 1e-3 and parallel > 1e-3  # both merge
    assert parallel < 1.5 * one, (parallel, one)
    assert _distance(seen["cpd"]["out"], seen["ref"]["out"]) > 1e-4


@pytest.mark.parametrize("family", MODELS)
def test_remove_restores_the_exact_parallel_output_in_either_order(two, family):
    seen = two[0][family]
    assert torch.equal(seen["removed"]["out"], seen["cp"]["out"])
    torch.testing.assert_close(seen["before"]["out"], seen["cpp"]["out"], rtol=0, atol=1e-6)


def test_attention_sees_every_process_merged_keys(two):
    """Flux (16 x 16 tokens, 8 prompt tokens; 2 processes): every SDPA call gathers both processes' pieces: 2 x
    (4 prompt + 128 image) keys unpatched, 2 x (4 + 64) merged. Wan (3 x 8 x 8 tokens): 2 x 96 self-attention
    keys, 2 x 48 merged."""
    flux, wan = two[0]["flux"], two[0]["wan"]
    assert flux["cp"]["keys"] == [264, 264] and flux["cpp"]["keys"] == [136, 136]
    assert flux["ref"]["keys"] == [264, 264]
    self_keys = lambda keys: [k for k in keys if k != TEXT]  # noqa: E731 (Wan's cross-attention: its prompt)
    assert self_keys(wan["cp"]["keys"]) == [192, 192] and self_keys(wan["cpp"]["keys"]) == [96, 96]


@pytest.mark.parametrize("family, text, tokens", [("flux", TEXT // 2, 128), ("wan", 0, 96)])
def test_size_bias_follows_each_process_keys(two, family, text, tokens):
    masks = [[m for m in seen[family]["cpp"]["masks"] if m is not None] for seen in two]
    assert masks[0] and len(masks[0]) == len(masks[1])
    for mine, theirs in zip(*masks):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)  # one key order on every process
        pieces = mine.reshape(mine.shape[0], 2, -1)  # [batch, process, keys of one process]
        assert torch.equal(pieces[..., :text], torch.zeros_like(pieces[..., :text]))
        sizes = pieces[..., text:].exp().sum(-1)
        torch.testing.assert_close(sizes, torch.full_like(sizes, float(tokens)), rtol=1e-5, atol=1e-4)
        assert not torch.equal(pieces[:, 0], pieces[:, 1])  # each process's own sizes


def test_setups_merging_cannot_follow_are_refused(two):
    refused = two[0]["refused"]
    assert "15 rows do not divide by 2" in refused["rows"]
    assert "smaller than one 2x2 cell" in refused["cell"]
    assert "tokens of other images" in refused["tail"]
    assert "ulysses_anything or ring_anything" in refused["anything"]
    assert "ulysses_anything or ring_anything" in refused["anything_late"]
    assert "ring attention" in refused["ring"] and "proportional_attn=False" in refused["ring"]
    assert refused["ring_unbiased"] == ""


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_pipelines_run_end_to_end(two, family):
    for seen in two:
        found = seen["pipelines"]
        assert torch.isfinite(found[f"{family}_cpp"]).all()
        assert _distance(found[f"{family}_cpp"], found[f"{family}_cp"]) > 1e-5
        assert "each of 2 processes" in found[f"{family}_summary"]
    torch.testing.assert_close(two[1]["pipelines"][f"{family}_cpp"], two[0]["pipelines"][f"{family}_cpp"], rtol=0, atol=1e-6)


def test_four_processes_merge_strips_of_rows(four):
    """16 x 16 tokens on 4 processes: each merges its 4 x 16 strip (not an 8 x 8 grid)."""
    for seen in four:
        flux = seen["flux"]
        assert flux["grid"] == (4, 16)
        (level,) = flux["stats"].values()
        assert (level.tokens, level.kept) == (64, 32)
        torch.testing.assert_close(flux["cpp"]["out"], four[0]["flux"]["cpp"]["out"], rtol=0, atol=1e-6)
        assert flux["cpp"]["keys"] == [4 * (2 + 32)] * 2
    one, parallel = (_distance(four[0]["flux"][name]["out"], four[0]["flux"]["ref"]["out"]) for name in ("one", "cpp"))
    assert parallel < 2 * one, (parallel, one)


PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "parallel.md"


def _snippet_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One process of docs/parallel.md's snippet, as torchrun would start it (its environment variables), as a user
    runs it: outside the clone, in ``out_dir`` where the tiny Flux is saved under the id it loads."""
    import contextlib
    import re
    import warnings

    from .test_readme import outside_the_clone

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = "\n".join(re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S))
    with open(os.path.join(out_dir, f"printed{rank}.txt"), "w") as out, contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with outside_the_clone(pathlib.Path(out_dir), {}):
            exec(compile(code, str(PAGE), "exec"), {})


def test_the_parallel_page_snippet_runs_as_its_comments_say(spawnable, tmp_path):
    import torch.multiprocessing as mp

    from .test_readme import FLUX, flux_pipeline, printed_as_commented

    flux_pipeline().save_pretrained(tmp_path / FLUX)
    mp.start_processes(_snippet_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    printed = (tmp_path / "printed0.txt").read_text()
    comments = [line[2:] for line in PAGE.read_text().split("print(tome.patched_models")[1].splitlines()[1:3]]
    for comment in comments:
        assert printed_as_commented(comment, printed), (comment, printed)
    assert "2 blocks, 128 -> 64 tokens (50% merged; tokens, similarity)" in printed  # each process's 8 of 16 rows
    assert (tmp_path / "printed1.txt").read_text() == ""

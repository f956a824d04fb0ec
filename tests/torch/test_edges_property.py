"""The edges of issue 43 as one property over every family of the zoo (tests/torch/test_zoo.py's ``MERGED``).

For each model class ToMe merges, hypothesis draws a call: the family's own inputs or the same family on another
token grid (1x1, 1xN, odd, non-square, larger), a batch of 1-3 (items of different sizes where the family takes a
list of latents), float32 or bfloat16, ``prefer`` "fidelity"/"balance"/"speed" or ``ratio=0.5``, and optionally
an ``Exception`` or a ``KeyboardInterrupt`` raised once inside one sub-layer (an attention or feed-forward module,
or a projection inside an attention). Only calls that the unpatched model itself runs are judged. Then:

- the call merges, with no SDPA call seeing more keys than unpatched and some seeing fewer, or it runs unmerged
  and says why once (a ``UserWarning`` on the first call, none on the second, and ``summary()`` says no block
  merged);
- nothing raises once ``patch`` accepted the model, except the injected fault itself, unchanged;
- ``ratio=0`` and ``remove`` give the unpatched output bit for bit (within float noise where the unpatched model
  is itself not deterministic);
- ``summary()`` matches what attention saw: each level's ``tokens - kept`` is the key reduction that SDPA calls
  see, on as many calls as it names blocks (or a multiple: some processors loop over the batch), and its token
  count is the grid of every item (where the inputs were built on known grids);
- the process's attention is intact afterwards: torch's function-mode stack is empty, a plain SDPA call gives
  its exact result, and the patched model gives its earlier output again.

A second property compiles the model (``torch.compile`` with the "eager" and "aot_eager" backends,
``fullgraph=True`` where the unpatched model traces whole): compiled equals eager, patched and removed.

Oracles: the unpatched model (outputs, and the keys of every ``scaled_dot_product_attention`` call, counted by a
``TorchFunctionMode``), the grid the inputs were built on, plain SDPA. Models are built once per family and dtype.

Five more properties (issue 59, "edges round three") each draw one dimension its findings opened, with its own
oracle: an SDPA call a hook on ``to_q`` makes inside a merged attention (equals the same call made outside); a grid
that changes within a generation under ``reuse_steps`` (equals a fresh patch's call); video transformers of 1 to 5
token frames with odd rows and ``frame_window`` (every merged token within the window of its frame, read from the
inputs' shape; a window spanning the clip equals ``frame_window=None``); IP-Adapter processors, Flux's and the
UNet's (run, finite, at scale 0 equal to the plain processor's patched output); and ``mode="kv"`` kernel calls over
the leading head tokens alone, Flux.2 Klein KV's and Qwen-Image 2.1's (as many keys as unpatched; their caches'
steps agree as unpatched).

Runs: the default draws one call per family (each family its own) and compiles Flux once per backend (CI's
budget); the five round-three properties draw 4 to 8 fixed calls each; ``TOME_EDGES_WIDE=1`` draws many more
(``TOME_EDGES_EXAMPLES`` per family and per round-three property, ``TOME_EDGES_COMPILED`` per backend); ``TOME_EDGES_SURVEY=path`` records every example judged and every violation as JSON lines in ``path``
instead of failing at the first, so one wide run lists them all.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import re
import sys
import warnings
import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, assume, example, given, note, settings
from hypothesis import strategies as st

import tome_core.torch as tome
from tome_tools import diffusers_models as tools
from tome_tools.diffusers_bench import SdpaCalls


def _zoo_module():
    """tests/torch/test_zoo.py, whose ``MERGED`` builds every merged class tiny (loaded once per process)."""
    name = "_tome_test_zoo"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name("test_zoo.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


zoo = _zoo_module()

WIDE = os.environ.get("TOME_EDGES_WIDE") == "1"
SURVEY = os.environ.get("TOME_EDGES_SURVEY")
FAMILIES = sorted(zoo.MERGED)
# token grids (rows, columns) at the model's patch level; None: the family's own inputs
GRIDS = [(1, 1), (1, 2), (2, 1), (1, 5), (2, 2), (3, 3), (3, 5), (5, 2), (4, 4), (4, 7), (6, 10), (7, 9), (8, 8), (12, 20)]
WIDE_GRIDS = GRIDS + [(1, 16), (16, 1), (16, 16), (24, 16)]
OPTIONS = [{"prefer": "fidelity"}, {"prefer": "balance"}, {"prefer": "speed"}, {"ratio": 0.5}]
FAULTS = [None, None, "exception", "interrupt"]


class Injected(RuntimeError):
    """The exception raised inside a sub-layer (a ``KeyboardInterrupt`` is raised as it is)."""


# ---------------------------------------------------------------------------------------------------------
# Counting what attention sees


def _call(model: torch.nn.Module, inputs: Dict[str, Any]) -> Tuple[List[Tuple[int, int]], torch.Tensor]:
    with SdpaCalls() as counter:
        output = zoo._run(model, inputs)
    return counter.lengths, output.float()


def _summary(model: torch.nn.Module) -> str:
    return tome.patched_models(model)[0].state.summary()


LINE = re.compile(r"1/(\d+) scale: (\d+) blocks, (\d+) -> (\d+) (tokens|keys/values|queries)")


def _levels(summary: str) -> List[Tuple[int, int, int, int]]:
    """(factor, blocks, tokens, kept) of each line of ``summary`` (fallback lines included)."""
    return [tuple(int(g) for g in m.groups()[:4]) for m in LINE.finditer(summary)]


# ---------------------------------------------------------------------------------------------------------
# The families: built once, called on other grids and batches


@dataclass(frozen=True)
class Case:
    grid: Optional[Tuple[int, int]]  # None: the family's own inputs
    batch: Optional[int]  # None: the family's own
    mixed: bool  # items of different sizes (families that take a list of latents)
    dtype: torch.dtype
    options: Tuple[Tuple[str, Any], ...]
    fault: Optional[str]  # None, "exception" or "interrupt"
    where: int  # which sub-layer the fault is raised in (modulo their count)


BASE = Case(None, None, False, torch.float32, (("prefer", "balance"),), None, 0)


def cases(family: str, grids: Sequence[Tuple[int, int]], faults: Sequence[Optional[str]] = FAULTS) -> st.SearchStrategy[Case]:
    """Calls of ``family``. Each choice's list is rotated by the family's name, so that the first (simplest)
    draw, which is all a derandomized run of one example gets, differs from family to family."""
    turn = zlib.crc32(family.encode())

    def rotated(values: Sequence[Any], salt: int) -> st.SearchStrategy[Any]:
        k = (turn // salt) % len(values)
        return st.sampled_from(list(values[k:]) + list(values[:k]))

    return st.builds(
        Case,
        grid=rotated([None, *grids], 1),
        batch=rotated([None, 1, 2, 3], 7),
        mixed=rotated([False, True], 11),
        dtype=rotated([torch.float32, torch.bfloat16], 13),
        options=rotated([tuple(o.items()) for o in OPTIONS], 17),
        fault=rotated(list(faults), 19),
        where=st.integers(0, 1000).map(lambda w: w + turn % 997),
    )


def _closure(function: Callable) -> Dict[str, Any]:
    """The variables a test_zoo builder closes over (``_transformer(preset, ...)``, ``_video(preset, frames...)``)."""
    cells = function.__closure__ or ()
    return {name: cell.cell_contents for name, cell in zip(function.__code__.co_freevars, cells)}


def _patch_size(model: torch.nn.Module) -> int:
    """The model's spatial patch (1 where it has none: UNets)."""
    patch = model.config.get("patch_size") or 1
    return int(patch[-1] if isinstance(patch, (list, tuple)) else patch)


def _rebatch(value: Any, base: int, batch: int) -> Any:
    """``value`` of a call over ``base`` items as one over ``batch`` (items taken in turn): tensors and lists whose
    first dimension is the batch, inside dicts, tuples and lists."""
    order = [i % base for i in range(batch)]
    if isinstance(value, torch.Tensor):
        return value[order] if value.dim() >= 1 and value.shape[0] == base else value
    if isinstance(value, list) and len(value) == base and base > 1:
        return [value[i] for i in order]
    if isinstance(value, (list, tuple)):
        return type(value)(_rebatch(v, base, batch) for v in value)
    if isinstance(value, dict):
        return {k: _rebatch(v, base, batch) for k, v in value.items()}
    return value


LATENTS = ("hidden_states", "sample", "latents", "controls_latents")


def _spatial(model: torch.nn.Module, latent: torch.Tensor) -> Tuple[int, int]:
    """The dimensions of ``latent`` that hold its rows and columns (channels-last latents: Kandinsky 5 and 6)."""
    return (-3, -2) if model.config.get("in_visual_dim") and latent.dim() == 5 else (-2, -1)


def _hunyuan_dit_rotary(model: torch.nn.Module, rows: int, cols: int) -> Dict[str, Any]:
    """HunyuanDiT's rotary table for a ``rows x cols`` grid, as its pipeline builds it."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    head = model.config.hidden_size // model.config.num_attention_heads
    return {"image_rotary_emb": get_2d_rotary_pos_embed(head, ((0, 0), (rows, cols)), (rows, cols), output_type="pt")}


# Inputs tied to the grid that a family's pipeline computes from it (without them its own model refuses the size)
GRID_INPUTS: Dict[str, Callable[[torch.nn.Module, int, int], Dict[str, Any]]] = {
    "HunyuanDiT2DModel": _hunyuan_dit_rotary,
    "HunyuanDiT2DControlNetModel": _hunyuan_dit_rotary,
}


def _resized(model: torch.nn.Module, inputs: Dict[str, Any], rows: int, cols: int) -> Optional[Dict[str, Any]]:
    """The family's own inputs with the latent (and every tensor of its size or a whole multiple of it) on a
    ``rows x cols`` token grid, redrawn; None where the family takes no spatial latent (packed tokens)."""
    key = next((k for k in LATENTS if isinstance(inputs.get(k), torch.Tensor) and inputs[k].dim() >= 4), None)
    if key is None:
        return None
    dims = _spatial(model, inputs[key])
    h0, w0 = (inputs[key].shape[d] for d in dims)
    patch = _patch_size(model)
    generator = torch.Generator().manual_seed(rows * 100 + cols)

    def redraw(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 4 and value.is_floating_point():
            h, w = (value.shape[d] for d in dims)
            if h % h0 == 0 and w % w0 == 0 and h // h0 == w // w0:
                shape = list(value.shape)
                shape[dims[0]], shape[dims[1]] = rows * patch * (h // h0), cols * patch * (w // w0)
                return torch.randn(*shape, generator=generator)
        if isinstance(value, (list, tuple)):
            return type(value)(redraw(v) for v in value)
        return value

    call = {k: redraw(v) for k, v in inputs.items()}
    if type(model).__name__ in GRID_INPUTS:
        call.update(GRID_INPUTS[type(model).__name__](model, rows, cols))
    assume(call[key].numel() <= max(4 * inputs[key].numel(), 20_000))  # large video latents: CI's budget
    return call


def _z_image_inputs(inputs: Dict[str, Any], grids: List[Tuple[int, int]]) -> Dict[str, Any]:
    """Z-Image's call (a list of latents [C, F, H, W] and of captions) with item i on ``grids[i]`` (patch 2)."""
    generator = torch.Generator().manual_seed(sum(r * 31 + c for r, c in grids))
    channels, width = inputs["x"][0].shape[0], inputs["cap_feats"][0].shape[1]
    out = dict(inputs)
    out["x"] = [torch.randn(channels, 1, 2 * r, 2 * c, generator=generator) for r, c in grids]
    out["cap_feats"] = [torch.randn(5 + 3 * i, width, generator=generator) for i in range(len(grids))]
    out["t"] = torch.full((len(grids),), float(inputs["t"][0]))
    if "control_context" in inputs:
        out["control_context"] = [torch.randn(channels, 1, 2 * r, 2 * c, generator=generator) for r, c in grids]
    return out


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of two or more dimensions in ``dtype`` (timesteps and scalars stay as the family gives them)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dim() >= 2 else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


_MODELS: Dict[Tuple[str, torch.dtype], Tuple[torch.nn.Module, Dict[str, Any]]] = {}


def _model(family: str, dtype: torch.dtype) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """The family's tiny model in ``dtype`` and its own inputs, built once per process."""
    if (family, dtype) not in _MODELS:
        model, inputs = zoo.MERGED[family]()
        _MODELS[family, dtype] = (model.to(dtype), inputs)
    return _MODELS[family, dtype]


Grids = Optional[List[Tuple[int, int, int]]]  # (frames, rows, cols) of each item's tokens; None: not known


def build_call(family: str, case: Case) -> Tuple[torch.nn.Module, Dict[str, Any], Grids]:
    """The model, the inputs of ``case`` and the token grid of each item where the inputs were built on known
    grids (None: the family's own inputs, or its latent redrawn at another size)."""
    model, inputs = _model(family, case.dtype)
    builder = zoo.MERGED[family]
    closure = _closure(builder)
    grid = case.grid
    if "x" in inputs and isinstance(inputs["x"], list):  # Z-Image: a list of latents, each its own size
        batch = case.batch or len(inputs["x"])
        if grid is None and not case.mixed:
            if batch == len(inputs["x"]):
                return model, _cast(inputs, case.dtype), None
            grids = [(inputs["x"][0].shape[-2] // 2, inputs["x"][0].shape[-1] // 2)] * batch
        else:
            rows, cols = grid or (6, 10)
            grids = [(rows + (i if case.mixed else 0), cols + (2 * i if case.mixed else 0)) for i in range(batch)]
        return model, _cast(_z_image_inputs(inputs, grids), case.dtype), [(1, r, c) for r, c in grids]
    if grid is None:
        base = _batch_of(inputs)
        call = inputs if case.batch is None or base is None else _rebatch(inputs, base, case.batch)
        return model, _cast(call, case.dtype), None
    rows, cols = grid
    batch = case.batch or 2
    if "preset" in closure and "frames" in closure:  # a video transformer of the presets
        patch = _patch_size(model)
        call = tools.video_transformer_inputs(model, closure["frames"], rows * patch, cols * patch, batch=batch)
        frames = closure["frames"] // int(model.config.get("patch_size_t") or 1)
        return model, _cast(call, case.dtype), [(frames, rows, cols)] * batch
    if "preset" in closure:  # a transformer of the presets: 2x2 latent pixels a token
        call = tools.transformer_inputs(model, 2 * rows, 2 * cols, batch=batch)
        return model, _cast(call, case.dtype), [(1, rows, cols)] * batch
    if "kind" in closure:  # a video UNet: its latent is the grid of its finest level, frame by frame
        call = tools.video_unet_inputs(model, 3, rows, cols, batch=batch)
        return model, _cast(call, case.dtype), [(1, rows, cols)] * batch
    call = _resized(model, inputs, rows, cols)
    assume(call is not None)
    base = _batch_of(inputs)
    if case.batch is not None and base is not None:
        call = _rebatch(call, base, case.batch)
    return model, _cast(call, case.dtype), None


def _batch_of(inputs: Dict[str, Any]) -> Optional[int]:
    latent = next((inputs[k] for k in (*LATENTS, "input_ids") if isinstance(inputs.get(k), torch.Tensor)), None)
    return None if latent is None else latent.shape[0]


# ---------------------------------------------------------------------------------------------------------
# What is checked


class Violations:
    """The property's failed checks for one example; reported together (or recorded, in a survey)."""

    def __init__(self, test: str, family: str, case: Any):
        self.test, self.family, self.case = test, family, case
        self.found: List[Tuple[str, str]] = []

    def check(self, ok: bool, check: str, message: str = "") -> bool:
        if not ok:
            self.found.append((check, message))
        return ok

    def report(self) -> None:
        if SURVEY:  # every example judged is counted, with the checks it failed
            with open(SURVEY, "a") as out:
                out.write(json.dumps(dict(test=self.test, family=self.family, case=repr(self.case), check=None, failed=len(self.found))) + "\n")
                for check, message in self.found:
                    out.write(json.dumps(dict(test=self.test, family=self.family, case=repr(self.case), check=check, message=message[:600])) + "\n")
            return
        if not self.found:
            return
        raise AssertionError(f"{self.family} {self.case}:\n" + "\n".join(f"- {c}: {m}" for c, m in self.found))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _close(a: torch.Tensor, b: torch.Tensor, exact: bool, dtype: torch.dtype) -> bool:
    """Bit for bit where the unpatched model is deterministic, else within float noise."""
    if a.shape != b.shape:
        return False
    if exact:
        return torch.equal(a, b)
    return bool(torch.isfinite(a).all()) and _rel(a, b) <= (1e-5 if dtype == torch.float32 else 2e-2)


def _clean_function_modes() -> int:
    """Pops what an interrupted call left on torch's function-mode stack (so later examples are judged alone)."""
    left = torch._C._len_torch_function_stack()
    for _ in range(left):
        torch._C._pop_torch_function_stack()
    return left


_SDPA_INPUTS = [torch.randn(2, 2, 9, 8, generator=torch.Generator().manual_seed(k)) for k in range(3)]
_SDPA_EXPECTED = F.scaled_dot_product_attention(*_SDPA_INPUTS)


def _plain_sdpa_intact(out: torch.Tensor) -> bool:
    """A plain SDPA call as before, to float noise: the thread count other tests set may change its last bits; a stale
    size bias changes it by far more."""
    return torch.allclose(out, _SDPA_EXPECTED, rtol=0, atol=1e-6)


def _sublayers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Where a fault is raised: every attention and feed-forward module, and the key projection inside each
    attention (after ToMe's hooks on the attention have run)."""
    found = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        last = name.rsplit(".", 1)[-1]
        if "Attention" in kind or kind == "FeedForward" or last in ("ff", "ff_context", "mlp", "ffn", "feed_forward"):
            found.append(module)
            inner = getattr(module, "to_k", None)
            if isinstance(inner, torch.nn.Module):
                found.append(inner)
    return found


def _raise_once(module: torch.nn.Module, fault: str):
    state = {"raised": None}

    def hook(m, args):
        if state["raised"] is None:
            state["raised"] = KeyboardInterrupt("injected") if fault == "interrupt" else Injected("injected")
            raise state["raised"]

    return module.register_forward_pre_hook(hook), state


_OWN_WARNINGS: Dict[str, set] = {}  # what each family's unpatched model itself warns


def _said(family: str, caught) -> List[str]:
    """The UserWarnings of a patched call that the unpatched model does not give: ToMe's."""
    own = _OWN_WARNINGS.get(family, set())
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and str(w.message) not in own]


_REJECTED: set = set()
_DETERMINISTIC: Dict[Tuple[str, torch.dtype], bool] = {}  # whether the unpatched model repeats its output bit for bit


def _unpatched(family: str, case: Case, model, inputs) -> Tuple[List[Tuple[int, int]], torch.Tensor]:
    """The unpatched call; inputs the unpatched model does not run are not the property's (the example is
    rejected, and remembered so that it is rejected without a call next time)."""
    key = (family, case.grid, case.batch, case.mixed, case.dtype)
    assume(key not in _REJECTED)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plain, reference = _call(model, inputs)
        _OWN_WARNINGS.setdefault(family, set()).update(str(w.message) for w in caught)
    except Exception:
        _REJECTED.add(key)
        assume(False)
    assume(bool(torch.isfinite(reference).all()))
    if (family, case.dtype) not in _DETERMINISTIC:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _DETERMINISTIC[family, case.dtype] = torch.equal(_call(model, inputs)[1], reference)
    return plain, reference


def _summary_matches(v: Violations, summary: str, plain, seen, grids: Grids) -> None:
    """``summary()`` against the keys SDPA saw and the grid the call was built on."""
    levels = [level for level in _levels(summary) if level[2] > level[3]]  # "0% merged" lines say it ran unmerged
    reductions = [p - s for (_, p), (_, s) in zip(plain, seen)]
    merged = [r for r in reductions if r > 0]
    if not levels:
        v.check(not merged, "summary says nothing merged but attention saw fewer keys", f"{summary!r}; reductions {merged}")
        return
    v.check(bool(merged), "summary reports merging that attention did not see", f"{summary!r}; no SDPA call saw fewer keys")
    by_reduction: Dict[int, int] = {}
    for factor, blocks, tokens, kept in levels:
        by_reduction[tokens - kept] = by_reduction.get(tokens - kept, 0) + blocks
    for reduction, blocks in sorted(by_reduction.items()):
        calls = merged.count(reduction)
        v.check(
            calls > 0 and calls % blocks == 0, "summary's blocks differ from the SDPA calls that saw fewer keys",
            f"{summary!r}: {blocks} blocks of {reduction} fewer keys, but {calls} SDPA calls saw {reduction} fewer keys "
            f"(all reductions {merged})",
        )
    stray = sorted(set(merged) - set(by_reduction))
    v.check(not stray, "attention saw key reductions that summary does not report", f"{summary!r}; reductions {stray}")
    for factor, blocks, tokens, kept in levels if grids is not None else ():
        expected = {f * math.ceil(r / factor) * math.ceil(c / factor) for f, r, c in grids}
        v.check(  # items of different sizes merged on one grid: some item's tokens were taken for another grid's
            expected == {tokens}, "summary's token count is not every item's grid",
            f"{summary!r}: {tokens} tokens at 1/{factor}, the items' grids (frames, rows, cols) {sorted(set(grids))} give {sorted(expected)}",
        )


# ---------------------------------------------------------------------------------------------------------
# The eager property

EAGER = settings(  # by default one call per family (its rotated first draw); wide, many
    max_examples=int(os.environ.get("TOME_EDGES_EXAMPLES", 30)) if WIDE else 1,
    deadline=None,
    derandomize=not WIDE,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_call_merges_or_says_why_and_leaves_the_process_intact(family):
    calls = given(case=cases(family, WIDE_GRIDS if WIDE else GRIDS))(lambda case: _eager_example(family, case))
    if WIDE:
        calls = example(case=BASE)(calls)
    EAGER(calls)()


def _eager_example(family: str, case: Case) -> None:
    note(f"{family} {case}")
    model, inputs, grids = build_call(family, case)
    plain, reference = _unpatched(family, case, model, inputs)
    v = Violations("eager", family, case)
    same = lambda a, b: _close(a, b, _DETERMINISTIC[family, case.dtype], case.dtype)  # noqa: E731
    try:
        _eager_property(v, family, case, model, inputs, grids, plain, reference, same)
    except Exception as error:  # a crash after patch accepted the model (an injected fault is caught inside)
        v.check(False, "crashed after patch accepted the model", f"{type(error).__name__}: {error}")
    finally:
        left = _clean_function_modes()
        v.check(left == 0, "torch function modes left on the stack after the example", f"{left} left")
        tome.remove(model)
        try:
            after = _call(model, inputs)[1]
            v.check(same(after, reference), "remove is not exact", f"rel {_rel(after, reference):.3g}")
        except Exception as error:
            v.check(False, "the removed model crashes", f"{type(error).__name__}: {error}")
    v.report()


def _eager_property(v: Violations, family: str, case: Case, model, inputs, grids: Grids, plain, reference, same) -> None:
    options = dict(case.options)
    # ratio=0 is exact, and attention sees every key
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tome.patch(model, ratio=0.0)
        zero_seen, zero = _call(model, inputs)
    v.check(same(zero, reference), "ratio=0 is not exact", f"rel {_rel(zero, reference):.3g}")
    v.check(zero_seen == plain, "ratio=0 changes what attention sees", f"{zero_seen} vs {plain}")
    tome.remove(model)

    try:
        with warnings.catch_warnings(record=True) as at_patch:
            warnings.simplefilter("always")
            tome.patch(model, **options)
    except (ValueError, TypeError) as error:  # refused with its reason: nothing else to check
        v.check(len(str(error)) > 30, "patch refused without a clear message", str(error))
        return
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        seen, output = _call(model, inputs)
    summary = _summary(model)
    v.check(bool(torch.isfinite(output).all()), "the patched output is not finite")
    v.check(len(seen) == len(plain), "the patched call makes another number of SDPA calls", f"{len(seen)} vs {len(plain)}")
    more = [(p, s) for p, s in zip(plain, seen) if s[1] > p[1]]
    v.check(not more, "an SDPA call saw more keys than unpatched", str(more[:4]))
    fewer = any(s[1] < p[1] for p, s in zip(plain, seen))
    if not fewer:  # unmerged: says why, once
        said = _said(family, at_patch) + _said(family, first)
        v.check(bool(said), "runs unmerged without a word", f"summary {summary!r}; keys {seen[:6]}")
        unmerged = "no block merged" in summary or all(tokens == kept for _, _, tokens, kept in _levels(summary))
        v.check(unmerged, "summary does not say the call ran unmerged", repr(summary))
    if WIDE or not fewer:  # the same call again: the same keys and output, and no second warning
        with warnings.catch_warnings(record=True) as second:
            warnings.simplefilter("always")
            seen_again, again = _call(model, inputs)
        v.check(not _said(family, second), "a warning is given again on the second call", str(_said(family, second)))
        v.check(seen_again == seen and same(again, output), "the same call gives another result", f"rel {_rel(again, output):.3g}")
    _summary_matches(v, summary, plain, seen, grids)

    if case.fault is None:
        return
    places = _sublayers(model)
    place = places[case.where % len(places)]
    handle, state = _raise_once(place, case.fault)
    try:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                zoo._run(model, inputs)
        except BaseException as error:  # noqa: B036 - the injected KeyboardInterrupt is the point
            v.check(error is state["raised"], "the fault raised inside a sub-layer came out changed", f"{type(error).__name__}: {error}")
        else:
            v.check(state["raised"] is None, "the fault raised inside a sub-layer was swallowed")
    finally:
        handle.remove()
    # an interrupt may leave an inert mode on torch's stack (docs/limits.md): every call passes through it unchanged,
    # and the next call of a patched model takes it off
    try:
        plain_sdpa = F.scaled_dot_product_attention(*_SDPA_INPUTS)
        v.check(_plain_sdpa_intact(plain_sdpa), f"a plain SDPA call is wrong after a {case.fault}", f"rel {_rel(plain_sdpa, _SDPA_EXPECTED):.3g}")
    except Exception as error:
        v.check(False, f"a plain SDPA call fails after a {case.fault}", f"{type(error).__name__}: {error}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        after_seen, after = _call(model, inputs)
    v.check(
        after_seen == seen and same(after, output),
        f"the patched model gives another result after a {case.fault} in {type(place).__name__}",
        f"rel {_rel(after, output):.3g}; keys {after_seen[:4]} vs {seen[:4]}",
    )
    left = torch._C._len_torch_function_stack()
    v.check(left == 0, f"torch function modes left on the stack after a {case.fault} in {type(place).__name__} and the next call", f"{left} left")
    _clean_function_modes()


# ---------------------------------------------------------------------------------------------------------
# The compiled property (sampled sparsely: each example compiles the model three times)

COMPILED = settings(  # by default only the example below, per backend (CI's budget); wide, many drawn too
    max_examples=int(os.environ.get("TOME_EDGES_COMPILED", 30)) if WIDE else 1,
    deadline=None,
    derandomize=not WIDE,
    database=None,
    phases=[Phase.explicit, Phase.generate] if WIDE else [Phase.explicit],
    suppress_health_check=list(HealthCheck),
)


def _compiled(model, backend: str, fullgraph: bool):
    torch._dynamo.reset()
    return torch.compile(model, backend=backend, fullgraph=fullgraph)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@COMPILED
@example(family="FluxTransformer2DModel", case=BASE)  # joint attention, rotary, size bias
@given(family=st.sampled_from(FAMILIES), case=cases("compiled", GRIDS, faults=[None]))
def test_compiled_equals_eager(backend, family, case):
    note(f"{family} {case} {backend}")
    model, inputs, _ = build_call(family, case)
    plain, reference = _unpatched(family, case, model, inputs)
    v = Violations(f"compile-{backend}", family, case)
    tolerance = 1e-4 if case.dtype == torch.float32 else 3e-2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fullgraph = True
            try:
                unpatched = zoo._run(_compiled(model, backend, True), inputs).float()
            except Exception:  # the unpatched model does not trace whole: neither need the patched one
                fullgraph = False
                unpatched = zoo._run(_compiled(model, backend, False), inputs).float()
            noise = _rel(unpatched, reference)
            assume(noise <= tolerance)  # torch's own compiled model differs: not ToMe's to judge
            tome.patch(model, **dict(case.options))
            eager = zoo._run(model, inputs).float()
            try:
                compiled = zoo._run(_compiled(model, backend, fullgraph), inputs).float()
            except Exception as error:
                v.check(False, f"the patched model fails to compile ({backend}, fullgraph={fullgraph})", f"{type(error).__name__}: {str(error)[:300]}")
                fullgraph = False  # still, compiled with its graph breaks it must equal eager
                compiled = zoo._run(_compiled(model, backend, fullgraph), inputs).float()
            v.check(
                _rel(compiled, eager) <= max(tolerance, 10 * noise), f"compiled ({backend}, fullgraph={fullgraph}) differs from eager",
                f"rel {_rel(compiled, eager):.3g} (unpatched compiled vs eager {noise:.3g})",
            )
            tome.remove(model)
            removed = zoo._run(_compiled(model, backend, fullgraph), inputs).float()
            v.check(_rel(removed, reference) <= max(tolerance, 10 * noise), "compiled after remove differs from unpatched", f"rel {_rel(removed, reference):.3g}")
        except Exception as error:
            v.check(False, "crashed after patch accepted the model (compiled)", f"{type(error).__name__}: {str(error)[:300]}")
        finally:
            tome.remove(model)
            torch._dynamo.reset()
            left = _clean_function_modes()
            v.check(left == 0, "torch function modes left on the stack (compiled)", f"{left} left")
    v.report()


# ---------------------------------------------------------------------------------------------------------
# Round three (issue 59): the dimensions its findings opened, each a property of its own with its oracle


def _drawn(default: int) -> settings:
    """``default`` examples, the same on every run (CI's budget); wide, ``TOME_EDGES_EXAMPLES`` drawn anew."""
    return settings(
        max_examples=int(os.environ.get("TOME_EDGES_EXAMPLES", 30)) if WIDE else default,
        deadline=None,
        derandomize=not WIDE,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


def _patched(v: Violations, model, options: Dict[str, Any]) -> bool:
    """``patch(model, **options)`` quietly; False where it is refused (with a clear message: checked)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tome.patch(model, **options)
    except (ValueError, TypeError) as error:
        v.check(len(str(error)) > 30, "patch refused without a clear message", str(error))
        return False
    return True


def _quiet(model, inputs) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zoo._run(model, inputs).float()


def _judged(v: Violations, model, check: Callable[[], None]) -> None:
    """Runs ``check``; a crash is a violation; the model is unpatched and torch's function-mode stack empty after."""
    try:
        check()
    except Exception as error:
        v.check(False, "crashed after patch accepted the model", f"{type(error).__name__}: {error}")
    finally:
        tome.remove(model)
        left = _clean_function_modes()
        v.check(left == 0, "torch function modes left on the stack after the example", f"{left} left")
    v.report()


def _query_places(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Where a user's hook sees a merged attention's queries: every attention's ``to_q`` (or, where it fuses its
    projections, its first linear layer)."""
    places = []
    for module in model.modules():
        if "Attention" not in type(module).__name__:
            continue
        place = getattr(module, "to_q", None)
        if not isinstance(place, torch.nn.Module):
            place = next((m for m in module.children() if isinstance(m, torch.nn.Linear)), None)
        if place is not None:
            places.append(place)
    return places


@_drawn(8)
@given(family=st.sampled_from(FAMILIES), case=cases("foreign", GRIDS, faults=[None]), like=st.integers(0, 1000))
def test_a_foreign_sdpa_call_inside_a_merged_attention_is_exact(family, case, like):
    """Edges round three, 4: a forward hook on every attention's ``to_q`` (merged ones included) calls
    ``scaled_dot_product_attention`` on fixed tensors shaped like one of the call's own attention calls (``like``
    picks it, from the unpatched and the patched calls: the key count a merged attention's mode expects). Oracles:
    each such call equals the same call made outside, and the patched model's output is the same with the hook."""
    note(f"{family} {case} like={like}")
    model, inputs, _ = build_call(family, case)
    plain, _ = _unpatched(family, case, model, inputs)
    v = Violations("foreign-sdpa", family, case)
    same = lambda a, b: _close(a, b, _DETERMINISTIC[family, case.dtype], case.dtype)  # noqa: E731

    def check() -> None:
        if not _patched(v, model, dict(case.options)):
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            seen, output = _call(model, inputs)
        shapes = plain + seen
        queries, keys = shapes[like % len(shapes)] if shapes else (9, 9)
        made: List[Tuple[Tuple[torch.Tensor, ...], torch.Tensor]] = []

        def foreign(module, args, out):
            generator = torch.Generator().manual_seed(len(made))
            q = torch.randn(1, 2, queries, 8, generator=generator)
            k, v_ = (torch.randn(1, 2, keys, 8, generator=generator) for _ in range(2))
            made.append(((q, k, v_), F.scaled_dot_product_attention(q, k, v_)))

        handles = [place.register_forward_hook(foreign) for place in _query_places(model)]
        try:
            hooked = _quiet(model, inputs)
        finally:
            for handle in handles:
                handle.remove()
        v.check(not handles or bool(made), "no hook on to_q ran", f"{len(handles)} hooks")
        wrong = [i for i, (tensors, inside) in enumerate(made) if not torch.equal(inside, F.scaled_dot_product_attention(*tensors))]
        v.check(not wrong, "an SDPA call made inside a merged attention differs from the same call outside",
                f"{len(wrong)} of {len(made)} calls ({queries} queries x {keys} keys)")
        v.check(same(hooked, output), "a hook's SDPA call changes the patched model's output", f"rel {_rel(hooked, output):.3g}")

    _judged(v, model, check)


@_drawn(6)
@given(
    family=st.sampled_from(FAMILIES), case=cases("regrid", GRIDS, faults=[None]).filter(lambda c: c.grid is not None),
    other=st.sampled_from([None, *GRIDS]), reuse=st.integers(2, 4),
)
def test_a_grid_that_changes_within_a_generation_is_matched_afresh(family, case, other, reuse):
    """Edges round three, 9: patched with ``reuse_steps``, the model is called on one grid, then, in the same
    generation (the same timestep), on another (``other``; None: the first one transposed, as many tokens). Oracle:
    the second call equals a fresh patch's call on that grid (a match is reused only on the grid it was made for)."""
    second = other or (case.grid[1], case.grid[0])
    assume(second != case.grid)
    note(f"{family} {case} then {second}, reuse_steps={reuse}")
    model, first_inputs, _ = build_call(family, case)
    _, second_inputs, _ = build_call(family, replace(case, grid=second))
    _unpatched(family, case, model, first_inputs)
    _unpatched(family, replace(case, grid=second), model, second_inputs)
    v = Violations("grid-within-a-generation", family, (case, second, reuse))
    same = lambda a, b: _close(a, b, _DETERMINISTIC[family, case.dtype], case.dtype)  # noqa: E731
    options = dict(case.options, reuse_steps=reuse)

    def check() -> None:
        if not _patched(v, model, options):
            return
        _quiet(model, first_inputs)
        reusing = _quiet(model, second_inputs)
        tome.remove(model)
        _patched(v, model, options)
        fresh = _quiet(model, second_inputs)
        v.check(bool(torch.isfinite(reusing).all()), "the second grid's output is not finite")
        v.check(same(reusing, fresh), "the second grid's call differs from a fresh patch's (a match reused off its grid)",
                f"rel {_rel(reusing, fresh):.3g}")

    _judged(v, model, check)



VIDEO_FAMILIES = sorted(set(FAMILIES) & {name for name, _ in tools.VIDEO_TRANSFORMERS.values()})


class MatchesMade:
    """While active, ``made`` gathers ``(tokens, [(slot, representatives)...])`` of every match a patched block
    computes: ``ToMeState.block_matches`` observed (its result returned unchanged)."""

    def __enter__(self) -> "MatchesMade":
        from tome_core.hooks.state import ToMeState

        self.made: List[Tuple[int, List[Tuple[torch.Tensor, torch.Tensor]]]] = []
        self.original = original = ToMeState.block_matches

        def observed(state, metric, *args, **kwargs):
            matches = original(state, metric, *args, **kwargs)
            merged = [(m.slot, m.representatives) for m in matches.values() if m.merged and m.representatives is not None]
            if merged:
                self.made.append((metric.shape[1], merged))
            return matches

        ToMeState.block_matches = observed
        return self

    def __exit__(self, *exc: Any) -> None:
        from tome_core.hooks.state import ToMeState

        ToMeState.block_matches = self.original


def _frame_patch(model: torch.nn.Module) -> int:
    """The model's temporal patch (latent frames a token frame holds)."""
    patch = model.config.get("patch_size")
    if isinstance(patch, (list, tuple)) and len(patch) == 3:
        return int(patch[0])
    return int(model.config.get("patch_size_t") or 1)


@_drawn(6)
@given(
    family=st.sampled_from(VIDEO_FAMILIES), frames=st.sampled_from([1, 2, 3, 5]), rows=st.sampled_from([3, 5, 7, 1, 2]),
    cols=st.integers(1, 7), window=st.integers(0, 2), batch=st.integers(1, 2),
)
def test_a_video_transformer_merges_within_the_frame_window(family, frames, rows, cols, window, batch):
    """Edges round three, 8, 10 and 11: a video transformer of ``frames`` token frames (1: a one-frame video) of
    ``rows x cols`` tokens (odd rows: a frame's last row holds no cell), patched at ratio 0.5 with ``frame_window``.
    Oracles: the frame each token lies in, from the inputs' shape (every merged token joins a destination within
    the window of its own frame; a frame thinner than a cell's 2 rows is tiled with the next frames, which
    reach 2 frames further: docs/video.md); a window spanning the clip (one frame included) gives the output of
    ``frame_window=None`` exactly."""
    note(f"{family} frames={frames} rows={rows} cols={cols} window={window} batch={batch}")
    model, _ = _model(family, torch.float32)
    patch = _patch_size(model)
    try:
        inputs = tools.video_transformer_inputs(model, frames * _frame_patch(model), rows * patch, cols * patch, batch=batch)
    except Exception:  # noqa: BLE001 - a size this family's inputs cannot take: not the property's
        assume(False)
    case = Case((frames, rows, cols), batch, False, torch.float32, (("frame_window", window),), None, 0)
    _unpatched(family, case, model, inputs)
    v = Violations("frame-window", family, case)
    reach = window if rows >= 2 else window + 2
    frame_tokens = rows * cols

    def check() -> None:
        if not _patched(v, model, dict(ratio=0.5, frame_window=window)):
            return
        with MatchesMade() as seen:
            windowed = _quiet(model, inputs)
        v.check(bool(torch.isfinite(windowed).all()), "the windowed output is not finite")
        far = []
        for tokens, matches in seen.made:
            if tokens != frames * frame_tokens:  # not the video's grid: nothing to judge by its frames
                continue
            own = torch.arange(tokens) // frame_tokens
            for slot, representatives in matches:
                joined = torch.gather(representatives, 1, slot)  # the token each token stands at
                far += [int(d) for d in (own - joined // frame_tokens).abs().flatten() if d > reach]
        v.check(not far, "a token merged into a destination outside the frame window",
                f"{len(far)} tokens, {max(far, default=0)} frames away (window {window}, reach {reach})")
        if window >= frames - 1:
            tome.remove(model)
            _patched(v, model, dict(ratio=0.5, frame_window=None))
            whole = _quiet(model, inputs)
            v.check(_close(windowed, whole, _DETERMINISTIC[family, torch.float32], torch.float32), "a window spanning the clip differs from frame_window=None",
                    f"rel {_rel(windowed, whole):.3g}")

    _judged(v, model, check)


def _flux_ip_adapter(scale: Optional[float], grid: Tuple[int, int], batch: int) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """The tiny Flux with diffusers' ``FluxIPAdapterAttnProcessor`` in every attention (random image-prompt
    projections, 4 image-prompt tokens) at ``scale``, and a call on a ``grid`` of packed tokens with its image
    prompt; ``scale`` None: the plain ``FluxAttnProcessor``, called without one."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    model = tools.build_transformer("tiny-flux")
    inputs = tools.transformer_inputs(model, 2 * grid[0], 2 * grid[1], batch=batch)
    if scale is None:
        model.set_attn_processor(FluxAttnProcessor())
    else:
        tools.add_flux_ip_adapter(model, inputs, scale, batch)
    return model, inputs


def _unet_ip_adapter(scale: Optional[float], grid: Tuple[int, int], batch: int) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """The tiny UNet with an IP-Adapter loaded as ``load_ip_adapter`` does (random weights, 4 image-prompt tokens)
    at ``scale``, and a call on a ``grid`` latent with its image embedding; ``scale`` None: no IP-Adapter."""
    model = tools.build_unet("tiny")
    generator = torch.Generator().manual_seed(7)
    dim = model.config.cross_attention_dim
    inputs = dict(
        sample=torch.randn(batch, 4, *grid, generator=generator), timestep=torch.tensor(500),
        encoder_hidden_states=torch.randn(batch, 7, dim, generator=generator),
    )
    if scale is None:
        return model, inputs
    randn = lambda *shape: torch.randn(*shape, generator=generator) * 0.1  # noqa: E731
    modules = dict(model.named_modules())
    layers = {}
    for index, name in enumerate(model.attn_processors):
        if name.endswith("attn2.processor"):
            hidden = modules[name[: -len(".processor")]].to_k.out_features
            layers.update({f"{index}.to_k_ip.weight": randn(hidden, dim), f"{index}.to_v_ip.weight": randn(hidden, dim)})
    projection = {"proj.weight": randn(4 * dim, 16), "proj.bias": randn(4 * dim), "norm.weight": torch.ones(dim), "norm.bias": torch.zeros(dim)}
    model._load_ip_adapter_weights([{"image_proj": projection, "ip_adapter": layers}])
    for processor in model.attn_processors.values():
        if hasattr(processor, "scale"):
            processor.scale = [scale]
    inputs["added_cond_kwargs"] = {"image_embeds": [torch.randn(batch, 1, 16, generator=generator)]}
    return model, inputs


IP_ADAPTERS = {"FluxIPAdapterAttnProcessor": _flux_ip_adapter, "IPAdapterAttnProcessor2_0": _unet_ip_adapter}
IP_OPTIONS = [*OPTIONS, {"ratio": 0.5, "proportional_attn": False}, {"ratio": 0.5, "mode": "kv"}, {"ratio": 0.5, "merge_crossattn": True}]


@_drawn(6)
@given(
    kind=st.sampled_from(sorted(IP_ADAPTERS)), grid=st.sampled_from([(2, 2), (3, 5), (4, 4), (6, 4), (5, 7), (8, 8)]),
    batch=st.integers(1, 2), options=st.sampled_from(IP_OPTIONS), scale=st.sampled_from([0.0, 0.6]),
)
def test_an_ip_adapter_runs_merged_and_at_scale_zero_is_the_plain_processor(kind, grid, batch, options, scale):
    """Edges round three, 2: an IP-Adapter's processors (Flux's ``FluxIPAdapterAttnProcessor``, the UNet's
    ``IPAdapterAttnProcessor2_0``) on a grid (the UNet's latent twice its rows and columns), patched with
    ``options``. Oracles: the call runs and is finite, its image-prompt attention keeps its 4 keys, remove gives
    the unpatched output; at scale 0 it equals the patched model with the plain processor and no image prompt."""
    latent = grid if kind.startswith("Flux") else (2 * grid[0], 2 * grid[1])
    note(f"{kind} {latent} batch={batch} {options} scale={scale}")
    model, inputs = IP_ADAPTERS[kind](scale, latent, batch)
    v = Violations("ip-adapter", kind, (latent, batch, options, scale))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, reference = _call(model, inputs)

    def check() -> None:
        if not _patched(v, model, dict(options)):
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            seen, output = _call(model, inputs)
        v.check(bool(torch.isfinite(output).all()), "the patched output is not finite")
        v.check(  # diffusers' UNet processor skips its image-prompt attention at scale 0
            (scale == 0 and kind.startswith("IP")) or any(keys == 4 for _, keys in seen),
            "no image-prompt attention call kept its 4 keys", str(seen[:6]),
        )
        if scale == 0:
            plain, plain_inputs = IP_ADAPTERS[kind](None, latent, batch)
            _patched(v, plain, dict(options))
            try:
                expected = _quiet(plain, plain_inputs)
            finally:
                tome.remove(plain)
            v.check(_close(output, expected, False, torch.float32), "at scale 0 it differs from the plain processor's patched output",
                    f"rel {_rel(output, expected):.3g}")
        tome.remove(model)
        removed = _quiet(model, inputs)
        v.check(_close(removed, reference, True, torch.float32), "remove is not exact", f"rel {_rel(removed, reference):.3g}")

    _judged(v, model, check)


def _klein_kv(grid: Tuple[int, int], reference: Tuple[int, int], batch: int) -> Tuple[torch.nn.Module, Dict[str, Any], Dict[str, Any], int]:
    """A tiny Flux.2 Klein with the KV pipeline's processors, the inputs of its extract step (the reference image's
    tokens on a ``reference`` grid, ids at time 10, before the target's on ``grid``), of a cached step (the target
    alone), and the reference's token count."""
    from diffusers.models.transformers.transformer_flux2 import Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor

    model = tools.build_transformer("tiny-flux2-klein")
    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    target = tools.transformer_inputs(model, 2 * grid[0], 2 * grid[1], batch=batch)
    ref = tools.transformer_inputs(model, 2 * reference[0], 2 * reference[1], batch=batch, seed=1)
    ref_ids = ref["img_ids"].clone()
    ref_ids[:, 0] = 10
    head = ref["hidden_states"].shape[1]
    extract = dict(
        target, hidden_states=torch.cat([ref["hidden_states"], target["hidden_states"]], 1),
        img_ids=torch.cat([ref_ids, target["img_ids"]]), kv_cache_mode="extract", num_ref_tokens=head,
    )
    return model, extract, target, head


def _klein_steps(model, extract: Dict[str, Any], target: Dict[str, Any]) -> Tuple[List[Tuple[int, int]], torch.Tensor, torch.Tensor]:
    """The key counts of every SDPA call of an extract step and a cached step, and their outputs."""
    with torch.no_grad(), warnings.catch_warnings(), SdpaCalls() as counter:
        warnings.simplefilter("ignore")
        first, cache = model(**extract, return_dict=False)
        cached = model(**target, kv_cache=cache, kv_cache_mode="cached", return_dict=False)[0]
    return counter.lengths, first, cached


def _qwen_image_21_steps(model, inputs: Dict[str, Any]) -> Tuple[List[Tuple[int, int]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The key counts of every SDPA call of a plain call, an extract call and a cached call of Qwen-Image 2.1
    (its prefix segments, text with the condition image, cached), and their outputs."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    cache = QwenImage21KVCache(2)
    with torch.no_grad(), warnings.catch_warnings(), SdpaCalls() as counter:
        warnings.simplefilter("ignore")
        output = model(**inputs, return_dict=False)[0]
        extract = model(**inputs, kv_cache=cache, kv_cache_mode="extract", return_dict=False)[0]
        cached = model(**inputs, kv_cache=cache, kv_cache_mode="cached", return_dict=False)[0]
    return counter.lengths, output, extract, cached


KV_OPTIONS = [{"ratio": 0.25}, {"ratio": 0.5}, {"ratio": 0.75}, {"ratio": 0.5, "matching": "cell"}, {"ratio": 0.75, "matching": "cell"}, {}]


@_drawn(4)
@given(
    model=st.sampled_from(["flux2-klein-kv", "qwen-image-21"]), options=st.sampled_from(KV_OPTIONS),
    grid=st.sampled_from([(4, 6), (3, 5), (6, 6), (8, 4)]), reference=st.sampled_from([(3, 3), (2, 5), (4, 4)]),
    batch=st.integers(1, 2),
)
def test_kernel_calls_over_the_head_alone_pass_through_under_kv(model, options, grid, reference, batch):
    """Edges round three, 3: under ``mode="kv"``, attention calls over the leading head tokens alone (Flux.2 Klein
    KV's extract step, where the reference image attends to itself; Qwen-Image 2.1's prefix segments) pass through
    the kernel. Oracles: the unpatched calls' key counts (none more, some fewer; the head's calls as many), and
    the model's own cache (an extract step's output equals the cached step's; Qwen-Image 2.1's prefix rows equal
    the unpatched ones, its extract call the plain call, its cached call the plain call's target rows)."""
    options = dict(options, mode="kv")
    note(f"{model} {options} grid={grid} reference={reference} batch={batch}")
    v = Violations("head-only-kv", model, (options, grid, reference, batch))
    if model == "flux2-klein-kv":
        built, extract, target, head = _klein_kv(grid, reference, batch)
        plain, reference_out, reference_cached = _klein_steps(built, extract, target)
    else:
        built, inputs = zoo.MERGED["QwenImage21Transformer2DModel"]()
        plain, reference_out, _, reference_cached = _qwen_image_21_steps(built, inputs)
        head = reference_out.shape[1] - reference_cached.shape[1]

    def check() -> None:
        if not _patched(v, built, options):
            return
        if model == "flux2-klein-kv":
            seen, first, cached = _klein_steps(built, extract, target)
            v.check(torch.equal(first, cached), "the extract step's output differs from the cached step's",
                    f"rel {_rel(first, cached):.3g}")
        else:
            seen, output, first, cached = _qwen_image_21_steps(built, inputs)
            v.check(torch.allclose(output[:, :head], reference_out[:, :head], atol=1e-6), "the prefix rows changed",
                    f"rel {_rel(output[:, :head], reference_out[:, :head]):.3g}")
            v.check(torch.equal(first, output) and torch.equal(cached, output[:, head:]),
                    "the cache's calls differ from the plain call", f"rel {_rel(cached, output[:, head:]):.3g}")
        v.check(bool(torch.isfinite(cached).all()), "the patched output is not finite")
        v.check(len(seen) == len(plain), "another number of SDPA calls", f"{len(seen)} vs {len(plain)}")
        pairs = list(zip(plain, seen))
        v.check(all(s[1] <= p[1] for p, s in pairs) and any(s[1] < p[1] for p, s in pairs),
                "a kernel call saw more keys than unpatched, or none fewer", f"{seen} vs {plain}")
        heads = [(p, s) for p, s in pairs if p[1] <= head]
        v.check(all(p == s for p, s in heads), "a call over the head alone lost keys", str(heads))

    _judged(v, built, check)

"""Issue #42's closing table on a GPU: whole model calls at the sizes people run, eager and in CUDA graphs, each
method against the same run's unpatched call, with peak memory, the oracle, and per block what merging costs
against the attention it saves. Needs CUDA, diffusers and tomesd (``--dry-run`` needs neither CUDA nor triton).

    python docs/results/gpu_speed.py [PART ...] [--time-limit S] [--memory-gib G]    # rows to $OUT/gpu_speed.json
    python docs/results/gpu_speed.py --dry-run [PART ...]    # the same code on the CPU, tiny models (1-2 min)

Parts (all of them, in this order, when none is named) and the GPU time each is expected to take on one H100 (an
H200 runs them a little faster). The estimates are the script's own (``estimate_s``: every call a part makes,
patched calls counted as slow as the unpatched one, ~10 s per part to build the model), from estimated call
times: the ones ``gpu_h200_defaults.json`` measured (SD 1.5 at 512 px batch 2: ~34 ms eager, ~12 ms per graph
replay; Flux width at 1024 px with 1 + 2 blocks: ~9 ms) scaled to these sizes, and for the videos attention's
FLOPs (4 N^2 x width per block) at ~400 TFLOP/s (flash) or ~250 TFLOP/s (HunyuanVideo passes a text mask, which
SDPA runs with its memory-efficient kernel). The script prints them before each part and the wall time after it.

    launches  what one eager kernel launch costs (chains of small adds), beside the launches per merged block
              that cpu_launches.json counts                                            ~10 s
    sd15      SD 1.5 (860M, float16) at 512 px batch 2 and at 1024 px batch 1          ~50 s
    sdxl      SDXL (2.6B, float16) at 1024 px batch 1                                  ~35 s
    flux      Flux width (3072; 2 double + 4 single blocks of its 19 + 38), bfloat16, 1024 px: 4,096 image
              + 512 text tokens                                                        ~28 s
    wan480    Wan 2.1 1.3B width (1536; 2 of its 30 blocks), bfloat16, 480x832, 81 frames: 21 latent
              frames, 32,760 tokens                                                    ~33 s
    wan720    the same at 720x1280, 81 frames: 75,600 tokens                           ~86 s
    hunyuan   HunyuanVideo width (3072; 1 double + 1 single block of its 20 + 40), bfloat16, 720x1280,
              129 frames: 33 latent frames, all 118,800 tokens                         ~240 s

In all ~470 s (under 8 minutes): one command (``timeout_s`` 600) or, safer, two of ~230 s each
(``sd15 sdxl flux wan480 wan720``, then ``hunyuan``). ``--time-limit S`` skips a part whose estimate would end it
after S seconds (a row says so); a part that would not fit the GPU's memory (its estimate against ``--memory-gib``,
default the device's) is skipped with a row saying why, and a method that fails (out of memory, a capture
refused) gets a row with the error while the others go on. Models have random weights
(nothing is downloaded), are built on the GPU, and keep their class's float32 modules (Wan's norms) as
``from_pretrained`` does. Transformers run with fewer blocks than released (each block costs alike: the ratio of
a call is the ratio of its blocks, less the embedding and output layers' small share); batch 1 except SD 1.5 at
512 px (a classifier-free guidance batch); Wan and HunyuanVideo pipelines run the guided halves as separate calls.

Methods, each against the unpatched call of the same run:
- ``default``: ``patch(model)``, the cost model (``tome_core.models.cost``) leaving a level unmerged below the token
  count from which merging pays on this device and execution (so it may differ between eager and graph rows);
- ``default, min_tokens=0``: the default's arrangement forced to merge at every level;
- ``frame_window=None`` (Wan): the default's arrangement with the similarity search over the whole clip (the
  default before: since, each token is compared with the destinations of its own and the neighbouring frames);
- ``prefer="speed"`` and ``ratio 0.5`` (ToMe for SD's arrangement, size-aware);
- ``kv 2x1 cells`` and ``kv 0.75`` (transformers): keys and values merged inside the attention kernel after the
  processor's rotary positions (``mode="kv"``), queries kept: in 2x1 cells, one token drawn per cell, and 75% of
  them by similarity, size-aware;
- ``tomesd 0.5`` (UNets; eager only, as most users run it; at its finest level with attention: max_downsample=2
  on SDXL, where its default of 1 merges nothing);
- ``oracle of default``: free removal of the tokens the default removes in this execution, at the same levels
  and blocks and in the same arrangement: the benchmark's oracle (``tome_tools.oracle.attach_oracle``: the patch's
  own hooks with a match that keeps the first tokens), which runs each merged sub-layer on the first ``kept``
  image tokens (or, for keys/values in cells, gives self-attention the first ``kept`` tokens as keys and values)
  and restores the rest by index, so its time is attention at the merged size with no match, merge or unmerge.
  Where the default merges nothing its oracle is the unpatched call (a row says so, untimed); ``oracle of
  default, min_tokens=0`` is that of the forced default.
A method whose patched call is the same computation as an earlier one in the same execution (the same options,
levels, blocks and token counts: e.g. the default and ``min_tokens=0`` where no level is left unmerged, or the
default and ``ratio 0.5`` on Flux) is not timed again: its row names that method in ``same_as``.

Rows (``part``, ``case`` and):
- ``row="case"``: the size, token count, dtype, blocks and the part's estimate; ``row="part"``: its wall time.
- ``row="call"``: one method, ``execution`` ``eager`` (a Python call per step; timed with CUDA events over
  ``reps`` calls, patched in turn) or ``graph`` (one call captured in a CUDA graph and replayed; a method that
  cannot be captured has ``error`` and no time). ``speedup`` is the median over ``rounds`` paired rounds of
  unpatched ms / method ms (methods alternate in forward and backward order); ``ms`` the method's median,
  ``spread`` (max - min) / median; ``peak_mib`` is ``torch.cuda.max_memory_allocated`` over the method's first
  eager call (graph rows: over its warm-up and capture; peaks reset between methods) and ``peak_rise_mib`` its
  rise above the memory held before (weights, inputs); ``fid`` the relative L2 of the output to the unpatched
  one (random weights: a check that a method merged, not fidelity); ``merged`` what the patch did per level
  (``summary()``) and ``unmerged`` the levels the cost model left unmerged, and why.
- ``row="block"``: one representative block (the first the patch merges: a UNet's first block at its finest
  level with attention, Flux's and HunyuanVideo's first double-stream block, Wan's first block), run on the
  inputs it gets in the call, with the default forced to merge: ``piece`` ``block unpatched``, ``block merged``
  (the default's arrangement), ``block merged, plain softmax`` (``proportional_attn=False``; where the size bias
  applies), ``block oracle`` (the oracle's cut), and alone ``match`` (``ToMeState.block_matches``), ``merge``,
  ``unmerge`` (not run by keys/values arrangements) and ``size bias`` (its log-size row). ``row="block
  summary"``: ``saves_ms`` = unpatched - oracle (attention saved), ``costs_ms`` = merged - oracle (what
  merging costs), split into ``match_ms``, ``merge_ms`` and ``unmerge_ms`` (per merged sub-layer, times their
  count), ``bias_ms`` (merged - plain softmax: the bias and the kernel it forces) and ``rest_ms`` (hooks,
  Python, launches).

No numbers are written into the repository by this script: its JSON goes to ``$OUT``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import diffusers
import torch

import gpu_timing as gt
import tomesd
import tome_core.torch as tome
from tome_core import merge, unmerge
from tome_core.hooks.block_hooks import family_argument_position, family_in_call
from tome_core.framework import argument
from tome_core.models.model_tree import block_metric, blocks_of, finest_level
from tome_core.adapters.diffusers import FRAMEWORK
from tome_core.models.families import child_at
from tome_core.models.levels import downsample_factor, level_grid
from tome_core.algorithm.merge import size_bias
from tome_tools.bench_core import image_like_latents
from tome_tools.bench_runner import MID_TIMESTEP, hook_oracle, image_part
from tome_tools.diffusers_models import (
    build_transformer, build_unet, build_video_transformer, transformer_inputs, video_transformer_inputs,
)
from tome_tools.presets import TRANSFORMERS, VIDEO_TRANSFORMERS

TOMESD = "tomesd"
FORCED = "default, min_tokens=0"  # the default forced to merge at every size: what the per-block rows merge with


@dataclass(frozen=True)
class Oracle:
    """The oracle of method ``of``: free removal of the tokens that method's patched call removes."""

    of: str


KV_CELLS, KV_SIMILAR, WHOLE_CLIP = "kv 2x1 cells", "kv 0.75", "frame_window=None"
# name: options of tome_core.torch.patch, tomesd, or the oracle of another method (after it: its call tells the cut)
METHODS: Dict[str, Any] = {
    "unpatched": None,
    "default": {},
    FORCED: {"min_tokens": 0},
    WHOLE_CLIP: {"frame_window": None},  # videos: the default's search over the whole clip, not the nearby frames
    'prefer="speed"': {"prefer": "speed"},
    "ratio 0.5": {"ratio": 0.5},
    "tomesd 0.5": TOMESD,
    "oracle of default": Oracle("default"),
    "oracle of default, min_tokens=0": Oracle(FORCED),
    # transformers: keys and values merged inside the attention kernel after the rotary positions, the two points
    # at the trained MM-DiT's fidelity floor (docs/fidelity.md): 2x1 cells, one token drawn (no match, no bias), and
    # 75% by similarity, size-aware
    KV_CELLS: {"mode": "kv", "matching": "cell", "sx": 2, "sy": 1, "cell_pool": "sample"},
    KV_SIMILAR: {"mode": "kv", "ratio": 0.75},
}


@dataclass(frozen=True)
class Case:
    """One row group of the table: a model at one size.

    kind: ``unet`` (latent ``size`` = (h, w)), ``image`` (a transformer on packed 2x2 latent patches, ``size`` the
    latent's (h, w)) or ``video`` (``size`` = (latent frames, h, w), 2x2 patches). ``preset`` / ``tiny``: the
    released-width and the dry run's preset of ``tome_tools.presets``; ``depth``: config overrides giving fewer
    blocks. ``eager_ms`` / ``graph_ms`` / ``block_ms``: the estimated unpatched call (eager, graph replay) and
    representative block on an H100, ``need_gib`` the estimated memory (float32 build, graphs' pool), for the
    estimate and the memory check."""

    name: str
    part: str
    kind: str
    preset: str
    tiny: str
    size: Tuple[int, ...]
    dry_size: Tuple[int, ...]
    batch: int
    dtype: torch.dtype
    rounds: int
    reps: int
    eager_ms: float
    graph_ms: float
    block_ms: float
    need_gib: float
    text: int = 77
    depth: Tuple[Tuple[str, int], ...] = ()
    note: str = ""

    def tokens(self, size: Tuple[int, ...], finest: int = 1) -> int:
        """Image tokens of a call: a UNet's at its ``finest`` level with attention, a transformer's 2x2 patches."""
        if self.kind == "unet":
            h, w = level_grid(size, finest)
            return h * w
        return math.prod(size) // 4


HALF, BF16 = torch.float16, torch.bfloat16
WAN_NOTE = "2 of the released 30 blocks"
CASES: List[Case] = [
    Case("SD 1.5, 512 px, batch 2", "sd15", "unet", "sd15", "tiny", (64, 64), (16, 16), 2, HALF,
         rounds=7, reps=5, eager_ms=35, graph_ms=12, block_ms=1.5, need_gib=8),
    Case("SD 1.5, 1024 px, batch 1", "sd15", "unet", "sd15", "tiny", (128, 128), (32, 32), 1, HALF,
         rounds=7, reps=5, eager_ms=35, graph_ms=25, block_ms=3, need_gib=10),
    Case("SDXL, 1024 px, batch 1", "sdxl", "unet", "sdxl", "tiny-xl", (128, 128), (16, 16), 1, HALF,
         rounds=5, reps=3, eager_ms=75, graph_ms=60, block_ms=1.5, need_gib=24),
    # the dry run's tiny Flux at 4,096 tokens: where the default merges on a CPU, so its oracle runs there too
    Case("Flux width, 1024 px", "flux", "image", "flux-small", "tiny-flux", (128, 128), (128, 128), 1, BF16,
         rounds=7, reps=5, eager_ms=25, graph_ms=18, block_ms=3.5, need_gib=16, text=512,
         note="2 double + 4 single blocks of the released 19 + 38 (preset flux-small)"),
    Case("Wan 2.1 1.3B width, 480x832, 81 frames", "wan480", "video", "wan-1.3b", "tiny-wan", (21, 60, 104), (3, 16, 16), 1,
         BF16, rounds=5, reps=3, eager_ms=45, graph_ms=42, block_ms=20, need_gib=12, text=512,
         depth=(("num_layers", 2),), note=WAN_NOTE),
    Case("Wan 2.1 1.3B width, 720x1280, 81 frames", "wan720", "video", "wan-1.3b", "tiny-wan", (21, 90, 160), (3, 16, 24), 1,
         BF16, rounds=5, reps=2, eager_ms=180, graph_ms=178, block_ms=85, need_gib=20, text=512,
         depth=(("num_layers", 2),), note=WAN_NOTE),
    Case("HunyuanVideo width, 720x1280, 129 frames", "hunyuan", "video", "hunyuan-video-small", "tiny-hunyuan-video-t",
         (33, 90, 160), (2, 16, 16), 1, BF16, rounds=3, reps=1, eager_ms=1200, graph_ms=1200, block_ms=600, need_gib=40,
         text=256, note="1 double + 1 single block of the released 20 + 40 (preset hunyuan-video-small)"),
]
LAUNCHES = "launches"  # the part that times one launch (measure_launches), before the models
PARTS = [LAUNCHES] + list(dict.fromkeys(case.part for case in CASES))


def methods_of(case: Case) -> List[str]:
    elsewhere = [m for m in METHODS if METHODS[m] == TOMESD] if case.kind != "unet" else [KV_CELLS, KV_SIMILAR]
    if case.kind != "video" or case.part == "hunyuan":  # one video size too many for the 8 minutes
        elsewhere.append(WHOLE_CLIP)
    return [m for m in METHODS if m not in elsewhere]


def rounds_of(case: Case, dry: bool) -> Tuple[int, int]:
    """Paired rounds and timed calls per turn: the case's, or one of each in a dry run (which checks code, not speed)."""
    return (1, 1) if dry else (case.rounds, case.reps)


def estimate_s(case: Case) -> float:
    """GPU seconds the case's calls take by the table's estimates (patched calls as slow as unpatched)."""
    count = len(methods_of(case))
    turns = case.rounds * (1 + case.reps)
    eager = count * (1 + turns) * case.eager_ms
    graph = (count - (case.kind == "unet")) * (4 + turns) * case.graph_ms
    block = 2 * 4 * (4 + turns) * case.block_ms  # four block-sized pieces, eager and graph; match/merge are small
    return (eager + graph + block) / 1000


def part_estimate_s(part: str) -> float:
    return 10 + sum(estimate_s(case) for case in CASES if case.part == part)


def measure_launches(device: torch.device, record: Callable[..., None], dry: bool) -> None:
    """What one kernel launch costs an eager call on ``device``: chains of ``n`` dependent small operations (an add
    on a 1-element tensor and on a UNet block's ``[2, 4096, 320]`` tokens), timed whole (CUDA events), per
    operation, medians of 5 runs; with the launches per merged block that ``cpu_launches.json`` counts (the same on
    a GPU), what they cost a block in an eager call. The cost model's eager bounds follow from these and the
    attention a level saves (docs/results/launches.md)."""
    chain = 50 if dry else 2000
    per_launch = {}
    for name, shape, dtype in (("scalar", (1,), torch.float32), ("block tokens", (2, 4096, 320), torch.float16)):
        x = torch.zeros(shape, device=device, dtype=torch.float32 if dry else dtype)
        times = []
        for _ in range(6):
            start = time.perf_counter()
            y = x
            for _ in range(chain):
                y = y + 1
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / chain * 1e6)
        per_launch[name] = statistics.median(times[1:])
        record(part=LAUNCHES, row="launch", tensor=name, shape=list(shape), us_per_launch=round(per_launch[name], 3), chain=chain)
        print(f"one eager launch ({name}): {per_launch[name]:.2f} us", flush=True)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_launches.json")
    with open(path) as f:
        counted = json.load(f)["rows"]
    for entry in counted:
        if entry["per_block"]:
            record(part=LAUNCHES, row="block launches", case=entry["case"], launches=entry["per_block"],
                   us=round(entry["per_block"] * per_launch["scalar"], 1))


# -- models and calls ------------------------------------------------------------------------------------------
def build(case: Case, device: torch.device, dtype: torch.dtype, dry: bool) -> torch.nn.Module:
    """The case's model with random weights, in ``dtype`` on ``device`` (float32 modules kept): built on the
    device itself where its initialisers allow (fast), else on the host and moved."""
    preset = case.tiny if dry else case.preset
    overrides = {} if dry else dict(case.depth)
    maker = (
        build_transformer if preset in TRANSFORMERS else build_video_transformer if preset in VIDEO_TRANSFORMERS else build_unet
    )

    def make() -> torch.nn.Module:
        return maker(preset, **overrides)

    model = None
    if device.type == "cuda":
        try:
            with torch.device(device):
                model = make()
        except Exception as error:  # an initialiser that refuses CUDA: build on the host
            print(f"  building on the GPU failed ({type(error).__name__}: {error}); building on the host", flush=True)
    if model is None:
        model = make()
    return gt.in_dtype(model, device, dtype).eval()


def model_call(
    case: Case, model: torch.nn.Module, size: Tuple[int, ...], device: torch.device, dtype: torch.dtype,
) -> Callable[[], torch.Tensor]:
    """One call of ``model`` at ``size`` on fixed inputs, as a pipeline makes it at the middle timestep."""
    if case.kind == "unet":
        config = model.config
        h, w = size
        generator = torch.Generator().manual_seed(1)
        sample = torch.from_numpy(image_like_latents(case.batch, config.in_channels, h, w, seed=0))
        text = torch.randn(case.batch, case.text, config.cross_attention_dim, generator=generator)
        added = None
        if config.addition_embed_type == "text_time":  # SDXL: pooled text and the size conditions
            pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            px = float(h * 8)
            added = {"text_embeds": torch.randn(case.batch, pooled, generator=generator),
                     "time_ids": torch.tensor([[px, px, 0.0, 0.0, px, px]] * case.batch)}
        sample, text, added = gt.on_device((sample, text, added), device, dtype)
        t = torch.tensor(MID_TIMESTEP, device=device)
        return lambda: model(sample, t, text, added_cond_kwargs=added).sample  # latent by position (tomesd reads it)
    if case.kind == "image":
        inputs = transformer_inputs(model, *size, batch=case.batch, text=case.text)
    else:
        inputs = video_transformer_inputs(model, *size, batch=case.batch, text=case.text)
    inputs = gt.on_device(inputs, device, dtype)
    return lambda: model(**inputs, return_dict=False)[0]


# -- what a patched call did, and its oracle -----------------------------------------------------------------
@dataclass(frozen=True)
class Did:
    """What one patched call did: its options (``min_tokens`` aside: it only decides where, which ``levels`` and
    ``unmerged`` show) and per level (downsample factor) the blocks merged and tokens before and after."""

    config: Any
    levels: Tuple[Tuple[int, int, int, int, int], ...]  # (factor, blocks, tokens, kept, frames)
    unmerged: Tuple[Tuple[int, str], ...]
    fallbacks: Tuple[Tuple[int, str, int], ...]
    summary: str

    @property
    def key(self) -> str:
        """Equal for calls that are the same computation."""
        options = dataclasses.asdict(dataclasses.replace(self.config, min_tokens=None))
        return repr((sorted(options.items()), self.levels, [u[0] for u in self.unmerged], self.fallbacks))


def did_of(model: torch.nn.Module) -> Did:
    (_, state), = tome.patched_models(model)
    return Did(
        state.active,
        tuple(sorted((f, s.blocks, s.tokens, s.kept, s.frames) for f, s in state.ledger.stats.items())),
        tuple(sorted((f, why) for f, (_, why) in state.ledger.unpaid.items())),
        tuple(sorted((f, why, s.blocks) for (f, why), s in state.ledger.fallbacks.items())),
        state.summary(),
    )


def install_oracle(case: Case, model: torch.nn.Module, config: Any, deepest: int,
                   call: Optional[Tuple[Any, int, bool]] = None) -> Callable[[], None]:
    """Hook into ``model`` the oracle of a patch with options ``config`` (resolved: ``ToMeState.active``) that
    merged the levels down to downsample factor ``deepest``; returns what removes it. The library's own hooks
    with a match keeping the first tokens (``tome_tools.oracle.attach_oracle``, through the bench's
    ``hook_oracle``), on a UNet at the levels ``<= deepest``; each call's grid is read as the
    patch reads it (``call``: (grid, tail, grid_last) for blocks run on their own)."""
    if case.kind == "unet":
        config = dataclasses.replace(config, max_downsample=deepest)
    return hook_oracle(FRAMEWORK, model, config, call=call)


class Turns:
    """One model patched for one method at a time (:meth:`set`), and what each patched call did."""

    def __init__(self, case: Case, model: torch.nn.Module, latent_hw: Tuple[int, int]):
        self.case, self.model, self.latent_hw = case, model, latent_hw
        self.finest = finest_level(FRAMEWORK, model)
        self.undo: Callable[[], None] = lambda: None
        self.did: Dict[str, Did] = {}

    def set(self, name: Optional[str]) -> None:
        """Patch for method ``name`` (None: unpatched), undoing the previous one."""
        self.undo()
        self.undo = lambda: None
        spec = METHODS[name] if name is not None else None
        if spec is None:
            return
        model = self.model
        if spec == TOMESD:
            tomesd.apply_patch(model, ratio=0.5, max_downsample=self.finest)
            self.undo = lambda: tomesd.remove_patch(model)
        elif isinstance(spec, Oracle):
            did = self.did[spec.of]
            self.undo = install_oracle(self.case, model, did.config, max(level[0] for level in did.levels))
        else:
            tome.patch(model, **spec)
            self.undo = lambda: tome.remove(model)

    def key(self, name: str) -> Optional[str]:
        """What makes method ``name``'s call the same computation as another's (None: never the same)."""
        spec = METHODS[name]
        if spec is None:
            return "unpatched"
        if isinstance(spec, Oracle):
            did = self.did[spec.of]
            return "unpatched" if not did.levels else "oracle " + did.key
        return None if spec == TOMESD else "patched " + self.did[name].key


# -- whole calls ----------------------------------------------------------------------------------------------
def measure_calls(case: Case, turns: Turns, call: Callable[[], torch.Tensor], execution: str, device: torch.device,
                  dry: bool, record: gt.Recorder, base: Dict[str, Any]) -> None:
    """Every method of the case in one execution: set up (a first call, or a capture), then timed in paired
    rounds; one row per method."""
    rows: Dict[str, Dict[str, Any]] = {}
    calls: Dict[str, Callable[[], Any]] = {}
    outs: Dict[str, torch.Tensor] = {}
    seen: Dict[str, str] = {}  # what makes a call the same computation: the first method that made it
    turns.did.clear()  # an oracle follows its method's call in this execution only
    pool = torch.cuda.graph_pool_handle() if execution == "graph" and not dry else None
    for name in methods_of(case):
        row = rows[name] = {**base, "row": "call", "execution": execution, "method": name}
        spec = METHODS[name]
        if spec == TOMESD and execution == "graph":
            row["note"] = "not captured: run eagerly, as its users run it (its random partition draws on the host)"
            continue
        try:
            key = None
            if isinstance(spec, Oracle):
                if spec.of not in turns.did:
                    raise RuntimeError(f"no oracle: {spec.of!r} did not run ({rows[spec.of].get('error')})")
                key = turns.key(name)
                if key in seen:  # the cut of another method, or none
                    row["same_as"] = seen[key]
                    if key == "unpatched":
                        row["note"] = f"{spec.of!r} merges nothing in this execution: its oracle is the unpatched call"
                    continue
            turns.set(name)
            before = gt.reset_peak(device)
            if execution == "graph" and not dry:
                fn, out = gt.capture(call, pool)
            else:
                fn, out = call, call()
                if execution == "graph":
                    row["note"] = "dry run: an eager call stands in for the graph replay"
            row.update(gt.peak_since(device, before))
            if isinstance(spec, dict):
                did = turns.did[name] = did_of(turns.model)
                row.update(merged=did.summary, unmerged=[why for _, why in did.unmerged] or None)
            key = key or turns.key(name) or name
            if key in seen:  # the same computation as an earlier method's
                row["same_as"] = seen[key]
                continue
            seen[key] = name
            calls[name], outs[name] = fn, out.float().clone()
        except Exception as error:  # one method failing (a capture refused, out of memory) keeps the others' rows
            row["error"] = f"{type(error).__name__}: {error}"[:300]
            gt.synchronize(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        finally:
            if execution == "graph":
                turns.set(None)  # a graph replays as captured: the next capture starts unpatched
    turns.set(None)
    if "unpatched" not in calls:
        for row in rows.values():
            record(**row)
        return
    # eager calls take turns patching the model (as does a dry run's stand-in for the graphs); replays need nothing
    before = {name: (lambda name=name: turns.set(name)) for name in calls} if execution == "eager" or dry else None
    try:
        times = gt.time_rounds(calls, *rounds_of(case, dry), device, before)
    except Exception as error:
        times = {}
        for name in calls:
            rows[name]["error"] = f"timing: {type(error).__name__}: {error}"[:300]
    finally:
        turns.set(None)
    ref = outs["unpatched"]
    for name, row in rows.items():
        if name in times:
            row.update(gt.paired(times[name], times["unpatched"]), fid=gt.relative_l2(outs[name], ref))
        record(**row)
        if "ms" in row:
            shown = f"{row['ms']:9.2f} ms {row['speedup']:6.2f}x  peak {row['peak_mib'] or 0:9.0f} MiB  fid {row['fid']:.4f}"
        else:
            shown = f"same as {row['same_as']}" if "same_as" in row else row.get("error") or row.get("note", "")
        print(f"  {execution:<5} {name:<32} {shown}", flush=True)


# -- one block's pieces ---------------------------------------------------------------------------------------
class _Reached(Exception):
    """Stops a model call once the representative block has shown its inputs."""


def measure_block(case: Case, turns: Turns, call: Callable[[], torch.Tensor], device: torch.device, dry: bool,
                  record: gt.Recorder, base: Dict[str, Any]) -> None:
    """The representative block (the first the patch merges) on the inputs it gets in the call: whole (unpatched,
    merged by the forced default, with plain softmax, the oracle's cut) and the merge's pieces alone, eager and
    in CUDA graphs."""
    model = turns.model
    stream = 0
    block, family = blocks_of(FRAMEWORK, model)[stream]
    tome.patch(model, **METHODS[FORCED])
    (_, state), = tome.patched_models(model)
    seen: Dict[str, Any] = {}

    def reach(module, args, kwargs):
        seen.update(args=args, kwargs=kwargs, grid=state.grid_hw, call=state.call._replace(execution=None, key=None))
        raise _Reached

    handle = block.register_forward_pre_hook(reach, with_kwargs=True)
    try:
        call()
    except _Reached:
        pass
    finally:
        handle.remove()
        tome.remove(model)
    args, kwargs, grid = seen["args"], seen["kwargs"], seen["grid"]

    def resume(on) -> None:
        """Put a state where the call stood when it reached the block."""
        on.begin_call(seen["call"])
        if grid is not None:
            on.enter_grid(grid)

    resume(state)
    config = state.active
    call_grid = (grid, seen["call"].tail, seen["call"].grid_last)
    family = family_in_call(family, family_argument_position(family, block), args, kwargs)
    metric, at = block_metric(family, block)
    image = image_part(argument(args, kwargs, metric, at), family, *call_grid)
    shared = family.rotary is not None or any(s.masks for s in family.sublayers)
    match = state.block_matches(image, stream, shared)
    match = match.get("attn") or next(iter(match.values()))
    sublayers = [s for s in family.sublayers if child_at(block, s.child) is not None and config.sublayers[s.kind]]
    mode, biased = config.arrangement("attn", True)
    merged = merge(image, match)
    level = downsample_factor(seen["call"].latent_hw or grid, match.tokens, grid)
    current: List[Any] = []  # the state of the patch the block now runs under (none: unpatched, the oracle)

    def run_block() -> None:
        for on in current:  # each run is a call of its own, its per-call tables (partitions) drawn afresh: in a
            resume(on)  # CUDA graph inside it, as in a captured model call
        block(*args, **kwargs)

    def matches() -> Any:
        resume(state)
        return state.block_matches(image, stream, shared)

    def clear() -> None:
        tome.remove(model)
        turns.set(None)
        current.clear()

    def patched(**extra: Any) -> Callable[[], None]:
        def setup() -> None:
            clear()
            tome.patch(model, **METHODS[FORCED], **extra)
            current.append(tome.patched_models(model)[0].state)
            resume(current[0])
        return setup

    def oracle() -> None:
        clear()
        turns.undo = install_oracle(turns.case, model, config, level, call=call_grid)

    pieces: Dict[str, Tuple[Callable[[], Any], Callable[[], None]]] = {  # name: (call, set-up before it)
        "block unpatched": (run_block, clear),
        "block merged": (run_block, patched()),
        "block oracle": (run_block, oracle),
        "match": (matches, clear),
        "merge": (lambda: merge(image, match), clear),
    }
    if biased:
        pieces["block merged, plain softmax"] = (run_block, patched(proportional_attn=False))
        pieces["size bias"] = (lambda: size_bias(match, image), clear)
    if mode != "kv":
        pieces["unmerge"] = (lambda: unmerge(merged, match), clear)
    info = {**base, "block": type(block).__name__, "arrangement": repr(config), "mode": mode, "size_bias": biased,
            "tokens": match.tokens, "kept": match.kept, "batch": match.batch, "width": int(image.shape[-1]),
            "merged_sublayers": [s.child for s in sublayers]}
    for execution in ("eager", "graph"):
        fns: Dict[str, Callable[[], Any]] = {}
        errors: Dict[str, str] = {}
        pool = torch.cuda.graph_pool_handle() if execution == "graph" and not dry else None
        for name, (fn, setup) in pieces.items():
            try:
                setup()
                if execution == "graph" and not dry:
                    fns[name] = gt.capture(fn, pool)[0]
                else:
                    fn()
                    fns[name] = fn
            except Exception as error:
                errors[name] = f"{type(error).__name__}: {error}"[:300]
            finally:
                if execution == "graph":
                    clear()
        before = {name: pieces[name][1] for name in fns} if execution == "eager" or dry else None
        try:
            times = gt.time_rounds(fns, *rounds_of(case, dry), device, before)
        except Exception as error:  # the rows still say what ran
            times = {}
            errors.update(dict.fromkeys(fns, f"timing: {type(error).__name__}: {error}"[:300]))
        finally:
            clear()
        ms = {name: statistics.median(t) for name, t in times.items()}
        for name in pieces:
            row = {**info, "row": "block", "execution": execution, "piece": name}
            if name in ms:
                row.update(ms=ms[name], spread=(max(times[name]) - min(times[name])) / ms[name] if ms[name] else 0.0)
            else:
                row["error"] = errors.get(name, "not run")
            record(**row)
        if {"block unpatched", "block merged", "block oracle", "match", "merge"} <= set(ms):
            count = len(sublayers)
            plain = ms.get("block merged, plain softmax")
            summary = {
                "saves_ms": ms["block unpatched"] - ms["block oracle"],
                "costs_ms": ms["block merged"] - ms["block oracle"],
                "match_ms": ms["match"],
                "merge_ms": ms["merge"] * count,
                "unmerge_ms": ms["unmerge"] * count if "unmerge" in ms else None,
                "bias_ms": ms["block merged"] - plain if plain is not None else None,
            }
            parts = ("match_ms", "merge_ms", "unmerge_ms", "bias_ms")
            summary["rest_ms"] = summary["costs_ms"] - sum(summary[k] for k in parts if summary[k] is not None)
            record(**info, row="block summary", execution=execution, **summary)
            print(f"  block {execution:<5} {type(block).__name__} {match.tokens} -> {match.kept} tokens: saves "
                  f"{summary['saves_ms']:.3f} ms, costs {summary['costs_ms']:.3f} ms (match {summary['match_ms']:.3f}, "
                  f"merge {summary['merge_ms']:.3f}, rest {summary['rest_ms']:.3f})", flush=True)


# -- the run --------------------------------------------------------------------------------------------------
def run_case(
    case: Case, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, dry: bool, record: gt.Recorder,
) -> None:
    """The case's rows: its whole calls eager and in graphs, then its representative block."""
    size = case.dry_size if dry else case.size
    latent_hw = size[-2:]
    base = {"part": case.part, "case": case.name}
    tokens = case.tokens(size, finest_level(FRAMEWORK, model))
    record(**base, row="case", size=list(size), batch=case.batch, tokens=tokens, dtype=str(dtype),
           preset=case.tiny if dry else case.preset, note=case.note, estimate_s=round(estimate_s(case)))
    note = f"; {case.note}" if case.note else ""
    print(f"\n{case.name} ({tokens} tokens{note}), estimate {estimate_s(case):.0f} s", flush=True)
    call = model_call(case, model, size, device, dtype)
    turns = Turns(case, model, latent_hw)
    with torch.no_grad():
        for execution in ("eager", "graph"):
            measure_calls(case, turns, call, execution, device, dry, record, base)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        try:
            measure_block(case, turns, call, device, dry, record, base)
        except Exception as error:
            record(**base, row="block", error=f"{type(error).__name__}: {error}"[:300],
                   where=traceback.format_exc().splitlines()[-3][:200])
            print(f"  block failed: {type(error).__name__}: {error}", flush=True)
        finally:
            tome.remove(model)
            turns.set(None)


def main(argv: Optional[List[str]] = None) -> None:
    """Run the named parts (all by default); the process's warning filters, diffusers' log level and torch's
    thread count are as they were afterwards (a test runs the dry run in its own process)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"parts to run: {', '.join(PARTS)} (default all)")
    parser.add_argument("--dry-run", action="store_true", help="the CPU, float32, tiny presets and sizes, no CUDA graphs")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="skip the parts whose estimate would end them after this many seconds")
    parser.add_argument("--memory-gib", type=float, default=None, help="the memory to plan for (default: the device's)")
    args = parser.parse_args(argv)
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"PART must be among {', '.join(PARTS)}, got {', '.join(map(repr, unknown))}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --dry-run")
    threads, verbosity = torch.get_num_threads(), diffusers.utils.logging.get_verbosity()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the patch's notes (once per patch) would repeat for every method
        diffusers.utils.logging.set_verbosity_error()  # and diffusers' on casting models that keep float32 modules
        if args.dry_run:
            torch.set_num_threads(1)  # a dry run checks the code, not the speed; one thread keeps a shared host responsive
        try:
            run(args.parts or PARTS, args.dry_run, args.time_limit, args.memory_gib)
        finally:
            torch.set_num_threads(threads)
            diffusers.utils.logging.set_verbosity(verbosity)


def run(parts: List[str], dry: bool, time_limit: Optional[float], memory_gib: Optional[float]) -> None:
    device = torch.device("cpu" if dry else "cuda")
    if memory_gib is None:
        memory_gib = torch.cuda.get_device_properties(device).total_memory / 2**30 if not dry else 16.0
    out = os.path.join(os.environ.get("OUT", "/tmp"), "gpu_speed.json")
    record = gt.Recorder(out, device=gt.device_name(device), torch=torch.__version__, dry_run=dry, parts=parts,
                         memory_gib=memory_gib)
    estimates = ", ".join(f"{p} ~{part_estimate_s(p):.0f} s" for p in parts)
    total = sum(map(part_estimate_s, parts))
    print(f"{gt.device_name(device)}, torch {torch.__version__}; GPU estimate {estimates}; total ~{total:.0f} s", flush=True)
    start = time.perf_counter()
    model, built = None, None
    for part in parts:
        elapsed = time.perf_counter() - start
        if time_limit is not None and elapsed + part_estimate_s(part) > time_limit:
            why = f"{elapsed:.0f} s spent; its estimate {part_estimate_s(part):.0f} s would pass --time-limit {time_limit:g}"
            record(part=part, row="part", skipped=why)
            print(f"\npart {part} skipped: time limit", flush=True)
            continue
        begun = time.perf_counter()
        print(f"\npart {part}: estimate ~{part_estimate_s(part):.0f} s", flush=True)
        if part == LAUNCHES:
            measure_launches(device, record, dry)
        for case in (c for c in CASES if c.part == part):
            dtype = torch.float32 if dry else case.dtype
            need = 0.5 if dry else case.need_gib
            if need > memory_gib:
                why = f"needs about {need:g} GiB; {memory_gib:.1f} GiB to plan for (--memory-gib, default the device's)"
                record(part=part, case=case.name, row="case", skipped=why)
                print(f"{case.name}: skipped (needs about {need:g} GiB of {memory_gib:.1f})", flush=True)
                continue
            try:
                if built != (case.preset, case.depth, dtype):
                    model = built = None
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    model = build(case, device, dtype, dry)
                    built = (case.preset, case.depth, dtype)
                run_case(case, model, device, dtype, dry, record)
            except Exception as error:  # one case failing keeps the others' rows
                record(part=part, case=case.name, row="case", error=f"{type(error).__name__}: {error}"[:300],
                       where=traceback.format_exc().splitlines()[-3][:200])
                print(f"{case.name} failed: {type(error).__name__}: {error}", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        record(part=part, row="part", wall_s=time.perf_counter() - begun)
        print(f"part {part}: {time.perf_counter() - begun:.0f} s", flush=True)
    print(f"\nrows in {out}", flush=True)


if __name__ == "__main__":
    main()

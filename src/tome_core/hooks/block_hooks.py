"""The hooks on each transformer block and its sub-layers: the block decides its :class:`BlockPlan` as it
starts; each merged sub-layer merges its input and unmerges its output. Framework-free."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

from ..algorithm.backend import get_ops
from ..algorithm.match import Match
from ..algorithm.merge import merge, unmerge
from ..algorithm.ops import ArrayOps
from ..config import ToMeConfig
from ..framework import Framework, REUSED, argument, argument_positions, arguments, forward_of, replace_argument
from ..models.arrangement_rules import arrangement_error, arrangement_problem, kv_in_kernel
from ..models.families import (
    BlockFamily, Sublayer, TEXT_AFTER, TEXT_BEFORE, TEXT_NONE, TEXT_PREFIX, TEXT_SUFFIX, attends_text_only, child_at,
    joined_text, text_follows, with_text_after,
)
from ..models.model_tree import block_metric
from ..shards import CONTEXT_PARALLEL
from .attention_bias import SizeBias, own_call
from .ledger import Level, shown_sublayer
from .state import ToMeState


@dataclass(frozen=True)
class BlockPlan:
    """What one block does at one call, decided as it starts (:meth:`BlockRun.begin`) and read by its sub-layers'
    hooks: its options (``mode="auto"`` resolved, or the fallback), its matches per sub-layer kind (none: it runs
    unmerged), the tokens before (``head``) and after (``tail``) the grid's in its image stream, and its level in
    the call's statistics until it is counted there (None: not counted, or already)."""

    config: ToMeConfig
    matches: Dict[str, Match] = field(default_factory=dict)
    head: int = 0
    tail: int = 0
    level: Optional[Level] = None


def around_grid(
    ops: ArrayOps, x: Any, stream: str, grid: Optional[Tuple[int, int]], tail: int, grid_last: bool
) -> Tuple[int, int]:
    """``(head, tail)``: the tokens around the grid's in a block's image stream ``x`` ``[B, L, C]``: the call's
    ``tail``, and in a stream of image tokens alone every token past the grid too (FLUX.3's reference images),
    the head instead where the call's grid comes last (``grid_last``: FramePack)."""
    if stream != TEXT_NONE or grid is None:
        return 0, tail
    extra = max(ops.shape(x)[1] - grid[0] * grid[1] - tail, 0)
    return (extra, tail) if grid_last else (0, tail + extra)


def image_tokens(ops: ArrayOps, x: Any, stream: str, grid: Optional[Tuple[int, int]], head: int, tail: int) -> Any:
    """The image tokens of a block's input ``x`` ``[B, L, C]``, which its match is computed from: without the
    ``head`` and ``tail`` (:func:`around_grid`) and the text its ``stream`` puts in front or behind."""
    if stream == TEXT_NONE and not tail and not head:
        return x
    length = ops.shape(x)[1]
    if stream == TEXT_NONE:
        return x[:, head : length - tail]
    if stream == TEXT_SUFFIX:
        return x[:, : grid[0] * grid[1]]
    return x[:, length - tail - grid[0] * grid[1] : length - tail]


class Settled(NamedTuple):
    """A block that ran unmerged for its size in an eager call: one with the same :attr:`CallFacts.key
    <tome_core.hooks.call.CallFacts.key>`, input ``shape``, ``family`` and ``config`` runs so again, counted as
    ``unpaid`` (``(level, why, tokens)``; None: not counted)."""

    key: Any
    shape: Any
    family: BlockFamily
    config: ToMeConfig
    unpaid: Optional[Tuple[int, str, int]]


class BlockRun:
    """The plan of one transformer block while it runs, shared by its sub-layers' hooks. A forward that records
    gradients remembers its plan per input tensor (while it lives): a recomputation in backward (gradient
    checkpointing), when the state may be another call's, takes it back instead of matching again."""

    def __init__(
        self, fw: Framework, state: ToMeState, family: BlockFamily, stream: int, block: Any, ratio: Optional[float],
        where: str,
    ):
        self.fw = fw
        self.state = state
        self.base = self.family = family  # family: the base, or its variant in this call (family_in_call)
        self.stream = stream
        self.block = block
        self.ratio = ratio  # its block_ratios entry
        self.where = where
        self.attentions: List[Tuple[Sublayer, Any]] = []  # its merged self-attentions (what kv/queries arrange)
        self.merged: set = set()  # sub-layers (children) merged in this run of the block
        self.masks = any(sublayer.masks for sublayer in family.sublayers)  # gathered like rotary positions
        self.text_after = with_text_after(family) if family.text_after_with else None  # family_in_call's variant
        self.reads = (
            block_metric(family, block), _named_position(block, family.text_after_with),
            _named_position(block, family.unmerged_with[0] if family.unmerged_with else None),
            _named_position(block, family.text_input),
        )
        # where text sits in what all its sub-layers run on, for the base family and its text-after variant
        self.joins = {variant: joined_text(variant) for variant in (family, self.text_after) if variant is not None}
        self.lent = False  # another model may run this block in its own call (ModelLayout.lent)
        self.idle = BlockPlan(state.active)  # the plan of a run that merges nothing (its options are not read)
        self.plan = self.idle
        self.kinds: List[Optional[str]] = []  # the kind of each hooked sub-layer (None: an Inside one)
        self.unfinished: Optional[Set[int]] = None  # the slots whose merge is still to come in this run
        self.ran: Dict[int, Tuple[Any, BlockPlan]] = {}  # id(input): (weakref to it, the plan it ran with)
        self.settled: Optional[Settled] = None  # the last eager call in which it ran unmerged for its size

    def begin(self, module, args, kwargs):
        """Decide this block's :class:`BlockPlan` for the call now starting, cheapest checks first: an eager GPU
        call whose blocks run unmerged is bound by the hooks' host time."""
        if self.state.config.merge_mlp:
            block_problem(self.block, self.state.config)
        if self.merged:  # what an interrupted call left (a BaseException skips post-hooks)
            self.merged.clear()
        whole, text_after, unmerged_by, text = arguments(args, kwargs, self.reads)
        self.family = self.base if text_after is None else self.text_after
        earlier = self._ran_on(whole) if self.ran else None
        if earlier is not None:  # a recomputation (checkpointing): as it ran then, counted then
            self._start(replace(earlier[1], level=None))
            return None
        if self.lent and not self.state.in_call:  # another model runs this block (it borrowed it): unmerged
            self.plan, self.unfinished = self.idle, None
            return None
        plan = self._decide(get_ops(whole), whole, unmerged_by, text)
        if plan is self.idle:  # most blocks of an eager call: no more host time than this
            self.plan, self.unfinished = plan, None
        else:
            self._start(plan)
        if self.fw.may_run_again(whole):
            self.ran = {key: entry for key, entry in self.ran.items() if entry[0]() is not None}
            self.ran[id(whole)] = (weakref.ref(whole), self.plan)
        return None

    def _start(self, plan: BlockPlan) -> None:
        """Run this call of the block with ``plan``, each sub-layer that merges by it still to run."""
        self.plan = plan
        kinds = self.kinds
        self.unfinished = None if None in kinds else {slot for slot, kind in enumerate(kinds) if kind in plan.matches}

    def finished(self, slot: int) -> None:
        """The hooked sub-layer ``slot`` has run; after the last that merges, the block lets go of its matches, so
        what follows (a DiT block's peak, its feed-forward) holds no more memory than unpatched (Inside: at its end)."""
        unfinished = self.unfinished
        if unfinished is None:
            return
        unfinished.discard(slot)
        if not unfinished:
            self.plan, self.unfinished = self.idle, None

    def _decide(self, ops: ArrayOps, whole: Any, unmerged_by: Any, text: Any) -> BlockPlan:
        """The plan of this call: the block's image tokens read off its input ``whole``, then what
        :meth:`ToMeState.decide` makes of them. ``unmerged_by``, ``text``: its call's ``unmerged_with`` and
        ``text_input`` arguments."""
        state, family, call = self.state, self.family, self.state.call
        deciding = call.merging and unmerged_by is None
        if call.merging and unmerged_by is not None:  # the call runs this block unmerged: said once
            name, why = family.unmerged_with
            state.ledger.say_once(
                f"ToMe on {self.where}: calls whose blocks get {name} ({why}) run unmerged in those blocks"
            )
            state.ledger.hold(f"they got {name} ({why})")
        config, fallback = self._arrangement(state.active) if deciding else (None, None)
        settled = self.settled
        if deciding and settled is not None and settled.key == call.key and settled.family is family and (
            settled.config is config and settled.shape == ops.shape(whole)
        ):  # it repeats the eager call in which it last ran unmerged for its size: so again, counted as then
            if settled.unpaid is not None:
                state.ledger.unpaid_block(*settled.unpaid)
            return self.idle
        metric, grid, own_grid = whole, state.grid_hw, None
        if family.feature_map:  # its grid is its input's (B, C, H, W), entered as the state decides
            grid = own_grid = tuple(ops.shape(metric)[2:])
            metric = pixels(ops, metric)
        metric = _batch_first(ops, metric) if family.sequence_first else metric
        shards = call.shards
        if shards is not None and id(self.block) in shards.split_inside:  # context parallelism splits it in the block
            if family.stream != TEXT_NONE:
                raise ValueError(
                    f"ToMe cannot merge {self.where} {CONTEXT_PARALLEL}: its {type(self.block).__name__} splits its "
                    "input of text and image tokens together, so a process's piece mixes both"
                )
            length = ops.shape(metric)[1] // shards.count
            metric = metric[:, shards.rank * length : (shards.rank + 1) * length]  # this process's piece
        head, tail = around_grid(ops, metric, family.stream, grid, call.tail, call.grid_last)
        if head + tail > call.tail and shards is not None:
            raise ValueError(
                f"ToMe cannot merge {self.where} {CONTEXT_PARALLEL}: its {type(self.block).__name__}s get "
                f"{head + tail - call.tail} tokens of other images beside the output's grid, which the split divides "
                "together with it"
            )
        if not deciding:
            return self.idle
        if family.stream != TEXT_NONE and grid is None:
            raise ValueError(f"ToMe on {self.where}: a {type(self.block).__name__} got no token grid from its model's call")
        image = image_tokens(ops, metric, family.stream, grid, head, tail)
        if call.execution is None:  # its device and execution, where the call's start did not read them
            state.call = call._replace(execution=self.fw.execution(image))
        shared = family.rotary is not None or self.masks
        # the text (and head and tail) its sub-layers run on, for its match to carry; not where keys and values
        # merge apart (kv, queries), which may meet keys the processor adds itself (Flux.2 Klein KV's cache)
        join, around = self.joins[family], (0, 0)
        in_stream = family.stream == join
        if join is not None and shards is None and config.mode not in ("kv", "queries") and (in_stream or text is not None):
            words = ops.shape(metric)[1] - ops.shape(image)[1] - head - tail if in_stream else ops.shape(text)[1]
            around = (words + head, tail) if join == TEXT_PREFIX else (head, tail + words)
        matches, level, unpaid = state.decide(image, self.stream, shared, self.ratio, config, fallback, own_grid, around)
        if matches is None:  # it runs unmerged for its size: a level above max_downsample, or merging would not pay
            # remembered for the next call in an eager one, unless the block reads its grid itself or may be lent
            key = state.call.key
            remember = key is not None and not family.feature_map and not self.lent
            self.settled = Settled(key, ops.shape(whole), family, config, unpaid) if remember else None
            return self.idle
        self.settled = None
        if any(any(match.joined) for match in matches.values()):  # its matches run on the whole sequence
            head = tail = 0
        return BlockPlan(config, matches, head, tail, level)

    def _ran_on(self, x: Any) -> Optional[Tuple[Any, BlockPlan]]:
        """What an earlier run of this block on ``x`` used, if this recomputes it: on ``x`` itself (non-reentrant
        checkpointing) or on a live tensor whose data ``x`` shares (reentrant: a detached copy)."""
        earlier = self.ran.get(id(x))
        if earlier is not None and earlier[0]() is x:
            return earlier
        return next((entry for entry in self.ran.values() if self.fw.same_data(entry[0](), x)), None)

    def _arrangement(self, config: ToMeConfig) -> Tuple[ToMeConfig, Optional[str]]:
        """The options this block runs with now, and why they are a fallback (None: they are not): ``config``,
        unless its self-attention (its processor now) cannot take keys and values apart from its queries; then
        ``mode="auto"`` runs :meth:`ToMeState.fallback`, and an explicit ``kv`` or ``queries`` is refused."""
        if config.mode not in ("kv", "queries"):
            return config, None
        for sublayer, module in self.attentions:
            # inside the attention kernel only when asked for by name: mode="auto" chose kv where keys come apart
            problem = arrangement_problem(self.fw, self.block, sublayer, module, config.mode, self.state.config.mode == "kv")
            if problem is None:
                continue
            if self.state.config.mode != "auto":
                raise arrangement_error(config.mode, f"block {self.stream} of {self.where}", problem)
            return self.state.fallback(self.fw.bias_problem(module) is None), problem
        return config, None

    def arrangement(self, kind: str, self_attention: bool) -> Tuple[str, bool]:
        """:meth:`ToMeConfig.arrangement` of this run's options: never size-aware where the matcher keeps tokens
        that each stand for themselves (:attr:`Matcher.sized <tome_core.algorithm.match.Matcher.sized>` False)."""
        mode, size_aware = self.plan.config.arrangement(kind, self_attention)
        return mode, size_aware and self.state.matching.matcher.sized

    def count(self, kind: str, child: Optional[str] = None, why: str = "") -> None:
        """Count this block in the call's statistics, once per call and only for the sub-layer its summary line
        shows, as its ``kind`` sub-layer ran with its match; or, given ``child``, as that one ran on all its
        tokens because of ``why``."""
        plan = self.plan
        if plan.level is not None and kind == shown_sublayer(plan.matches):
            if child is None:
                self.state.ledger.count(plan.level, plan.matches[kind])
            else:
                self.state.ledger.passed(plan.level, child, why, plan.matches[kind].grid_tokens[0])
            self.plan = replace(plan, level=None)

    def end(self, module, args, kwargs, output):
        self.plan, self.unfinished = self.idle, None
        self.merged.clear()
        return None


def family_argument_position(family: BlockFamily, block: Any) -> Optional[int]:
    """Where ``block``'s forward takes its family's ``text_after_with`` argument by position (None: none)."""
    return _named_position(block, family.text_after_with)[1]


def family_in_call(family: BlockFamily, at: Optional[int], args, kwargs) -> BlockFamily:
    """``family`` as a block call runs it: :func:`~tome_core.models.families.with_text_after` where the call gives
    its ``text_after_with`` argument (at position ``at``)."""
    if family.text_after_with is None or argument(args, kwargs, family.text_after_with, at) is None:
        return family
    return with_text_after(family)


def _named_position(block: Any, name: Optional[str]) -> Tuple[Optional[str], Optional[int]]:
    """``(name, its position in block's forward)``; ``(None, None)`` for no name."""
    return (name, argument_positions(forward_of(type(block)), name)[name]) if name else (None, None)


def pixels(ops: ArrayOps, x: Any) -> Any:
    """A feature map ``(B, C, H, W)`` as tokens ``[B, H * W, C]``, with the ops protocol's transpose."""
    batch, channels, height, width = ops.shape(x)
    return ops.matrix_transpose(ops.reshape(x, (batch, channels, height * width)))


def _batch_first(ops: ArrayOps, x: Any) -> Any:
    """``[S, B, C]`` as ``[B, S, C]``, with the ops protocol's transpose of the last two axes."""
    length, batch, channels = ops.shape(x)
    x = ops.matrix_transpose(ops.reshape(x, (length, batch * channels)))  # [B * C, S]
    return ops.matrix_transpose(ops.reshape(x, (batch, channels, length)))


def block_problem(block: Any, config: ToMeConfig) -> None:
    """Refuse options that this block, as it is now set up, cannot run (at ``patch`` and at each call)."""
    if config.merge_mlp and getattr(block, "_chunk_size", None) is not None:
        raise ValueError(
            f"merge_mlp=True cannot be combined with feed-forward chunking (enable_forward_chunking) of "
            f"{type(block).__name__}: the feed-forward runs on chunks of the merged tokens; disable one of them"
        )


class SublayerHooks:
    """The hooks of one merged sub-layer (its :class:`Sublayer` as the block's call runs it, :func:`family_in_call`):
    :meth:`before` merges the image tokens of its first input, moves rotary positions and masks, and arms
    size-aware attention, or the ``kv``/``queries`` arrangement (inside the attention kernel without a
    ``kv_input``: :class:`KernelKeys`); :meth:`after` unmerges the image stream of its output. An output cache
    (e.g. Pyramid Attention Broadcast) that hands back a stored output gets that call's unmerged result."""

    def __init__(self, fw: Framework, run: BlockRun, sublayer: Sublayer, module: Any):
        self.fw = fw
        self.run = run
        self.index = run.base.sublayers.index(sublayer)
        family = run.family
        self.rotary = tuple(name for name in (family.rotary, family.key_rotary) if name is not None)
        self.kv_name = sublayer.kv_input or "encoder_hidden_states"  # where its keys and values come from
        # where module's forward takes the arguments that move with its tokens by position (None: by keyword only)
        self.at = argument_positions(
            forward_of(type(module)), "attention_mask", self.kv_name, *self.rotary,
            *(name for name, _ in sublayer.masks), *sublayer.aligned, *sublayer.counts, *sublayer.log_bases,
        )
        self.head = 0  # the head in this call's input (sublayer_head)
        self.inside = Inside(fw, run, sublayer, module) if sublayer.projections else None
        self.slot = len(run.kinds)  # its place in run.kinds
        run.kinds.append(None if self.inside is not None else sublayer.kind)
        self.text_only = attends_text_only(run.block, sublayer)  # its block's flag makes it a cross-attention
        self.passing = False  # the call in flight runs on all its tokens (_passes)
        self.in_kernel = False  # the call in flight merges keys and values inside its kernel (KernelKeys)
        self.stored: Tuple[Any, Any] = (None, None)  # (raw output, its unmerged form), only under a cache

    @property
    def sublayer(self) -> Sublayer:
        return self.run.family.sublayers[self.index]

    def before(self, module, args, kwargs):
        self.passing = self.in_kernel = False
        if self.run.plan is self.run.idle:  # its block runs unmerged in this call
            return None
        run, sublayer, at, inside = self.run, self.sublayer, self.at, self.inside
        x = argument(args, kwargs, "hidden_states", 0)
        # one that merges at its projections (Inside) given keys and values other than its input, with no image
        # among them, is a cross-attention: it merges its queries as crossattn
        kv = argument(args, kwargs, self.kv_name, at[self.kv_name]) if inside is not None else None
        cross = inside is not None and (self.text_only or (sublayer.text == TEXT_NONE and kv is not None and kv is not x))
        kind = "crossattn" if cross else sublayer.kind
        match = run.plan.matches.get(kind)
        if match is not None and match.merged == 0:  # it runs on all its tokens, as its match says
            run.count(kind)
        # a cross-attention's attention_mask is over the text's keys (Kandinsky 3's), which merging never touches
        if match is None or match.merged == 0 or (not cross and self._passes(args, kwargs)):
            return None
        mode, size_aware = run.arrangement(kind, sublayer.attention and not cross)
        tail, text = run.plan.tail, sublayer.text
        if inside is not None:
            inside.arm(match, mode, cross, size_aware)
            bias = SizeBias(match, text, x, tail, whole_mask=False) if size_aware else None
            return None if bias is None else self.fw.size_aware(module, args, kwargs, bias)
        self.fw.output_cache(module)  # a cache set after patch is checked here
        self.head = head = sublayer_head(run, sublayer, get_ops(x).shape(x)[1], match.tokens)
        if mode == "kv" and kv_in_kernel(self.fw, sublayer, module):
            own = self._own_keys(args, kwargs, x, match.grid_tokens[0])  # its queries keep every token
            bias = SizeBias(match, text, x, tail, head) if size_aware else None
            self.in_kernel = True
            return self.fw.kernel_keys(module, args, kwargs, KernelKeys(match, text, tail, head, own), bias)
        change = lambda image: merge(image, match)  # noqa: E731
        merged = around_image(x, match.tokens, tail, text, change, head)
        if mode == "queries":  # a self-attention's queries merged, every token its keys and values
            args, kwargs = replace_argument(args, kwargs, "hidden_states", 0, merged)
            return args, {**kwargs, sublayer.kv_input: x}
        if mode != "tokens":  # kv: its queries kept, the merged tokens its keys and values
            kwargs = {**kwargs, sublayer.kv_input: merged}
            return self._size_aware(module, args, kwargs, match, merged) if size_aware else (args, kwargs)
        args, kwargs = replace_argument(args, kwargs, "hidden_states", 0, merged)
        for name in sublayer.aligned:
            other = argument(args, kwargs, name, at[name])
            if other is not None:
                alike = merged if other is x else around_image(other, match.tokens, tail, text, change, head)
                args, kwargs = replace_argument(args, kwargs, name, at[name], alike)
        for name in self.rotary:
            args, kwargs = self._merge_rotary(args, kwargs, match, name, at[name])
        for name, axes in sublayer.masks:  # token masks, over [text; merged image; tail]
            mask = argument(args, kwargs, name, at[name])
            if mask is not None:
                for axis in axes:  # none: a mask over the text only, which the processor extends over the image
                    mask = merge_positions((mask,), match, axis, tail, text_follows(text), head)[0]
                args, kwargs = replace_argument(args, kwargs, name, at[name], mask)
        for name in sublayer.counts:
            if argument(args, kwargs, name, at[name]) is not None:
                args, kwargs = replace_argument(args, kwargs, name, at[name], match.kept)
        for name in sublayer.log_bases:
            base = argument(args, kwargs, name, at[name])
            if base is not None:
                base = same_logarithm(base, get_ops(x).shape(x)[1], get_ops(merged).shape(merged)[1])
                args, kwargs = replace_argument(args, kwargs, name, at[name], base)
        if not size_aware:
            return args, kwargs
        # With only_cross_attention, a BasicTransformerBlock's attn1 attends to text: its keys are not merged. (Its
        # own input given again there, Lumina-Next's and OmniGen's, was merged alike: its keys are.)
        attends_text = self.kv_name not in sublayer.aligned and argument(args, kwargs, self.kv_name, at[self.kv_name]) is not None
        if text == TEXT_NONE and attends_text:
            return args, kwargs
        return self._size_aware(module, args, kwargs, match, merged)

    def _passes(self, args, kwargs) -> bool:
        """Whether this call runs on all its tokens: a call after the block's first of a :attr:`Sublayer.once`, or
        a self-attention given an ``attention_mask`` that the family table does not gather (SkyReels-V2's; a UNet
        call's) or that is no array (Qwen-Image 2.1's flex ``BlockMask``): merging would mix tokens it keeps apart."""
        run, child = self.run, self.sublayer.child
        if self.sublayer.once and child in run.merged:
            self.passing = True
            return True
        run.merged.add(child)
        mask = argument(args, kwargs, "attention_mask", self.at["attention_mask"])
        if mask is None or self.sublayer.kind != "attn":
            return False
        x = argument(args, kwargs, "hidden_states", 0)
        if any(name == "attention_mask" for name, _ in self.sublayer.masks) and (
            isinstance(mask, type(x)) or isinstance(x, type(mask))
        ):
            return False
        why = "it is given an attention_mask over its tokens, which merging cannot follow"
        run.state.ledger.say_once(
            f"ToMe on {run.where}: {type(run.block).__name__}.{child} {why.removeprefix('it ')}; it runs on all its "
            "tokens (its block's other sub-layers still merge) in such calls"
        )
        run.count(self.sublayer.kind, f"{type(run.block).__name__}.{child}", why)
        self.passing = True
        return True

    def after(self, module, args, kwargs, output):
        run = self.run
        if run.plan is run.idle:
            if self.inside is None and self.stored[0] is None:
                return None  # its block runs unmerged in this call, and no cache holds an output to hand back
            return self._after(module, output)
        try:
            return self._after(module, output)
        finally:
            run.finished(self.slot)

    def _after(self, module, output):
        if self.inside is not None:
            ran = self.inside.done(module, output)
            if ran is not None:
                self.run.count(ran)
            return None
        if self.passing:  # this call ran on all its tokens
            self.passing = False
            return None
        match = self.run.plan.matches.get(self.sublayer.kind)
        if match is None and self.stored[0] is None:  # it ran unmerged, and no cache holds an output to hand back
            return None
        cached = output is not None and self.fw.output_cache(module) == REUSED  # None: the sub-layer raised
        reused = cached and output is self.stored[0]
        if output is not None and not reused:  # its attention ran (a cache's stored output: it did not)
            self.run.count(self.sublayer.kind)
        mode, size_aware = self.run.arrangement(self.sublayer.kind, self.sublayer.attention)
        if size_aware or self.in_kernel:
            self.in_kernel = False
            self.fw.size_aware_done(module, computed=output is not None and not reused)  # None: it raised
        if reused:
            return self.stored[1]
        # kv: the queries kept every token, so the output has them all
        if output is None or match is None or match.merged == 0 or mode == "kv":
            self.stored = (None, None)
            return None
        index, extra = self.sublayer.output, self.sublayer.extra_outputs
        image = output if index is None else output[index]
        head = sublayer_head(self.run, self.sublayer, get_ops(image).shape(image)[1], match.kept)
        image = around_image(image, match.kept, self.run.plan.tail, self.sublayer.text, lambda x: unmerge(x, match), head)
        result = image if index is None else type(output)(
            image if i == index else unmerge(part, match) if i in extra else part for i, part in enumerate(output)
        )
        self.stored = (output, result) if cached else (None, None)
        return result

    def _merge_rotary(self, args, kwargs, match, name: str, at: Optional[int]):
        """The sub-layer's rotary argument ``name`` (at position ``at``) moved to the merged tokens."""
        rotary = argument(args, kwargs, name, at)
        if rotary is None:
            return args, kwargs
        family, after = self.run.family, text_follows(self.sublayer.text)
        if isinstance(rotary, dict):  # tables by name (AnyFlow's query and key frequencies)
            moved = merge_positions(
                tuple(rotary.values()), match, family.rotary_axis, self.run.plan.tail, after, self.head, self.run.state.matching.drawn
            )
            return replace_argument(args, kwargs, name, at, type(rotary)(zip(rotary, moved)))
        if not isinstance(rotary, (tuple, list)):  # one table (Z-Image's complex frequencies)
            moved = merge_positions((rotary,), match, family.rotary_axis, self.run.plan.tail, after, self.head)[0]
            return replace_argument(args, kwargs, name, at, moved)
        items = family.rotary_items
        moved = merge_positions(
            [table for i, table in enumerate(rotary) if items is None or i in items], match, family.rotary_axis,
            self.run.plan.tail, after, self.head, self.run.state.matching.drawn,
        )
        if items is not None:
            moved = iter(moved)
            moved = [next(moved) if i in items else table for i, table in enumerate(rotary)]
        return replace_argument(args, kwargs, name, at, type(rotary)(moved))

    def _size_aware(self, module, args, kwargs, match, merged):
        own = self._own_keys(args, kwargs, merged, match.grid_tokens[1])
        return self.fw.size_aware(
            module, args, kwargs, SizeBias(match, self.sublayer.text, merged, self.run.plan.tail, self.head, own=own)
        )

    def _own_keys(self, args, kwargs, keys_from: Any, queried: int) -> Tuple[int, int]:
        """The fewest ``(queries, keys)`` of this attention's own call: ``queried`` image tokens (a processor may
        attend with its text and other tokens apart: Flux.2 Klein KV's references), and the tokens of ``keys_from``
        with at least one of the text a joint attention is given apart (Mochi's drops padded text)."""
        joint = self.sublayer.text in (TEXT_BEFORE, TEXT_AFTER) and argument(args, kwargs, "encoder_hidden_states", None) is not None
        return queried, get_ops(keys_from).shape(keys_from)[1] + joint


class KernelKeys:
    """The ``kv`` arrangement inside the attention kernel of a self-attention that computes its keys and values
    itself (no ``kv_input``): the adapter calls :meth:`reduce` on each kernel call's ``[B, K, C]`` keys and values,
    after the processor's projections, norms and rotary positions; the queries keep every token."""

    def __init__(self, match: Match, text: str, tail: int = 0, head: int = 0, own: Tuple[int, int] = (0, 0)):
        self.match = match
        self.own = own  # the fewest queries and keys of the attention's own kernel call (own_call)
        self.text = text
        self.tail = tail
        self.head = head

    def reduce(self, x: Any, first: int = 0) -> Any:
        """``[B, K, C]`` keys (or values) -> ``[B, K - r, C]``, the image part merged; a call over part of the batch
        (Mochi's, item by item) holds the items from ``first`` on."""
        match = self.match
        batch, keys = get_ops(x).shape(x)[:2]
        if not self.holds_image(keys):
            return x
        words = keys - self.head - match.tokens - self.tail
        if (words and self.text == TEXT_NONE) or first + batch > match.batch:
            raise RuntimeError(
                f"mode='kv' inside the attention: a kernel call over {batch} x {keys} keys does not fit the block's "
                f"{match.batch} x {self.head + match.tokens + self.tail} image tokens"
                f"{'' if self.text == TEXT_NONE else ' and its text'}; pass mode='tokens'"
            )
        layout = TEXT_NONE if not words else TEXT_SUFFIX if text_follows(self.text) else TEXT_PREFIX
        change = (lambda image: merge(image, match)) if batch == match.batch else (lambda image: self._part(image, first))
        return around_image(x, match.tokens, self.tail, layout, change, self.head)

    def _part(self, image: Any, first: int) -> Any:
        """Image tokens of the items from ``first`` on, merged within a whole batch of zeros."""
        ops, match = get_ops(image), self.match
        batch, tokens, channels = ops.shape(image)
        zeros = lambda count: [ops.zeros((count, tokens, channels), image)] if count else []  # noqa: E731
        whole = ops.concat([*zeros(first), image, *zeros(match.batch - first - batch)], axis=0)
        return merge(whole, match)[first : first + batch]

    def holds_image(self, keys: int) -> bool:
        """Whether a kernel call over ``keys`` keys can attend to the block's image tokens; fewer pass as they are
        (the head alone: Flux.2 Klein KV's extract step; an IP-Adapter's image prompt)."""
        return keys >= self.head + self.match.tokens + self.tail

    def own_call(self, queries: int, keys: int) -> bool:
        """:func:`~tome_core.hooks.attention_bias.own_call` of a kernel call."""
        return own_call(self.own, self.holds_image(keys), queries, keys)

    def reduce_mask(self, mask: Any, axis: int) -> Any:
        """An attention mask whose ``axis`` runs over the kernel call's keys, moved to the merged keys."""
        if not self.holds_image(get_ops(mask).shape(mask)[axis]):
            return mask
        return merge_positions((mask,), self.match, axis, self.tail, text_follows(self.text), self.head)[0]


def same_logarithm(base: float, whole: int, short: int) -> float:
    """``base ** (ln short / ln whole)``: the base under which ``log(short)`` is ``log(whole)`` under ``base``
    (:attr:`~tome_core.models.families.Sublayer.log_bases`); ``base`` itself below two tokens."""
    if short < 2 or whole < 2 or short == whole:
        return base
    return float(base) ** (math.log(short) / math.log(whole))


def sublayer_head(run: "BlockRun", sublayer: Sublayer, length: int, tokens: int) -> int:
    """The block's head in a sub-layer's input (or output) of ``length`` tokens around ``tokens`` image tokens:
    none where a sub-layer without text runs on the grid alone (Helios' cross-attention)."""
    if sublayer.text in (TEXT_PREFIX, TEXT_SUFFIX) or length == run.plan.head + tokens + run.plan.tail:
        return run.plan.head
    return 0


def around_image(x: Any, tokens: int, tail: int, text: str, change: Callable[[Any], Any], head: int = 0) -> Any:
    """``x`` ``[B, L, C]``, ``[head; image; tail]`` with the rest text in front (``TEXT_PREFIX``) or behind
    (``TEXT_SUFFIX``), with its ``tokens`` image tokens replaced by ``change(image)``."""
    ops = get_ops(x)
    length = ops.shape(x)[1]
    words = length - head - tokens - tail if text in (TEXT_PREFIX, TEXT_SUFFIX) else 0
    if not words and not tail and not head:
        return change(x)
    start = (words if text == TEXT_PREFIX else 0) + head
    parts = [x[:, :start]] if start else []
    parts.append(change(x[:, start : start + tokens]))
    if start + tokens < length:
        parts.append(x[:, start + tokens :])
    return ops.concat(parts, axis=1)


def merge_positions(
    rotary: Any, match: Match, axis: int = 0, tail: int = 0, text_after: bool = False, head: int = 0,
    memo: Optional[Dict[Any, Any]] = None,
) -> Any:
    """Tables (rotary positions, token masks) over ``[text; head; image; tail]`` along ``axis`` (``[head; image;
    tail; text]`` with ``text_after``) moved to the merged tokens: each takes its destination's entry (batch item
    0's: the match is shared); one of one entry broadcasts and stays. ``memo``: the call's arrays (:attr:`Matching.drawn
    <tome_core.hooks.matching.Matching.drawn>`), where tables every block gets are stacked once for one gather."""
    if match.representatives is None:
        return rotary
    tables = tuple(rotary)
    stacked = _stacked(tables, axis, memo) if memo is not None else None
    if stacked is not None:
        moved = _moved(stacked, match, axis + 1 if axis >= 0 else axis, tail, text_after, head)
        return tuple(moved[i] for i in range(len(tables)))
    moved = []
    for table in tables:
        if isinstance(table, (tuple, list)):  # nested: Allegro's per-token positions (t, h, w)
            moved.append(type(table)(merge_positions(table, match, axis, tail, text_after, head)))
        else:
            moved.append(_moved(table, match, axis, tail, text_after, head))
    return tuple(moved)


def _stacked(tables: Tuple[Any, ...], axis: int, memo: Dict[Any, Any]) -> Any:
    """Several ``tables`` of one type and shape (longer than one along ``axis``) stacked along a new first axis,
    once per call (``memo``); else None."""
    if len(tables) < 2 or any(isinstance(table, (tuple, list)) for table in tables):
        return None
    ops = get_ops(tables[0])
    shape = ops.shape(tables[0])
    if not -len(shape) <= axis < len(shape) or shape[axis] == 1 or any(
        type(table) is not type(tables[0]) or ops.shape(table) != shape for table in tables
    ):
        return None
    key = ("stacked positions",) + tuple(id(table) for table in tables)
    held = memo.get(key)
    if held is None or any(a is not b for a, b in zip(held[0], tables)):  # the ids of tables still alive
        held = memo[key] = (tables, ops.concat([ops.reshape(table, (1, *shape)) for table in tables], axis=0))
    return held[1]


def _moved(table: Any, match: Match, axis: int, tail: int, text_after: bool, head: int) -> Any:
    """One table of :func:`merge_positions` moved to the merged tokens."""
    ops = get_ops(table)
    axis %= len(ops.shape(table))
    length = ops.shape(table)[axis]
    if length == 1:
        return table
    text = length - head - match.tokens - tail
    if text < 0:
        raise ValueError(
            f"a position table (rotary positions or a token mask) of {length} entries along axis {axis} "
            f"cannot cover the {head + match.tokens + tail} tokens of the block's image stream"
        )
    first = (0 if text_after else text) + head  # the image's first row
    end = first + match.tokens
    image = ops.take(table[_along(axis, first, end)], match.representatives[0], axis=axis)
    pieces = [table[_along(axis, 0, first)]] if first else []
    pieces.append(image)
    if end < length:
        pieces.append(table[_along(axis, end, length)])
    return ops.concat(pieces, axis=axis) if len(pieces) > 1 else image


def _along(axis: int, start: int, stop: int) -> Tuple[slice, ...]:
    """The index of entries ``start`` to ``stop`` along ``axis``."""
    return (slice(None),) * axis + (slice(start, stop),)


class Inside:
    """ToMe inside an attention that keeps its norm and residual to itself (:attr:`Sublayer.projections`): while a
    call armed by :meth:`SublayerHooks.before` runs, its query, key and value projections merge their inputs and
    its output projection unmerges its output, as the call's arrangement says."""

    def __init__(self, fw: Framework, run: BlockRun, sublayer: Sublayer, module: Any):
        self.fw = fw
        self.run = run
        self.sublayer = sublayer
        self.projections = [child_at(module, path) for path in sublayer.projections]
        missing = [path for path, found in zip(sublayer.projections, self.projections) if not fw.is_module(found)]
        if missing:
            raise ValueError(f"ToMe cannot merge {type(module).__name__}: it has no {', '.join(missing)}")
        self.armed: Optional[Tuple[Match, str, bool, bool]] = None  # (match, mode, cross, size-aware) of a call
        self.plan: Optional[BlockPlan] = None  # the block plan it was armed under (another: an interrupted call's)
        self.query: Tuple[Any, Any] = (None, None)  # (what the query projection got, what it got instead)
        self.keys: Tuple[Any, Any] = (None, None)  # the same for the key and value projections
        self.acted = False

    def attach(self, add: Callable[[Any], None]) -> None:
        query, key, value, output = self.projections
        add(self.fw.add_pre_hook(query, self._query))
        add(self.fw.add_pre_hook(key, self._key))
        add(self.fw.add_pre_hook(value, self._key))
        add(self.fw.add_post_hook(output, self._output))

    def arm(self, match: Match, mode: str, cross: bool, size_aware: bool) -> None:
        self.armed = (match, mode, cross, size_aware)
        self.plan = self.run.plan
        self.query = self.keys = (None, None)
        self.acted = False

    def done(self, module: Any, output: Any) -> Optional[str]:
        """The armed attention returned (``output`` None: it raised): disarm, refuse a processor that passed by
        the projections, and return the sub-layer kind that ran merged (None: none did)."""
        armed, acted = self.armed, self.acted
        self.armed, self.query, self.keys = None, (None, None), (None, None)
        if armed is None:
            return None
        if armed[3]:
            self.fw.size_aware_done(module, computed=output is not None)
        if output is not None and not acted:
            raise RuntimeError(
                f"ToMe: the processor {type(getattr(module, 'processor', None)).__name__} of a merged "
                f"{type(module).__name__} did not run its projections ({', '.join(self.sublayer.projections)}), where "
                "ToMe merges; use diffusers' default attention processor there"
            )
        return None if output is None else ("crossattn" if armed[2] else self.sublayer.kind)

    def _query(self, module, args, kwargs):
        if not self._live():
            return None
        match, mode = self.armed[:2]
        x = args[0]
        if mode not in ("tokens", "queries"):
            self.query = (x, x)
            return None
        self.acted = True
        self.query = (x, merge(x, match))
        return (self.query[1],) + tuple(args[1:]), kwargs

    def _key(self, module, args, kwargs):
        if not self._live():
            return None
        match, mode, cross = self.armed[:3]
        x = args[0]
        if cross or mode == "queries":
            return None
        if x is not self.keys[0]:
            if x is self.query[0] and self.query[1] is not x:
                merged = self.query[1]
            elif x is self.query[0]:
                merged = merge(x, match)
            elif self.sublayer.text != TEXT_NONE:  # [image; text] (or [text; image]) keys: the image part
                text = TEXT_SUFFIX if text_follows(self.sublayer.text) else TEXT_PREFIX
                merged = around_image(x, match.tokens, self.run.plan.tail, text, lambda image: merge(image, match))
            else:
                return None
            self.keys = (x, merged)
        self.acted = True
        return (self.keys[1],) + tuple(args[1:]), kwargs

    def _live(self) -> bool:
        """Whether a call armed this attention in its block's present run (not an interrupted one)."""
        return self.armed is not None and self.plan is self.run.plan

    def _output(self, module, args, kwargs, output):
        if not self._live() or output is None or self.armed[1] not in ("tokens", "queries"):
            return None
        return unmerge(output, self.armed[0])

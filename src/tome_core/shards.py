"""Context parallelism: a model's token sequence split across processes (diffusers' ``enable_parallelism``),
each process merging its own piece on that piece's grid, and the checks that refuse what this cannot follow, with
the reason. Framework-free."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from .config import ToMeConfig


class Shards(NamedTuple):
    """A model's token sequence split into ``count`` contiguous shards, this process holding shard ``rank``.
    ``even``: every shard has the same length (False under ``ulysses_anything`` / ``ring_anything``); ``ring``: ring
    attention; ``split_inside``: ids of the blocks that split their ``hidden_states`` inside their call (Wan's
    first block), whose pre-hook still sees the whole sequence."""

    count: int
    rank: int
    even: bool = True
    ring: bool = False
    split_inside: frozenset = frozenset()


CONTEXT_PARALLEL = "under context parallelism"


def check_shards(shards: Shards, size_aware: bool, where: str) -> None:
    """Refuse a context-parallel set-up that merging cannot follow (at ``patch`` and at each call, since
    ``enable_parallelism`` may come after ``patch``)."""
    if not shards.even:
        raise ValueError(
            f"ToMe cannot merge {where} {CONTEXT_PARALLEL} with ulysses_anything or ring_anything: its shards differ "
            "in length, so the processes would merge different numbers of tokens on grids no shard fills; use an "
            "even ContextParallelConfig (a token count that divides by the number of processes)"
        )
    if shards.ring and size_aware:
        raise ValueError(
            f"proportional_attn=True (size-aware attention) cannot run on {where} under ring attention "
            "(ring_degree > 1): each process attends to the other processes' keys chunk by chunk with one mask for "
            "every chunk, so the merged keys' sizes cannot follow them; pass proportional_attn=False, or use "
            "ulysses_degree alone"
        )


def shard_grid(
    grid: Tuple[int, int], shards: Shards, tail: int, videos: Optional[int], where: str
) -> Tuple[int, int]:
    """This process's token grid: ``count`` equal contiguous pieces of a ``rows x cols`` grid (a video's frames
    stacked as rows) are ``rows / count`` whole rows each (every process merges as many tokens)."""
    rows, cols = grid
    problem = None
    if tail:
        problem = (
            f"its image stream holds {tail} tokens of other images after the output's {rows}x{cols} grid, which the "
            "split divides together with it"
        )
    elif videos is not None:
        problem = "its frames are items of the batch, which the split does not divide"
    elif rows % shards.count:
        problem = (
            f"its {rows}x{cols} token grid (rows, or frames x rows, by columns) splits into {shards.count} pieces that "
            f"are not whole rows ({rows} rows do not divide by {shards.count}); choose a size whose token rows do"
        )
    if problem is not None:
        raise ValueError(
            f"ToMe cannot merge {where} {CONTEXT_PARALLEL} on {shards.count} processes: it merges each process's "
            f"piece of the sequence on that piece's own rows, and {problem}"
        )
    return rows // shards.count, cols


def check_shard_cells(grid: Tuple[int, int], shards: Shards, config: ToMeConfig, where: str) -> None:
    """Refuse a shard shorter than one cell: it would merge nothing."""
    rows, cols = grid
    sx, sy = config.cell_at(1)
    if rows < sy or cols < sx:
        raise ValueError(
            f"ToMe cannot merge {where} {CONTEXT_PARALLEL} on {shards.count} processes: each process's piece of the "
            f"token grid is {rows}x{cols}, smaller than one {sx}x{sy} cell (sx, sy), so it would merge nothing; use "
            "fewer processes, a larger image, or smaller cells"
        )

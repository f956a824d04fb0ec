"""The facts of one call of a patched model, read once as it starts (:class:`~tome_core.hooks.call_hooks.CallStart`)
and the same for every block it runs. Framework-free."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

from ..shards import Shards


class CallFacts(NamedTuple):
    """One model call: its latent's (or token grid's) size ``latent_hw`` (None: the first grid its blocks are told);
    its ``step`` (the timestep as the partition hash takes it); ``videos``, the batch of a video model's call (its
    blocks see videos * frames items; None: not a video call); ``merging`` False where it runs unmerged (its
    timestep is outside ``timestep_range``, or ``why``); ``tail``, tokens of other images (a reference image's)
    after the grid's in every block's image stream, never merged, or before it where ``grid_last`` (FramePack's
    history); ``shards``, how context parallelism splits its tokens (``latent_hw`` is then this process's piece);
    ``execution``, its device and execution (``Framework.execution``; None: read by its first block); and
    ``frame_rows``, the rows of each video frame its latent stacks (0: one frame); ``key``: :meth:`eager`."""

    latent_hw: Optional[Tuple[int, int]] = None
    step: Any = 0
    videos: Optional[int] = None
    merging: bool = True
    why: Optional[str] = None
    tail: int = 0
    grid_last: bool = False
    shards: Optional[Shards] = None
    execution: Optional[Tuple[str, str]] = None
    frame_rows: int = 0
    key: Any = None  # what an eager call's blocks decide their sizes from (:meth:`eager`; None: not eager)

    def eager(self) -> CallFacts:
        """These facts with their :attr:`key`: a call with the same key repeats its blocks' size decisions
        (:class:`~tome_core.hooks.block_hooks.BlockRun`); only in an eager call (read once, as the call starts)."""
        execution = self.execution
        if execution is None or execution[1] != "eager" or self.shards is not None:
            return self
        return self._replace(key=(self.latent_hw, self.videos, self.merging, self.tail, self.grid_last, execution, self.frame_rows))

    def frames(self, grid: Optional[Tuple[int, int]]) -> Tuple[int, int]:
        """``(frame_rows, offset)``: a block on ``grid`` sees a video whose frames of ``frame_rows`` rows are stacked
        in its rows, its first row being row ``offset`` of its frame (a process's piece under context parallelism
        starts where the rows of the pieces before it end); ``(0, 0)``: one frame (the call's latent holds one, or
        the block's grid is not the latent's)."""
        if not self.frame_rows or grid is None or grid != self.latent_hw:
            return 0, 0
        offset = self.shards.rank * grid[0] % self.frame_rows if self.shards is not None else 0
        return self.frame_rows, offset

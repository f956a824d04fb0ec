"""How a diffusion transformer's call places its tokens on a grid: one :class:`Reader` per layout, chosen once per
model at ``patch`` (:func:`grid_reader`) and run as each call begins, returns where the call's image tokens sit
(:class:`Placed`) or why no grid is known (the call then runs unmerged, said once). A new layout is a new reader
here and a line in :func:`grid_reader`. Framework-free."""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from ..algorithm.backend import get_ops
from ..framework import SHAPE_LISTS, TOKEN_IDS, Framework, argument, argument_positions, forward_of
from .families import GridLayout, TokenRoles, model_layout
from .levels import indicated_run, leading_raster, spatial_size, trailing_frames, trailing_raster
from .model_tree import config_value


class Placed(NamedTuple):
    """Where a call's image tokens sit: a ``(rows, cols)`` grid (a video's ``frames`` stacked in rows), ``tail``
    tokens after it, ``videos`` items whose frames are the blocks' batch (None: the call's batch), and whether the
    grid ends the stream (``grid_last``)."""

    grid: Tuple[int, int]
    tail: int = 0
    videos: Optional[int] = None
    grid_last: bool = False
    frames: int = 1


Reading = Union[Placed, str]  # where the tokens sit, or why no grid is known


class Call(NamedTuple):
    """One call of the model: its arguments, its latent (``sample``) and the latent's shape."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    sample: Any
    shape: Tuple[int, ...]


class Reader:
    """What every reader shares: where the arguments it reads (``names``) sit in the model's ``forward``, its
    ``patch_size``, and host reads of small arrays made once per array object (pipelines build them once per
    generation)."""

    def __init__(self, fw: Framework, model: Any, *names: str):
        self.fw = fw
        self.where = argument_positions(forward_of(type(model)), *names)
        self.patch_size = config_value(model, "patch_size")
        self.grid_last = model_layout(type(model)).grid_last  # the latent's tokens end each block's image stream
        self._read: Dict[str, Tuple[Any, Any]] = {}

    def get(self, call: Call, name: str) -> Any:
        return argument(call.args, call.kwargs, name, self.where[name])

    def first(self, call: Call, names: Sequence[str]) -> Any:
        return next((value for value in (self.get(call, name) for name in names) if value is not None), None)

    def read_once(self, what: str, array: Any, read: Callable[[List[List[float]], Tuple[int, ...]], Any]) -> Any:
        """``read(*self.rows(array))``, read again only for another array."""
        if what not in self._read or self._read[what][0] is not array:
            self._read[what] = (array, read(*self.rows(array)))
        return self._read[what][1]

    def rows(self, array: Any) -> Tuple[List[List[float]], Tuple[int, ...]]:
        """``array``'s values on the host as rows along its last axis, and its shape."""
        values, shape = self.fw.host_values(array), get_ops(array).shape(array)
        return [values[i : i + shape[-1]] for i in range(0, len(values), shape[-1])], shape

    def __call__(self, call: Call) -> Reading:
        raise NotImplementedError


class PackedIds(Reader):
    """Packed image tokens ``[B, N, C]`` placed by their ids (Flux's ``img_ids``): by the grid their pipeline told
    (:func:`tell_grid`) where it places all of them, else read on the host once per ids array."""

    def __init__(self, fw: Framework, model: Any):
        super().__init__(fw, model, *TOKEN_IDS)

    def __call__(self, call: Call) -> Reading:
        ids = self.first(call, TOKEN_IDS)
        if ids is None:
            raise ValueError("ToMe needs img_ids to place packed image tokens on their grid")
        tokens, told = call.shape[1], getattr(ids, GRID_TAG, None)  # the grid tell_grid gave the ids
        if told is not None and told[0] * told[1] == tokens and get_ops(ids).shape(ids)[-2] == tokens:
            return Placed(told)

        def read(rows: List[List[float]], shape: Tuple[int, ...]) -> Optional[Placed]:
            # the output image's raster grid, then reference images' tokens (leading_raster); or the grid last,
            # after them (trailing_raster). Ids of more rows than tokens (Krea 2's position_ids over [text; image])
            # are read from their last rows
            rows = rows[-min(tokens, len(rows) // (shape[0] if len(shape) == 3 else 1)):]
            leading = leading_raster(rows)
            if leading is not None:
                return Placed(leading[:2], leading[2])
            trailing = trailing_raster(rows)
            return None if trailing is None else Placed(trailing[:2], 0, None, True)

        placed = self.read_once("ids", ids, read)
        if placed is None:
            return (
                "its img_ids do not begin with one image's tokens in raster order (row by row), so no token grid is "
                "known; calls with such ids run unmerged"
            )
        return placed


class LatentGrid(Reader):
    """The latent's shape over ``patch_size``: ``(B, C, H, W)`` images (any ``context_latents`` a tail),
    ``(B, C, F, H, W)`` videos (a 2-D patch: frames are the blocks' batch; a 3-D patch: frames stacked in one
    sequence), ``(B, items, C, F, H, W)`` (items after the first a tail); packed tokens by :class:`PackedIds`."""

    def __init__(self, fw: Framework, model: Any):
        self.context = model_layout(type(model)).context_latents  # images' latents after the grid
        super().__init__(fw, model, *((self.context,) if self.context else ()))
        self.data_format = getattr(model, "data_format", "NCHW")
        self.packed = PackedIds(fw, model)

    def __call__(self, call: Call) -> Reading:
        shape, patch = call.shape, self.patch_size
        if len(shape) == 4:
            height, width = spatial_size(call.sample, self.data_format)
            side = patch if isinstance(patch, int) else patch[-1]  # (1, 1): HunyuanImage
            context = (self.get(call, self.context) or ()) if self.context else ()
            tail = sum(
                (rows // side) * (cols // side)
                for rows, cols in (spatial_size(latent, self.data_format) for latent in context)
            )
            return Placed((height // side, width // side), tail, None, self.grid_last)
        if len(shape) == 5 and isinstance(patch, int):
            return Placed((shape[3] // patch, shape[4] // patch), 0, shape[0], self.grid_last)
        if len(shape) in (5, 6):
            frames, height, width = (n // p for n, p in zip(shape[-3:], patch))
            tail = (shape[1] - 1) * frames * height * width if len(shape) == 6 else 0
            return Placed((frames * height, width), tail, None, self.grid_last, frames)
        return self.packed(call)


class ShapeListGrid(Reader):
    """Per-item image shapes the call gives (:data:`~tome_core.framework.SHAPE_LISTS`, Qwen-Image's ``img_shapes``):
    per batch item the ``(frames, h, w)`` of each image in the sequence (or one tuple), the output's first and the
    rest with any padding a tail (with ``grid_last``, the output's last and no tail); a call without them is read by
    ``otherwise``."""

    def __init__(self, fw: Framework, model: Any, otherwise: Reader):
        super().__init__(fw, model, *SHAPE_LISTS)
        self.otherwise = otherwise

    def __call__(self, call: Call) -> Reading:
        shapes = self.first(call, SHAPE_LISTS)
        if shapes is None:
            return self.otherwise(call)
        last, tokens = self.grid_last, call.shape[1]
        outputs = [tuple(item[-1 if last else 0] if isinstance(item[0], (tuple, list)) else item) for item in shapes]
        if any(output != outputs[0] for output in outputs):
            return mixed_sizes("output images", "its shape list")
        frames, height, width = outputs[0]
        if frames * height * width > tokens:
            raise ValueError(f"shapes {outputs[0]} give more than the {tokens} tokens of hidden_states")
        return Placed((frames * height, width), 0 if last else tokens - frames * height * width, None, last)


class VideoGrid(Reader):
    """A video transformer's frame-major sequence (:class:`~tome_core.models.families.GridLayout`), sized by its 5-D
    latent, the call's size arguments or its tokens' coordinates; marked condition frames are a tail."""

    def __init__(self, fw: Framework, model: Any, layout: GridLayout):
        named = tuple(name for name in (layout.coords, layout.frame_types) if name)
        super().__init__(fw, model, *layout.sizes, *layout.patch_arguments, *named)
        self.layout = layout
        forward = inspect.signature(forward_of(type(model)))
        self.defaults = {name: forward.parameters[name].default for name in layout.patch_arguments}
        self.temporal_patch = (layout.temporal_patch and config_value(model, layout.temporal_patch)) or 1

    def __call__(self, call: Call) -> Reading:
        layout = self.layout
        sizes = self._sizes(call)
        if sizes is None:
            given = ", ".join((*layout.sizes, *((layout.coords,) if layout.coords else ())))
            return f"the call gave none of {given} (or coordinates of no video grid), so no token grid is known; such calls run unmerged"
        frames, height, width, from_coords = sizes
        grid, tail = (frames * height, width), (call.shape[1] - frames * height * width if layout.frames_axis is None else 0)
        conditions = self._condition_frames(call)
        if conditions is None:
            return (
                f"its {layout.frame_types} do not give noisy frames (type 0) first and conditions after them, the "
                "same in every item, so no token grid is known; such calls run unmerged"
            )
        if conditions:  # appended condition frames: a tail after the grid
            frames, tail = frames - conditions, tail + conditions * height * width
            grid = (frames * height, width)
        if from_coords:  # conditioning tokens before the grid: the blocks' head
            return Placed(grid, 0, None, True, frames)
        return Placed(grid, tail, None, self.grid_last, frames)

    def _sizes(self, call: Call) -> Optional[Tuple[int, int, int, bool]]:
        """``(frames, rows, cols, from_coords)`` of the tokens (``from_coords``: after conditioning tokens), or None."""
        layout, patch = self.layout, self.patch_size
        temporal = self.temporal_patch
        spatial = patch if isinstance(patch, int) else (patch or (1,))[-1]
        if isinstance(patch, (tuple, list)) and len(patch) == 3:
            temporal = patch[0]
        if layout.patch_arguments:
            temporal, spatial = (self.get(call, name) or self.defaults[name] for name in layout.patch_arguments)
        if layout.frames_axis is None:
            sizes = [self.get(call, name) for name in layout.sizes]
            if any(size is None for size in sizes):
                coords = self.get(call, layout.coords) if layout.coords else None  # [B, 3, N]: item 0's, per token
                found = None if coords is None else self.read_once(
                    "coords", coords, lambda rows, shape: trailing_frames([list(c) for c in zip(*rows[: shape[-2]])])
                )
                return None if found is None else (*found[:3], True)
        else:
            shape = call.shape
            sizes = [shape[layout.frames_axis], *(shape[2:4] if layout.channels_last else shape[-2:])]
        return sizes[0] // temporal, sizes[1] // spatial, sizes[2] // spatial, False

    def _condition_frames(self, call: Call) -> Optional[int]:
        """How many frames at the end of the call's video are conditions (0 where it gives no types), or None where
        its types are not noisy frames (0) then conditions, alike in every item."""
        types = self.get(call, self.layout.frame_types) if self.layout.frame_types else None
        if types is None:
            return 0

        def read(rows: List[List[float]], shape: Tuple[int, ...]) -> Optional[int]:
            noisy = sum(1 for value in rows[0] if value == 0)
            if not noisy or any(row != rows[0] for row in rows) or any(value != 0 for value in rows[0][:noisy]):
                return None
            return len(rows[0]) - noisy

        return self.read_once("types", types, read)


class RolesGrid(Reader):
    """Packed rows whose image tokens a per-token role tells (:class:`~tome_core.models.families.TokenRoles`): the
    image's last run in every row is the grid, the tokens after it a tail."""

    def __init__(self, fw: Framework, model: Any, roles: TokenRoles):
        super().__init__(fw, model, *roles.arguments)
        self.roles = roles
        self.last: Tuple[Tuple[Any, ...], Any] = ((), None)  # (the arrays read, indicated_run of them)

    def __call__(self, call: Call) -> Reading:
        run = self._indicated(call)
        if run is None:
            roles = self.roles
            return (
                f"its {roles.indicator} does not end the image's tokens with one run at the same place in every row, "
                f"in one segment and under the same {roles.ids} of one grid (rows packing other samples elsewhere), "
                "so no token grid is known; such calls run unmerged"
            )
        rows, cols, _, tail, frames = run
        return Placed((rows, cols), tail, None, self.grid_last, frames)

    def _indicated(self, call: Call) -> Optional[Tuple[int, int, int, int, int]]:
        """``(rows, cols, head, tail, frames)`` of the image's last run in the call's rows (:func:`indicated_run`), or
        None; read on the host once per set of arrays."""
        roles = self.roles
        arrays = tuple(self.get(call, name) for name in roles.arguments)
        if any(array is None for array in arrays):
            return None
        if len(arrays) != len(self.last[0]) or any(a is not b for a, b in zip(arrays, self.last[0])):
            # roles and segments [B, L], ids [B, L, k] (rows of L tokens); without the batch axis, one layout for all
            (indicator, _), (tokens, shape), *segments = (self.rows(array) for array in arrays)
            ids = [tokens[i : i + shape[-2]] for i in range(0, len(tokens), shape[-2])]
            run = indicated_run(indicator, roles.image, ids, segments[0][0] if segments else None)
            self.last = (arrays, None if run is None else (*run, _frames(ids[0][run[2] : run[2] + run[0] * run[1]])))
        return self.last[1]


def _frames(ids: Sequence[Sequence[float]]) -> int:
    """How many frames a run of ``(t, row, col)`` ids holds: its tokens over those at its last time."""
    return len(ids) // sum(1 for token in ids if token[0] == ids[-1][0])


GRID_TAG = "_tome_grid"  # the attribute that tells the raster grid of ids a pipeline made (tell_grid)


def tell_grid(ids: Any, rows: Any, cols: Any) -> None:
    """Tag ``ids`` ``[..., N, k]`` that a pipeline's :class:`~tome_core.models.families.IdsMaker` made with their
    raster grid ``(rows, cols)`` (Python ints, where ``N`` is ``rows * cols``); an array that takes no attributes
    is left untagged."""
    if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in (rows, cols)):
        return
    shape = get_ops(ids).shape(ids)
    if len(shape) >= 2 and shape[-2] == rows * cols:
        try:
            setattr(ids, GRID_TAG, (int(rows), int(cols)))
        except (AttributeError, TypeError):
            pass


def grid_reader(fw: Framework, model: Any) -> Reader:
    """The reader of a diffusion transformer's calls, by its :class:`~tome_core.models.families.ModelLayout`."""
    layout = model_layout(type(model))
    if layout.roles is not None:
        return RolesGrid(fw, model, layout.roles)
    if layout.video is not None:
        return VideoGrid(fw, model, layout.video)
    return ShapeListGrid(fw, model, LatentGrid(fw, model))


def mixed_sizes(what: str, where: str) -> str:
    """Why a call whose batch items give their ``what`` different sizes in ``where`` runs unmerged: one match
    serves the whole batch, so every item must share one token grid."""
    return (
        f"the items of its batch give their {what} different sizes in {where}, so no one token grid is known; "
        "such calls run unmerged"
    )

"""The array operations the merge algorithm needs, and nothing more.

Each backend (numpy, torch, paddle, jax) implements this protocol with its framework's own functions.
Names follow the Python Array API where the operation exists there. Every operation returns a new array
(jax has no in-place update). Arithmetic and comparisons use the arrays' own operators (``+ - * // % >=``),
which all four frameworks provide with the same meaning.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Protocol, Sequence, Tuple

Array = Any


class ArrayOps(Protocol):
    """Array operations used by :mod:`tome_core.algorithm.partition`, :mod:`tome_core.algorithm.match` and :mod:`tome_core.algorithm.merge`."""

    name: str

    def shape(self, x: Array) -> Tuple[int, ...]:
        """Static shape as Python ints."""

    def cache_key(self, like: Array) -> Optional[Hashable]:
        """Where arrays like ``like`` live (e.g. its device), so shape-only index arrays can be reused there;
        ``None`` disables reuse (e.g. while tracing, where arrays must not outlive the trace)."""

    def arange(self, n: int, like: Array) -> Array:
        """``[0, 1, ..., n-1]`` as the backend's index dtype, on ``like``'s device."""

    def zeros(self, shape: Sequence[int], like: Array) -> Array:
        """Zeros of ``like``'s dtype and device."""

    def ones(self, shape: Sequence[int], like: Array) -> Array:
        """Ones of ``like``'s dtype and device."""

    def as_index(self, x: Array) -> Array:
        """``x`` converted (floored) to the backend's index dtype."""

    def astype_like(self, x: Array, like: Array) -> Array:
        """``x`` converted to ``like``'s dtype."""

    def reshape(self, x: Array, shape: Sequence[int]) -> Array: ...

    def broadcast_to(self, x: Array, shape: Sequence[int]) -> Array: ...

    def concat(self, arrays: Sequence[Array], axis: int) -> Array: ...

    def where(self, condition: Array, a: Any, b: Any) -> Array:
        """Elementwise choice; ``a`` or ``b`` may be a Python scalar."""

    def matmul(self, a: Array, b: Array) -> Array:
        """Batched matrix product of two 3-D arrays."""

    def matrix_transpose(self, x: Array) -> Array:
        """Swap the last two axes."""

    def aligned_columns(self, x: Array) -> Array:
        """``x`` zero-padded on its last axis to a length this backend's :meth:`matmul` runs fastest with as its
        right operand (the caller slices the extra columns off); ``x`` itself where any length is as fast."""

    def log(self, x: Array) -> Array:
        """Natural logarithm, elementwise."""

    def mean(self, x: Array, axes: Tuple[int, ...]) -> Array:
        """Mean over ``axes`` (dropped), in ``x``'s dtype."""

    def stop_gradient(self, x: Array) -> Array:
        """``x`` cut from automatic differentiation (the match is a discrete choice: nothing of it is kept for the
        backward pass)."""

    def unit_vectors(self, x: Array) -> Array:
        """``x`` over its Euclidean norm along the last axis; a zero vector stays zero (divided by the dtype's
        smallest normal number instead of 0: a backend may flush subnormal numbers to zero)."""

    def max_argmax(self, x: Array) -> Tuple[Array, Array]:
        """Maximum over the last axis and its (first) index."""

    def argsort_desc(self, x: Array) -> Array:
        """Indices sorting the last axis in descending order; stable, so ties keep their order."""

    def take(self, x: Array, indices: Array, axis: int) -> Array:
        """Select along ``axis`` with a 1-D index shared by all other axes."""

    def take_along_axis(self, x: Array, indices: Array, axis: int) -> Array: ...

    def scatter(self, target: Array, indices: Array, values: Array, axis: int) -> Array:
        """Copy of ``target`` with ``values`` written at ``indices`` along ``axis`` (unique indices)."""

    def scatter_add(self, target: Array, indices: Array, values: Array, axis: int) -> Array:
        """Copy of ``target`` with ``values`` summed into ``indices`` along ``axis`` (repeats accumulate)."""

"""jax implementation of the array-ops protocol: pure jax.numpy / lax calls on static shapes, so the match, merge
and unmerge run under ``jax.jit`` without host round trips. The index dtype is jax's default integer (the
partition hash stays below 2**31). Ops of several primitives are jitted: inlined inside a traced model, and
compiled once per shape, not once per primitive, in eager use.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax._src.core import trace_state_clean


def _index_dtype():
    """jax's default integer: int32, or int64 under ``jax_enable_x64``."""
    return jax.dtypes.canonicalize_dtype(jnp.int64)


def _along_axis(indices, axis):
    """Index tuple addressing ``indices[..., i, ...]`` along ``axis`` and every other position as itself."""
    ndim = indices.ndim
    grid = []
    for dim, size in enumerate(indices.shape):
        if dim == axis % ndim:
            grid.append(indices)
        else:
            shape = [1] * ndim
            shape[dim] = size
            grid.append(jax.lax.broadcasted_iota(indices.dtype, tuple(shape), dim))
    return tuple(grid)


@jax.jit
def _as_index(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = jnp.floor(x)
    return x.astype(_index_dtype())


@jax.jit
def _vector_norm(x):
    return jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))


@jax.jit
def _max_argmax(x):
    index = jnp.argmax(x, axis=-1)
    return jnp.take_along_axis(x, index[..., None], axis=-1, mode="promise_in_bounds")[..., 0], index


@jax.jit
def _argsort_desc(x):
    return jnp.argsort(x, axis=-1, stable=True, descending=True)


@partial(jax.jit, static_argnums=2)
def _take(x, indices, axis):
    return jnp.take(x, indices, axis=axis, mode="clip")


@partial(jax.jit, static_argnums=2)
def _take_along_axis(x, indices, axis):
    return jnp.take_along_axis(x, indices, axis=axis, mode="promise_in_bounds")


@partial(jax.jit, static_argnums=3)
def _scatter(target, indices, values, axis):
    return target.at[_along_axis(indices, axis)].set(values, mode="promise_in_bounds", unique_indices=True)


@partial(jax.jit, static_argnums=3)
def _scatter_add(target, indices, values, axis):
    return target.at[_along_axis(indices, axis)].add(values, mode="promise_in_bounds")


class JaxOps:
    name = "jax"

    def shape(self, x):
        return tuple(int(n) for n in jnp.shape(x))

    def cache_key(self, like):
        # Shape-only index arrays may be reused between eager calls, never across a trace (they would be tracers).
        if isinstance(like, jax.core.Tracer) or not trace_state_clean():
            return None
        try:
            return like.device
        except (AttributeError, ValueError):  # not a committed single-device array
            return None

    def arange(self, n, like):
        return jnp.arange(n, dtype=_index_dtype())

    def zeros(self, shape, like):
        return jnp.zeros(shape, dtype=like.dtype)

    def ones(self, shape, like):
        return jnp.ones(shape, dtype=like.dtype)

    def as_index(self, x):
        return _as_index(jnp.asarray(x))

    def astype_like(self, x, like):
        return x.astype(like.dtype)

    def reshape(self, x, shape):
        return jnp.reshape(x, shape)

    def broadcast_to(self, x, shape):
        return jnp.broadcast_to(x, shape)

    def concat(self, arrays, axis):
        return jnp.concatenate(arrays, axis=axis)

    def where(self, condition, a, b):
        return jnp.where(condition, a, b)

    def matmul(self, a, b):
        return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)

    def aligned_columns(self, x):
        return x

    def matrix_transpose(self, x):
        return jnp.swapaxes(x, -1, -2)

    def log(self, x):
        return jnp.log(x)

    def mean(self, x, axes):
        return jnp.mean(x, axis=axes)

    def stop_gradient(self, x):
        return jax.lax.stop_gradient(x)

    def unit_vectors(self, x):
        return x / jnp.maximum(_vector_norm(x), jnp.finfo(x.dtype).tiny)

    def max_argmax(self, x):
        return _max_argmax(x)

    def argsort_desc(self, x):
        return _argsort_desc(x)

    def take(self, x, indices, axis):
        return _take(x, indices, axis)

    def take_along_axis(self, x, indices, axis):
        return _take_along_axis(x, indices, axis)

    def scatter(self, target, indices, values, axis):
        return _scatter(target, indices, values, axis)

    def scatter_add(self, target, indices, values, axis):
        return _scatter_add(target, indices, values, axis)


OPS = JaxOps()

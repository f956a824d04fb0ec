"""numpy implementation of the array-ops protocol: the reference backend."""

from __future__ import annotations

import numpy as np


class NumpyOps:
    name = "numpy"

    def shape(self, x):
        return tuple(int(n) for n in np.shape(x))

    def cache_key(self, like):
        return "cpu"

    def arange(self, n, like):
        return np.arange(n, dtype=np.int64)

    def zeros(self, shape, like):
        return np.zeros(shape, dtype=like.dtype)

    def ones(self, shape, like):
        return np.ones(shape, dtype=like.dtype)

    def as_index(self, x):
        x = np.asarray(x)
        return (np.floor(x) if x.dtype.kind == "f" else x).astype(np.int64)

    def astype_like(self, x, like):
        return x.astype(like.dtype, copy=False)

    def reshape(self, x, shape):
        return np.reshape(x, shape)

    def broadcast_to(self, x, shape):
        return np.broadcast_to(x, shape)

    def concat(self, arrays, axis):
        return np.concatenate(arrays, axis=axis)

    def where(self, condition, a, b):
        return np.where(condition, a, b)

    def matmul(self, a, b):
        return np.matmul(a, b)

    def aligned_columns(self, x):
        return x

    def matrix_transpose(self, x):
        return np.swapaxes(x, -1, -2)

    def log(self, x):
        return np.log(x)

    def mean(self, x, axes):
        return x.mean(axis=axes)

    def stop_gradient(self, x):
        return x

    def unit_vectors(self, x):
        return x / np.maximum(np.sqrt(np.sum(x * x, axis=-1, keepdims=True)), np.finfo(x.dtype).tiny)

    def max_argmax(self, x):
        index = np.argmax(x, axis=-1)
        return np.take_along_axis(x, index[..., None], axis=-1)[..., 0], index

    def argsort_desc(self, x):
        return np.argsort(-x, axis=-1, kind="stable")

    def take(self, x, indices, axis):
        return np.take(x, indices, axis=axis)

    def take_along_axis(self, x, indices, axis):
        return np.take_along_axis(x, indices, axis=axis)

    def scatter(self, target, indices, values, axis):
        out = target.copy()
        np.put_along_axis(out, indices, values, axis=axis)
        return out

    def scatter_add(self, target, indices, values, axis):
        out = target.copy()
        grids = list(np.indices(indices.shape, sparse=True))
        grids[axis] = indices
        np.add.at(out, tuple(grids), values)
        return out


OPS = NumpyOps()

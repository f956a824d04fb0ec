"""paddle implementation of the array-ops protocol. No host syncs: every op stays on the tensors' device."""

from __future__ import annotations

import paddle

INDEX = "int64"


class PaddleOps:
    name = "paddle"

    def shape(self, x):
        return tuple(int(n) for n in x.shape)

    def cache_key(self, like):
        # Shape-only index arrays are reused per device; not while paddle.jit traces a static graph.
        return str(like.place) if paddle.in_dynamic_mode() else None

    def arange(self, n, like):
        return paddle.arange(n, dtype=INDEX)

    def zeros(self, shape, like):
        return paddle.zeros(list(shape), dtype=like.dtype)

    def ones(self, shape, like):
        return paddle.ones(list(shape), dtype=like.dtype)

    def as_index(self, x):
        return (paddle.floor(x) if paddle.is_floating_point(x) else x).astype(INDEX)

    def astype_like(self, x, like):
        return x if x.dtype == like.dtype else x.astype(like.dtype)

    def reshape(self, x, shape):
        return paddle.reshape(x, list(shape))

    def broadcast_to(self, x, shape):
        return paddle.broadcast_to(x, list(shape))

    def concat(self, arrays, axis):
        return paddle.concat(list(arrays), axis=axis)

    def where(self, condition, a, b):
        return paddle.where(condition, a, b)

    def matmul(self, a, b):
        return paddle.matmul(a, b)

    def aligned_columns(self, x):
        return x

    def matrix_transpose(self, x):
        perm = list(range(x.ndim))
        perm[-1], perm[-2] = perm[-2], perm[-1]
        return paddle.transpose(x, perm)

    def log(self, x):
        return paddle.log(x)

    def mean(self, x, axes):
        return x.mean(axis=list(axes))

    def stop_gradient(self, x):
        return x.detach()

    def unit_vectors(self, x):
        # Not sqrt(sum(x * x)): paddle's vectorised sqrt is off by an ulp from numpy's, which changes which
        # of two tied similarities wins; p_norm matches numpy bit for bit.
        norm = paddle.linalg.vector_norm(x, p=2, axis=-1, keepdim=True)
        return x / paddle.clip(norm, min=float(paddle.finfo(x.dtype).smallest_normal))

    def max_argmax(self, x):
        # One pass: paddle.argmax returns the first maximal index (like numpy); the value is gathered from it.
        index = paddle.argmax(x, axis=-1, keepdim=True)
        return paddle.take_along_axis(x, index, axis=-1, broadcast=False)[..., 0], index[..., 0]

    def argsort_desc(self, x):
        return paddle.argsort(x, axis=-1, descending=True, stable=True)

    def take(self, x, indices, axis):
        return paddle.index_select(x, indices, axis=axis)

    def take_along_axis(self, x, indices, axis):
        # broadcast=False: the index may be longer than ``x`` along ``axis`` (unmerge gathers N from N - r).
        return paddle.take_along_axis(x, indices, axis=axis, broadcast=False)

    def scatter(self, target, indices, values, axis):
        return paddle.put_along_axis(target, indices, values, axis=axis, reduce="assign", broadcast=False)

    def scatter_add(self, target, indices, values, axis):
        return paddle.put_along_axis(target, indices, values, axis=axis, reduce="add", broadcast=False)


OPS = PaddleOps()

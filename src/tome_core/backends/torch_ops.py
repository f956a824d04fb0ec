"""torch implementation of the array-ops protocol. No host syncs; works under torch.compile."""

from __future__ import annotations

import torch


class TorchOps:
    name = "torch"

    def shape(self, x):
        return tuple(x.shape)

    def cache_key(self, like):
        return None if torch.compiler.is_compiling() else like.device

    def arange(self, n, like):
        return torch.arange(n, device=like.device)

    def zeros(self, shape, like):
        return torch.zeros(shape, dtype=like.dtype, device=like.device)

    def ones(self, shape, like):
        return torch.ones(shape, dtype=like.dtype, device=like.device)

    def as_index(self, x):
        return (x.floor() if x.is_floating_point() else x).long()

    def astype_like(self, x, like):
        return x.to(like.dtype)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def broadcast_to(self, x, shape):
        return x.expand(shape)

    def concat(self, arrays, axis):
        return torch.cat(arrays, dim=axis)

    def where(self, condition, a, b):
        return torch.where(condition, a, b)

    def matmul(self, a, b):
        return torch.bmm(a, b)

    def aligned_columns(self, x):
        # cuBLAS's fast kernels need a product's rows 16-byte aligned: at 8,190 columns (Wan 480p's destinations)
        # it falls back to one 2.5x slower on an H200 (docs/results/gpu_match_costs.py)
        columns = x.shape[-1]
        return torch.nn.functional.pad(x, (0, -columns % 8)) if x.is_cuda and columns % 8 else x

    def matrix_transpose(self, x):
        return x.transpose(-1, -2)

    def log(self, x):
        return torch.log(x)

    def mean(self, x, axes):
        return x.mean(dim=axes)

    def stop_gradient(self, x):
        return x.detach()

    def unit_vectors(self, x):
        return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)

    def max_argmax(self, x):
        values, index = x.max(dim=-1)
        return values, index

    def argsort_desc(self, x):
        return torch.sort(x, dim=-1, descending=True, stable=True).indices

    def take(self, x, indices, axis):
        # a model may keep a table on another device than its tokens (CogView4's rotary table on the CPU)
        return x.index_select(axis, indices.to(x.device))

    def take_along_axis(self, x, indices, axis):
        return torch.gather(x, axis, indices.to(x.device))

    def scatter(self, target, indices, values, axis):
        return target.scatter(axis, indices, values)

    def scatter_add(self, target, indices, values, axis):
        return target.scatter_add(axis, indices, values)


OPS = TorchOps()

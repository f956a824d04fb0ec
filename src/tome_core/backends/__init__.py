"""Array backends: one module per framework implementing :class:`tome_core.algorithm.ops.ArrayOps`."""

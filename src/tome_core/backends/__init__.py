"""Array backends: one module per framework implementing :class:`tome_core.ops.ArrayOps`."""

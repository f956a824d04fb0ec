"""What runs while a patched model runs: the hooks on its calls and blocks, the run state they share, the size bias and the retyped classes."""

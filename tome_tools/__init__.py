"""The project's tools beside the library (not installed): the benchmark, the tiny model builders, the small
trained models and their training. Run from the checkout root, e.g. ``python -m tome_tools.bench``."""

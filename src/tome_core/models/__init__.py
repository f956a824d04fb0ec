"""What the library knows of models: block families as data, the model tree, grids and levels, the plan of a patch and when merging pays."""

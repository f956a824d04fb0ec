"""The algorithm, framework-free: the array-ops protocol, the partition into sources and destinations, the bipartite match, merge and unmerge."""

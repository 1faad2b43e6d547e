"""One block pruned, above the settings: the block pruner, statistics, the watch, slots, blocks the
forward skips, refinement, the team of processes and the memory estimate."""

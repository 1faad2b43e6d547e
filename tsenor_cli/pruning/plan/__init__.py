"""The plan, above the block layer: what a run will prune, its memory and disk, made once without weights."""

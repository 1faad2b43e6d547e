"""The pruning methods, bottom layer: what a method declares (`method.py`), the registry, the four methods
(each a pure `prune_batch(W, stats, cfg)`), masks from the solver, statistics and linear algebra."""

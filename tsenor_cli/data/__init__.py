"""Text data: calibration windows for pruning and token streams for perplexity."""

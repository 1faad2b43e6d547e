"""Model evaluation: perplexity and zero-shot accuracy (lm-evaluation-harness)."""

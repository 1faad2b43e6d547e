"""tsenor: prune LLaMA-family models to transposable N:M sparsity with the TSENOR mask solver."""

__version__ = "0.1.0"

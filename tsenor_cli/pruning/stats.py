"""Input statistics of one linear layer, accumulated over calibration batches by a forward hook.

Every method reads its statistics from here: Wanda the input column norms ‖X_j‖₂, SparseGPT and ALPS
the Gram matrix H = XᵀX, and the engine H again for the reconstruction error tr(ΔW H ΔWᵀ)/tr(W H Wᵀ).
Sums are kept in float32 as in SparseGPT/ALPS; their scale does not matter (the dampening is relative).
"""

from __future__ import annotations

import math

import torch


class InputStats:
    """Running sums over the inputs X (tokens, in) of one linear.

    sq_norms: (in,) float32 Σ_t X_tj²; gram: (in, in) float32 XᵀX, or None when not requested.
    """

    def __init__(self, in_features: int, *, gram: bool, device: torch.device | str) -> None:
        self.in_features = in_features
        self.sq_norms = torch.zeros(in_features, dtype=torch.float32, device=device)
        self.gram: torch.Tensor | None = (
            torch.zeros(in_features, in_features, dtype=torch.float32, device=device) if gram else None
        )
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """x: (..., in) any float dtype → accumulated (flattened to (tokens, in) float32)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer takes {self.in_features}")
        flat = x.reshape(-1, self.in_features).to(self.sq_norms.device, torch.float32)  # (T, in)
        self.sq_norms += flat.square().sum(0)
        if self.gram is not None:
            self.gram.addmm_(flat.T, flat)
        self.tokens += flat.shape[0]

    @property
    def col_norms(self) -> torch.Tensor:
        """(in,) float32 ‖X_j‖₂."""
        return self.sq_norms.sqrt()

    def require_gram(self) -> torch.Tensor:
        """(in, in) float32 XᵀX; raises when the statistics were collected without it."""
        if self.gram is None:
            raise ValueError("these statistics hold no Gram matrix; collect them with gram=True")
        return self.gram

    @staticmethod
    def from_inputs(x: torch.Tensor, *, gram: bool = True) -> InputStats:
        """x: (tokens, in) → statistics of exactly these inputs (for tests and direct library use)."""
        stats = InputStats(x.shape[-1], gram=gram, device=x.device)
        stats.add(x)
        return stats


def damped_gram(gram: torch.Tensor, percdamp: float) -> torch.Tensor:
    """gram: (in, in) → gram + percdamp·mean(diag)·I, dead inputs (zero diagonal) first set to 1 there.

    The dampening is the λ of the paper's layer-wise problem (Section 4); SparseGPT and ALPS use 1%.
    A dead input never reaches the layer, so its diagonal entry only needs to keep H invertible.
    """
    h = gram.clone()
    diag = h.diagonal()
    dead = diag == 0
    diag[dead] = 1.0
    diag += percdamp * diag.mean()
    return h


def reconstruction_error(w_dense: torch.Tensor, w_pruned: torch.Tensor, gram: torch.Tensor) -> float:
    """Relative output error ‖X(Ŵ−W)ᵀ‖²/‖XWᵀ‖² = tr(ΔW H ΔWᵀ)/tr(W H Wᵀ).

    w_dense, w_pruned: (out, in); gram: (in, in) undamped XᵀX. Returns 0 for a layer whose dense
    output is zero on the calibration data, and NaN when any input is not finite (never 0: a NaN must
    not read as a perfect layer).
    """
    h = gram.to(torch.float32)
    delta = w_pruned.to(h) - w_dense.to(h)  # (out, in)
    num = float(((delta @ h) * delta).sum(dtype=torch.float64))
    den = float(((w_dense.to(h) @ h) * w_dense.to(h)).sum(dtype=torch.float64))
    if not (math.isfinite(num) and math.isfinite(den)):
        return math.nan
    return num / den if den > 0 else 0.0

"""Input statistics of one linear layer, accumulated over calibration batches by a forward hook.

Every method reads its statistics from here: Wanda the input column norms ‖X_j‖₂, SparseGPT and ALPS
the Gram matrix H = XᵀX, and the engine H again for the reconstruction error tr(ΔW H ΔWᵀ)/tr(W H Wᵀ).
Sums are kept in float32 as in SparseGPT/ALPS; their scale does not matter (the dampening is relative).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class Statistics(Protocol):
    """What the methods read of the inputs of one matrix (`InputStats`, shapes (in,) / (in, in)) or of a
    stack of L matrices (`ExpertStats`, (L, in) / (L, in, in))."""

    @property
    def col_norms(self) -> torch.Tensor: ...

    def require_gram(self) -> torch.Tensor: ...


class _Sums:
    """The readers shared by `InputStats` and `ExpertStats`: sq_norms (..., in) and gram (..., in, in) or
    None, one matrix's or a stack's."""

    sq_norms: torch.Tensor
    gram: torch.Tensor | None

    @property
    def col_norms(self) -> torch.Tensor:
        """(..., in) float32 ‖X_j‖₂."""
        return self.sq_norms.sqrt()

    def require_gram(self) -> torch.Tensor:
        """(..., in, in) float32 XᵀX; raises when the statistics were collected without it."""
        if self.gram is None:
            raise ValueError("these statistics hold no Gram matrix; collect them with gram=True")
        return self.gram


class InputStats(_Sums):
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

    @staticmethod
    def from_inputs(x: torch.Tensor, *, gram: bool = True) -> InputStats:
        """x: (tokens, in) → statistics of exactly these inputs (for tests and direct library use)."""
        stats = InputStats(x.shape[-1], gram=gram, device=x.device)
        stats.add(x)
        return stats


def damped_gram(gram: torch.Tensor, percdamp: float) -> torch.Tensor:
    """gram: (..., in, in) → gram + percdamp·mean(diag)·I per matrix, dead inputs (zero diagonal) first
    set to 1 there.

    The dampening is the λ of the paper's layer-wise problem (Section 4); SparseGPT and ALPS use 1%.
    A dead input never reaches the layer, so its diagonal entry only needs to keep H invertible.
    """
    h = gram.clone()
    diag = h.diagonal(dim1=-2, dim2=-1)  # (..., in), a view that writes into h
    dead = diag == 0
    diag[dead] = 1.0
    diag += percdamp * diag.mean(-1, keepdim=True)
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


class ExpertStats(_Sums):
    """Running sums over the inputs of each of E stacked expert matrices.

    sq_norms: (E, in) float32; gram: (E, in, in) float32 or None; tokens: (E,) long, the rows each expert
    received that are not all zero (Llama-4 sends every token to every expert, scaled by its routing
    score: a zero row is a token not routed there, and adds nothing to the sums).
    """

    def __init__(self, experts: int, in_features: int, *, gram: bool, device: torch.device | str) -> None:
        self.in_features = in_features
        self.sq_norms = torch.zeros(experts, in_features, dtype=torch.float32, device=device)
        self.gram: torch.Tensor | None = (
            torch.zeros(experts, in_features, in_features, dtype=torch.float32, device=device) if gram else None
        )
        self.tokens = torch.zeros(experts, dtype=torch.long, device=device)

    def add(self, rows: torch.Tensor, experts: torch.Tensor) -> None:
        """rows: (n, in) any float dtype; experts: (n,) long, the expert of each row."""
        flat = rows.to(self.sq_norms.device, torch.float32)  # (n, in)
        ids = experts.to(self.sq_norms.device)  # (n,)
        if flat.shape[0] == 0:
            return
        self.sq_norms.index_add_(0, ids, flat.square())
        self.tokens.index_add_(0, ids, (flat != 0).any(1).long())
        if self.gram is None:
            return
        present, counts = torch.unique(ids, return_counts=True)  # (U,), (U,)
        if present.numel() == 1:
            self.gram[int(present)].addmm_(flat.T, flat)
            return
        # One batched XᵀX over the experts present: rows padded per expert into (U, max count, in).
        order = torch.argsort(ids, stable=True)  # (n,) rows grouped by expert
        slot = torch.searchsorted(present, ids[order])  # (n,) index of each sorted row's expert in `present`
        starts = torch.cumsum(counts, 0) - counts  # (U,)
        position = torch.arange(ids.numel(), device=ids.device) - starts[slot]  # (n,) row within its expert
        padded = flat.new_zeros(present.numel(), int(counts.max()), self.in_features)  # (U, C, in)
        padded[slot, position] = flat[order]
        self.gram.index_add_(0, present, padded.transpose(1, 2) @ padded)  # (U, in, in)

    def select(
        self, experts: torch.Tensor, fallback: ExpertStats | None = None, use: torch.Tensor | None = None
    ) -> ExpertStats:
        """experts: (L,) long → the statistics of those experts as a new `ExpertStats` of L (copies), each
        taken from `fallback` instead where `use` (L,) bool is set (an expert whose routed tokens were too
        few takes every-token statistics)."""
        picked = ExpertStats.__new__(ExpertStats)
        picked.in_features = self.in_features
        picked.tokens = self.tokens[experts]
        picked.sq_norms = self.sq_norms[experts]
        picked.gram = self.gram[experts] if self.gram is not None else None
        if fallback is not None and use is not None and bool(use.any()):
            picked.sq_norms = torch.where(use[:, None], fallback.sq_norms[experts], picked.sq_norms)
            if picked.gram is not None:
                picked.gram = torch.where(use[:, None, None], fallback.require_gram()[experts], picked.gram)
        return picked

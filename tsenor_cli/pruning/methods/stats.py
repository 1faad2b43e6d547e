"""Input statistics of one linear layer, accumulated over calibration batches by a forward hook.

Every method reads its statistics from here: Wanda the input column norms ‖X_j‖₂, SparseGPT and ALPS
the Gram matrix H = XᵀX, and the engine H again for the reconstruction error tr(ΔW H ΔWᵀ)/tr(W H Wᵀ).
Sums are kept in float32 as in SparseGPT/ALPS; their scale does not matter (the dampening is relative).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


# Expert buckets of one batched Gram (`ExpertStats.add_pieces`).
_BUCKETS = 4


class ExpertStats(_Sums):
    """Running sums over the inputs of each of E stacked expert matrices.

    sq_norms: (E, in) float32; gram: (E, in, in) float32 or None; tokens: (E,) long, the rows each expert
    received, or with `zero_rows` those that are not all zero (Llama-4 sends every token to every expert,
    scaled by its routing score: a zero row is a token not routed there, and adds nothing to the sums).
    A router's rows are all tokens it sent: not testing them saves a pass over them.
    """

    def __init__(
        self, experts: int, in_features: int, *, gram: bool, device: torch.device | str, zero_rows: bool = True
    ) -> None:
        self.in_features = in_features
        self.zero_rows = zero_rows
        self.sq_norms = torch.zeros(experts, in_features, dtype=torch.float32, device=device)
        self.gram: torch.Tensor | None = (
            torch.zeros(experts, in_features, in_features, dtype=torch.float32, device=device) if gram else None
        )
        self.tokens = torch.zeros(experts, dtype=torch.long, device=device)

    def add(self, rows: torch.Tensor, experts: torch.Tensor) -> None:
        """rows: (n, in) any float dtype; experts: (n,) long, the expert of each row."""
        self.add_pieces([rows], [experts])

    def add_pieces(self, rows: Sequence[torch.Tensor], experts: Sequence[torch.Tensor]) -> None:
        """rows[k]: (n_k, in) any float dtype; experts[k]: (n_k,) long → the same sums as adding each
        piece, in one batched XᵀX over all of them: each row is written once, straight into its expert's
        slot of a padded (U, max count, in) tensor, without first concatenating the pieces."""
        device = self.sq_norms.device
        ids = torch.cat([e.to(device) for e in experts])  # (n,) all pieces in order
        if ids.numel() == 0:
            return
        pieces = [r.to(device, torch.float32) for r in rows]  # (n_k, in) each
        if self.zero_rows:
            self.tokens.index_add_(0, ids, torch.cat([piece.any(1) for piece in pieces]).long())
        else:
            self.tokens += torch.bincount(ids, minlength=self.tokens.numel())
        if self.gram is None:
            for piece, piece_ids in zip(pieces, experts, strict=True):
                self.sq_norms.index_add_(0, piece_ids.to(device), piece.square())
            return
        present, slot, counts = torch.unique(ids, return_inverse=True, return_counts=True)  # (U,), (n,), (U,)
        # Row i's position among the rows of its expert, in order: from a stable sort of the ids.
        order = torch.argsort(ids, stable=True)  # (n,)
        starts = torch.cumsum(counts, 0) - counts  # (U,) first sorted row of each expert
        position = torch.empty_like(order)
        position[order] = torch.arange(ids.numel(), device=device) - starts[slot[order]]  # (n,)
        # Experts in buckets of similar row counts, each bucket padded to its largest count and multiplied
        # in one batched XᵀX: one padding for all wasted 37% of the rows on a random-router Qwen3-MoE
        # block (counts 67 to 204, mean 128). The buckets lie one after the other in one zeroed buffer
        # into which each piece's rows are copied once, straight to their padded slot.
        experts_n = present.numel()
        size = -(-experts_n // _BUCKETS)  # experts per bucket
        by_count = torch.argsort(counts)  # (U,) experts from the fewest rows to the most
        rank = torch.empty_like(by_count)
        rank[by_count] = torch.arange(experts_n, device=device)  # (U,)
        members = [by_count[i : i + size] for i in range(0, experts_n, size)]  # experts of each bucket
        caps = [int(counts[m].max()) for m in members]  # the padded row count of each bucket
        bases = [0]
        for m, cap in zip(members, caps, strict=True):
            bases.append(bases[-1] + m.numel() * cap)
        cap_of = torch.tensor(caps, device=device)[rank // size]  # (U,)
        base_of = torch.tensor(bases[:-1], device=device)[rank // size]  # (U,)
        first = base_of + (rank % size) * cap_of  # (U,) buffer row of each expert's first row
        destination = first[slot] + position  # (n,)
        buffer = pieces[0].new_empty(bases[-1], self.in_features)  # (Σ U_b·C_b, in)
        padding = torch.ones(bases[-1], dtype=torch.bool, device=device)
        padding[destination] = False
        buffer[padding] = 0  # the padded rows only: the others are written below
        begin = 0
        for piece in pieces:  # one copy per piece (a forward call), never per row or expert
            buffer.index_copy_(0, destination[begin : begin + piece.shape[0]], piece)
            begin += piece.shape[0]
        for m, cap, base in zip(members, caps, bases, strict=False):
            padded = buffer[base : base + m.numel() * cap].view(m.numel(), cap, self.in_features)  # (U_b, C_b, in)
            increment = padded.transpose(1, 2) @ padded  # (U_b, in, in)
            self.gram.index_add_(0, present[m], increment)
            # Σ_t X_tj² is XᵀX's diagonal: read it there rather than square the rows a second time.
            self.sq_norms.index_add_(0, present[m], increment.diagonal(dim1=1, dim2=2))

    def select(
        self, experts: torch.Tensor, fallback: ExpertStats | None = None, use: torch.Tensor | None = None
    ) -> ExpertStats:
        """experts: (L,) long → the statistics of those experts as a new `ExpertStats` of L (copies), each
        taken from `fallback` instead where `use` (L,) bool is set (an expert whose routed tokens were too
        few takes every-token statistics)."""
        picked = ExpertStats.__new__(ExpertStats)
        picked.in_features = self.in_features
        picked.zero_rows = self.zero_rows
        picked.tokens = self.tokens[experts]
        picked.sq_norms = self.sq_norms[experts]
        picked.gram = self.gram[experts] if self.gram is not None else None
        if fallback is not None and use is not None and bool(use.any()):
            picked.sq_norms = torch.where(use[:, None], fallback.sq_norms[experts], picked.sq_norms)
            if picked.gram is not None:
                picked.gram = torch.where(use[:, None, None], fallback.require_gram()[experts], picked.gram)
        return picked


class RowBuffer:
    """Holds routed rows until `budget` elements are held, then adds them to `target` in one
    `ExpertStats.add`.

    A block's forward reports an expert stack's rows one call at a time (one per calibration sample), and
    at small widths each `add` (sort, pad, one batched XᵀX) costs more in overhead than in arithmetic:
    one add per sample made the routed statistics of a tiny Qwen3-MoE block cost as much as its forward
    (docs/measurements/benchmarks-moe.md). The rows are held as the forward made them, not copied: a
    matmul's input is saved for its backward, so a trainable forward never writes into it afterwards.
    """

    def __init__(self, target: ExpertStats, budget: int = 1 << 22) -> None:
        self.target = target
        self.budget = budget
        self._rows: list[torch.Tensor] = []
        self._experts: list[torch.Tensor] = []
        self._held = 0

    def add(self, rows: torch.Tensor, experts: torch.Tensor) -> None:
        """rows: (n, in); experts: (n,) long, as `ExpertStats.add`."""
        self._rows.append(rows)
        self._experts.append(experts)
        self._held += rows.numel()
        if self._held >= self.budget:
            self.flush()

    def flush(self) -> ExpertStats:
        """Add what is held to the target, and return the target."""
        if self._rows:
            rows, experts = self._rows, self._experts
            self._rows, self._experts, self._held = [], [], 0
            self.target.add_pieces(rows, experts)
        return self.target

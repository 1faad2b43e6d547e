"""SparseGPT (Frantar & Alistarh 2023) with transposable masks (paper Section 4).

OBS with lazy batch updates as in IST-DASLab/sparsegpt `fasterprune`: H = XᵀX damped by 1% of its mean
diagonal, the upper Cholesky factor of H⁻¹, columns processed left to right in blocks of 128. At every
group of M columns the mask of that slab (all rows × M columns, i.e. a column of M×M tiles) is chosen
from the OBS keep-score W²/[H⁻¹]_jj² — by the transposable solver for transposable patterns, by a row-wise
top-n otherwise — and the pruning error of each column is propagated to the columns right of it.

What the solves batch: SparseGPT "traverses W left-to-right in groups of M columns, pruning each group
according to OBS scores, and updating W^G and remaining columns accordingly" (paper Section 4). The
scores of slab k are the weights after the updates from the pruning errors of every column left of it,
in the same rows, so the tiles of slab k depend on the masks of slab k−1, and one slab's tiles are all
that is independent at any point: all its rows, and all the matrices of a stack, go to the solver in one
call. Solving two slabs in one call would score the second on weights without the first's updates, a
different mask. So a matrix takes in/M calls; what each costs on a GPU is the solver's launches and host
syncs (solver/rounding.py), about 16 ms a slab on the H100 whatever its size, which is why `auto` sends a
solve of few tiles from CUDA to the host's exact `flow` (solver/auto.py, `HOST_SCORES`): these slabs are
such solves. What can share those calls is other rows: each row's updates read only its own errors and
the shared H⁻¹, so the linears that read one input (q/k/v, gate/up) come stacked along `out` (`parts`,
engine._prune_stacked) and take one factorization and in/M calls for all of them, with the masks each
gets alone: on SmolLM2 2 blocks at 16:32, 204 calls and 8 factorizations instead of 312 and 14
(docs/measurements/benchmarks-e2e.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tsenor_cli.pruning.methods.method import MethodOptions, PrunerSpec, option

if TYPE_CHECKING:
    import torch

    from tsenor_cli.pruning.block.memory import MethodCost
    from tsenor_cli.pruning.methods.masks import SolveTally
    from tsenor_cli.pruning.methods.stats import Statistics
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig, PruneOutcome

# The lazy batch of columns updated at once (fasterprune's blocksize).
LAZY_COLUMNS = 128


@dataclass(frozen=True)
class SparseGPTOptions(MethodOptions):
    percdamp: float = option(0.01, "Hessian dampening as a share of mean diag(H) (SparseGPT uses 1%).", minimum=0)
    blocksize: int = option(LAZY_COLUMNS, "Lazy-update block width in columns (rounded to a multiple of M).", minimum=1)


def _obs_block(
    w1: torch.Tensor, hinv1: torch.Tensor, cfg: MatrixPruneConfig, tally: SolveTally, parts: Sequence[int] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One lazy-update block of columns: w1 (..., out, b) its weights (updated in place), hinv1 (..., b, b)
    its part of H⁻¹ → (the pruned weights, each column's OBS error, the mask of pruned weights), each
    (..., out, b). Each M-column slab's mask is chosen as the block reaches it, on the updated weights."""
    import torch

    from tsenor_cli.pruning.methods.masks import choose_mask, matrix_scope

    pattern = cfg.pattern
    grouped = pattern.kind in ("transposable", "nm")
    q1 = torch.zeros_like(w1)
    err1 = torch.zeros_like(w1)
    d = hinv1.diagonal(dim1=-2, dim2=-1)  # (..., b)
    prune1 = torch.zeros_like(w1, dtype=torch.bool)
    if pattern.kind == "unstructured":
        scores = w1.square() / d.square()[..., None, :]  # (..., out, b)
        keep = choose_mask(scores, pattern, cfg.solver, unstructured_scope=matrix_scope(parts))
        prune1 = ~keep.mask
    # OBS is sequential over columns: each column's update depends on the errors of those left of it,
    # so this loop cannot be vectorized away; what the solves batch is in the module docstring.
    for i in range(w1.shape[-1]):
        if grouped and i % pattern.m == 0:
            slab = w1[..., i : i + pattern.m].square() / d[..., None, i : i + pattern.m].square()  # (..., out, M)
            choice = choose_mask(slab, pattern, cfg.solver)
            prune1[..., i : i + pattern.m] = ~choice.mask
            if choice.result is not None:
                tally.add_result(choice.result)
        col = w1[..., i]  # (..., out)
        q = torch.where(prune1[..., i], torch.zeros_like(col), col)
        q1[..., i] = q
        err = (col - q) / d[..., i, None]  # (..., out)
        w1[..., i:] -= err[..., None] * hinv1[..., i, None, i:]
        err1[..., i] = err
    return q1, err1, prune1


def prune_batch(
    weights: torch.Tensor, stats: Statistics | None, cfg: MatrixPruneConfig, *, parts: Sequence[int] | None = None
) -> list[PruneOutcome]:
    """weights: (..., out, in), one matrix or a stack with Gram matrices (..., in, in) → one
    `PruneOutcome` per matrix with OBS-updated weights under the pattern.

    A stack runs as one: every column step updates all its matrices at once, each with its own H⁻¹,
    and each M-column slab of all of them goes to the solver in one call (`choose_mask`); no update
    crosses from one matrix to another. parts: row counts of linears stacked along `out` that share
    these statistics (`PrunerSpec.prune_rows`): OBS updates each row with the shared H⁻¹ alone, so one
    factorization and one solve per slab serve them all, and each gets its own outcome.
    """
    import torch

    from tsenor_cli.phases import phase
    from tsenor_cli.pruning.methods.linalg import inverse_cholesky_upper
    from tsenor_cli.pruning.methods.masks import SolveTally
    from tsenor_cli.pruning.methods.stats import damped_gram
    from tsenor_cli.pruning.methods.types import split_outcomes

    if stats is None:
        raise ValueError("sparsegpt needs the Gram matrix of the layer inputs; collect statistics with gram=True")
    pattern, opts = cfg.pattern, cfg.method_options(SparseGPTOptions)
    gram = stats.require_gram().to(weights.device)  # (..., in, in)
    w = weights.to(torch.float32).clone()  # (..., out, in)
    cols = w.shape[-1]
    # Inputs that never fire: their weights cannot matter.
    w.masked_fill_((gram.diagonal(dim1=-2, dim2=-1) == 0).unsqueeze(-2), 0.0)
    with phase("factorize"):
        hinv = inverse_cholesky_upper(damped_gram(gram, opts.percdamp))  # (..., in, in) upper
    blocksize = opts.blocksize
    if pattern.kind in ("transposable", "nm") and blocksize % pattern.m:
        # The lazy-update block must hold whole groups of M columns.
        blocksize = max(pattern.m, (blocksize // pattern.m) * pattern.m)
    pruned = torch.zeros_like(w, dtype=torch.bool)  # (..., out, in) True = set to zero
    tally = SolveTally(w[..., 0, 0].numel(), w.device, parts)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        q1, err1, prune1 = _obs_block(w[..., i1:i2].clone(), hinv[..., i1:i2, i1:i2], cfg, tally, parts)
        w[..., i1:i2] = q1
        w[..., i2:] -= err1 @ hinv[..., i1:i2, i2:]
        pruned[..., i1:i2] = prune1
    mask = ~pruned
    return split_outcomes(w * mask, mask, tally.infos(), parts=parts)


def workspace(out_features: int, in_features: int, cost: MethodCost) -> int:
    """Peak bytes while one (out, in) matrix is pruned, read from `prune_batch` (F = 4·out·in, G = 4·in²,
    B = out·in; `memory.matrix_workspace`): the larger of
    - factorize: the dense copy, its working copy, damped H, its Cholesky factor, H⁻¹ and its upper
      factor (on CUDA one more: cholesky_inverse solves against an identity): 2F + 4G (+G);
    - the column loop: both copies, Hinv, the pruned and kept masks, the result, the lazy batch's
      w1/q1/err1 (rebound while the old ones live: 4 of them), its mask, the column update and the batch
      update temporaries (F): 4F + G + 2B + 17·out·b (b = `LAZY_COLUMNS`) + the solver on one slab (M
      columns, or the lazy batch for unstructured sparsity)."""
    f, b, g = 4 * out_features * in_features, out_features * in_features, 4 * in_features * in_features
    factorize = 2 * f + (5 if cost.cuda else 4) * g
    batch = min(LAZY_COLUMNS, in_features)
    columns = cost.group or LAZY_COLUMNS
    slab = int(cost.solver_copies * 4 * out_features * min(columns, in_features)) + 32 * out_features
    return max(factorize, 4 * f + g + 2 * b + 17 * out_features * batch + slab)


METHOD = PrunerSpec(
    "sparsegpt",
    "OBS with lazy updates (SparseGPT)",
    prune_batch,
    needs_data=True,
    options=SparseGPTOptions,
    workspace=workspace,
    fuses_rows=True,
)


def prune(weight: torch.Tensor, stats: Statistics | None, cfg: MatrixPruneConfig) -> PruneOutcome:
    """weight: (out, in), one matrix → its `PruneOutcome` (`PrunerSpec.prune`)."""
    return METHOD.prune(weight, stats, cfg)

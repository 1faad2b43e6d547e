"""ALPS (Meng et al. 2024) with transposable masks: the ADMM of Proposition 1 (paper Section 4, App. A.1).

Following mazumder-lab/ALPS: H = XᵀX (float32) damped by 1% of its mean diagonal (the λ of eq. (5)) and
scaled to unit diagonal, Ĥ = D⁻¹HD⁻¹ with D = diag(H)^½; the weights become B = W·D (so B² is the Wanda
score). One eigendecomposition Ĥ = QΛQᵀ makes (Ĥ + ρI)⁻¹ = Q(Λ + ρI)⁻¹Qᵀ cheap whenever ρ changes.
In the (out, in) orientation of nn.Linear, with Y = B̂Ĥ, the updates of eq. (7) read

    W ← (Y − V + ρD)(Ĥ + ρI)⁻¹,   S ← mask of (W + V/ρ)²,   D ← (W + V/ρ) ⊙ S,   V ← V + ρ(W − D).

The S-step is the transposable solver, warm-started from the previous iteration's result, with
Assumption 1's safeguard applied per tile (keep the previous tile's mask where the new one scores lower).
ρ starts at 0.1 and, every 3 iterations, grows by 1.3 / 1.2 / 1.1 when the share r of kept entries whose
support flipped is > 0.1 / > 0.005 / otherwise — an increasing geometric sequence as Assumption 1 needs.
The loop stops after iteration 30 once r < 0.0003 (at most 300 iterations). The final support is the
mask of the last W, on which ~10 conjugate-gradient steps minimize the reconstruction error.
"""

from __future__ import annotations

import torch

from tsenor_cli.progress import bar, logger
from tsenor_cli.pruning.linalg import symmetric_eigh
from tsenor_cli.pruning.masks import choose_mask, keep_better_tiles
from tsenor_cli.pruning.phases import phase
from tsenor_cli.pruning.stats import InputStats, damped_gram
from tsenor_cli.pruning.types import LayerPruneConfig, MaskSolveInfo, PruneOutcome
from tsenor_cli.solver import SolveResult, resolve_method

NEEDS_GRAM = True
RHO_MAX = 1e6


def inner_solver_options(solver: str, sweeps: int, iterations: int, device: torch.device, m: int) -> dict[str, object]:
    """Options of the intermediate D-step projections, by the solver that runs; the final projection
    uses the defaults.

    The ADMM only needs each intermediate mask to be good and no worse than the previous one per tile
    (Assumption 1, enforced by the safeguard), not optimal or certified tightly. Where `tsenor` runs
    (asked for, or `auto` on CUDA) a few cycle-cancelling sweeps from the warm-started mask and the
    bound at the potentials suffice (docs/design/solver.md measures the effect). `flow` (`auto` on the CPU)
    solves exactly and a warm solve costs about as little as the cheap one, so every projection is
    exact there. Other solvers run with their defaults.
    """
    if resolve_method(solver, device, m).name == "tsenor":
        return {"sweeps": sweeps, "bound": "potentials", "iterations": iterations}
    return {}


def _project(
    z: torch.Tensor,
    cfg: LayerPruneConfig,
    prev: SolveResult | None,
    prev_mask: torch.Tensor | None,
    seconds: list[float],
    options: dict[str, object] | None = None,
) -> tuple[torch.Tensor, SolveResult | None, torch.Tensor | None, int]:
    """z: (out, in) → (mask (out, in) bool of the pattern maximizing Σ S⊙z², solver result, (B,) per-tile
    objective of the returned mask for transposable patterns, number of safeguarded tiles)."""
    scores = z.square()
    choice = choose_mask(
        scores, cfg.pattern, cfg.solver, init=prev, unstructured_scope="matrix", solver_options=options
    )
    if choice.result is None:
        return choice.mask, None, None, 0
    seconds.append(choice.result.seconds)
    if prev_mask is None:
        return choice.mask, choice.result, choice.result.block_objective, 0
    mask, block_obj, kept = keep_better_tiles(scores, choice.result, prev_mask, cfg.pattern.m)
    return mask, choice.result, block_obj, kept


def conjugate_gradient(
    h: torch.Tensor,
    rhs: torch.Tensor,
    support: torch.Tensor,
    x0: torch.Tensor,
    iters: int,
    rtol: float = 1e-4,
) -> torch.Tensor:
    """Minimize ½ x Ĥ xᵀ − rhs·xᵀ for every row x of X on the fixed support (ALPS's `cg_batch`).

    h: (in, in) SPD; rhs, x0: (out, in); support: (out, in) bool → X (out, in) zero outside the support.
    Each row is an independent system x Ĥ = rhs restricted to its support; residuals are masked.
    """
    s = support.to(h.dtype)
    x = x0 * s
    r = (rhs - x @ h) * s  # (out, in)
    p = r.clone()
    rz = r.square().sum(1)  # (out,)
    stop = rtol * rhs.norm(dim=1)  # (out,)
    for _ in range(iters):
        hp = p @ h  # (out, in)
        denom = (p * hp).sum(1)
        alpha = torch.where(denom > 0, rz / denom.clamp_min(torch.finfo(h.dtype).tiny), torch.zeros_like(rz))
        x = x + alpha[:, None] * p
        r = (r - alpha[:, None] * hp) * s
        rz_new = r.square().sum(1)
        if bool((rz_new.sqrt() <= stop).all()):
            break
        beta = torch.where(rz > 0, rz_new / rz.clamp_min(torch.finfo(h.dtype).tiny), torch.zeros_like(rz))
        p = r + beta[:, None] * p
        rz = rz_new
    return x * s


def prune(
    weight: torch.Tensor,
    stats: InputStats | None,
    cfg: LayerPruneConfig,
) -> PruneOutcome:
    """weight: (out, in) → `PruneOutcome` from ADMM + CG; `iterations` counts ADMM steps.

    The ADMM loop shows a bar on a terminal and logs its ρ/support-change lines at DEBUG (progress.py).
    """
    if stats is None:
        raise ValueError("alps needs the Gram matrix of the layer inputs; collect statistics with gram=True")
    with phase("factorize"):
        gram = stats.require_gram().to(weight.device)
        h = damped_gram(gram, cfg.percdamp)  # (in, in)
        scale = h.diagonal().sqrt()  # (in,) D
        h_hat = h / scale[:, None] / scale[None, :]  # (in, in) unit diagonal
        evals, evecs = symmetric_eigh(h_hat.double())  # Λ (in,), Q (in, in); thread-count independent

    def inverse(rho: float) -> torch.Tensor:
        """(Ĥ + ρI)⁻¹ (in, in) float32 from the one eigendecomposition."""
        return ((evecs / (evals + rho)[None, :]) @ evecs.T).to(torch.float32)

    b_hat = weight.to(torch.float32) * scale[None, :]  # (out, in) normalized weights
    y = b_hat @ h_hat  # (out, in)
    seconds: list[float] = []
    mask, result, _, _ = _project(b_hat, cfg, None, None, seconds)
    d = b_hat * mask
    v = torch.zeros_like(b_hat)
    kept_total = max(int(mask.sum()), 1)
    rho = cfg.alps_rho0
    inv = inverse(rho)
    checked_mask = mask
    safeguarded = 0
    w_t = b_hat
    iterations = 0
    inner = inner_solver_options(
        cfg.solver, cfg.alps_inner_sweeps, cfg.alps_inner_iterations, b_hat.device, cfg.pattern.m
    )
    steps = bar(total=cfg.alps_max_iter, desc="ADMM", unit="it", leave=False)
    for t in range(cfg.alps_max_iter):
        iterations = t + 1
        steps.update()
        w_t = (y - v + rho * d) @ inv  # Ĥ + ρI is symmetric, so right-multiplying solves the row systems
        z = w_t + v / rho
        mask, result, _, kept = _project(z, cfg, result, mask, seconds, inner)
        safeguarded += kept
        d = z * mask
        v = v + rho * (w_t - d)
        if (t + 1) % cfg.alps_update_iter == 0:
            change = float((mask ^ checked_mask).sum()) / kept_total
            checked_mask = mask
            rho = min(rho * (1.3 if change > 0.1 else 1.2 if change > 0.005 else 1.1), RHO_MAX)
            inv = inverse(rho)
            steps.set_postfix_str(f"rho {rho:.3g}, support change {change:.2e}", refresh=False)
            logger.debug("ADMM iter %d: rho %.3g, support change %.2e", t + 1, rho, change)
            if t >= cfg.alps_switch_iter and change < cfg.alps_stop_change:
                break

    steps.close()
    final_mask, final_result, block_obj, kept = _project(w_t, cfg, result, mask, seconds)
    safeguarded += kept
    with phase("cg"):
        refined = conjugate_gradient(h_hat, y, final_mask, w_t * final_mask, cfg.alps_cg_iters)
    new_weight = refined / scale[None, :]
    info = None
    if final_result is not None and block_obj is not None:
        obj = float(block_obj.sum())
        ub = float(final_result.block_upper_bound.sum())
        gap = max((ub - obj) / ub, 0.0) if ub > 0 else 0.0
        info = MaskSolveInfo(objective=obj, upper_bound=ub, gap=gap, seconds=float(sum(seconds)), calls=len(seconds))
    return PruneOutcome(
        weight=new_weight * final_mask,
        mask=final_mask,
        solve=info,
        iterations=iterations,
        safeguard_tiles=safeguarded,
    )

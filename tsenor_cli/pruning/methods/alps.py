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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from tsenor_cli.progress import bar, logger
from tsenor_cli.pruning.methods.method import MethodOptions, PrunerSpec, option

if TYPE_CHECKING:
    import torch

    from tsenor_cli.pruning.block.memory import MethodCost
    from tsenor_cli.pruning.methods.masks import SolveTally
    from tsenor_cli.pruning.methods.stats import Statistics
    from tsenor_cli.pruning.methods.types import MaskSolveInfo, MatrixPruneConfig, PruneOutcome
    from tsenor_cli.solver import SolveResult

RHO_MAX = 1e6
# cuSOLVER's syevd (the eigendecomposition ALPS runs on CUDA) holds more than LAPACK's 1+6n+2n² doubles:
# the first H100 run (docs/measurements/benchmarks-e2e.md, its JSON of the whole 1B and of the 8B shape,
# torch.cuda.max_memory_allocated of the factorize phase) held 15.1·4n² + 4·out·n bytes besides the
# block and activations at both n = 8192 (LLaMA-3.2-1B's down_proj) and n = 14336 (8B's): 8n² bytes
# more than the 11·4n² + 4·out·n counted here for LAPACK, so its workspace is taken as 4n² doubles.
EIGH_CUDA_SQUARES = 4


@dataclass(frozen=True)
class ALPSOptions(MethodOptions):
    """The ALPS ADMM schedule (mazumder-lab/ALPS). inner_sweeps, inner_iterations: the `tsenor`
    cycle-cancelling sweeps and Sinkhorn iterations of the intermediate projections where `tsenor` runs
    (`auto` on CUDA); with `flow` (`auto` on the CPU) every projection is exact (`inner_solver_options`)."""

    percdamp: float = option(0.01, "Hessian dampening as a share of mean diag(H) (ALPS uses 1%).", minimum=0)
    rho0: float = option(0.1, "Initial ADMM penalty ρ₀.", minimum=0)
    max_iter: int = option(300, "ADMM iteration cap.", minimum=1)
    update_iter: int = option(3, "ρ-update period in iterations.", minimum=1)
    switch_iter: int = option(30, "Earliest iteration at which a converged support stops.", minimum=0)
    stop_change: float = option(3e-4, "Stop threshold on the support change between ρ updates.", minimum=0)
    cg_iters: int = option(10, "Conjugate-gradient steps refining the weights on the final mask.", minimum=0)
    inner_sweeps: int = option(2, "Cycle-cancelling sweeps of intermediate tsenor projections.", minimum=0)
    inner_iterations: int = option(0, "Sinkhorn iterations of intermediate tsenor projections.", minimum=0)


def inner_solver_options(
    solver: str, sweeps: int, iterations: int, device: torch.device, m: int, scores: int | None = None
) -> dict[str, object]:
    """Options of the intermediate D-step projections, by the solver that runs; the final projection
    uses the defaults.

    The ADMM only needs each intermediate mask to be good and no worse than the previous one per tile
    (Assumption 1, enforced by the safeguard), not optimal or certified tightly. Where `tsenor` runs
    (asked for, or `auto` on CUDA) a few cycle-cancelling sweeps from the warm-started mask and the
    bound at the potentials suffice (docs/design/solver.md measures the effect). `flow` (`auto` on the CPU)
    solves exactly and a warm solve costs about as little as the cheap one, so every projection is
    exact there (and `auto` on CUDA for a solve of few tiles: `scores`, the number of scores each
    projection solves, solver/auto.py). Other solvers run with their defaults.
    """
    from tsenor_cli.solver import resolve_method

    if resolve_method(solver, device, m, scores).name == "tsenor":
        return {"sweeps": sweeps, "bound": "potentials", "iterations": iterations}
    return {}


def _project(
    z: torch.Tensor,
    cfg: MatrixPruneConfig,
    prev: SolveResult | None,
    prev_mask: torch.Tensor | None,
    tally: SolveTally,
    options: dict[str, object] | None = None,
) -> tuple[torch.Tensor, SolveResult | None, torch.Tensor | None, torch.Tensor]:
    """z: (..., out, in) → (mask (..., out, in) bool of the pattern maximizing Σ S⊙z² per matrix, the
    solver's result on the stack flattened to (L·out, in), (B,) per-tile objective of the returned mask
    for transposable patterns, (L,) long tiles safeguarded per matrix)."""
    import torch

    from tsenor_cli.pruning.methods.masks import choose_mask, keep_better_tiles

    scores = z.square()
    choice = choose_mask(
        scores, cfg.pattern, cfg.solver, init=prev, unstructured_scope="matrix", solver_options=options
    )
    none = torch.zeros(tally.matrices, dtype=torch.long, device=z.device)
    if choice.result is None:
        return choice.mask, None, None, none
    if prev_mask is None:
        tally.add_result(choice.result)
        return choice.mask, choice.result, choice.result.block_objective, none
    cols = z.shape[-1]
    mask, block_obj, kept = keep_better_tiles(
        scores.reshape(-1, cols), choice.result, prev_mask.reshape(-1, cols), cfg.pattern.m
    )
    tally.add(block_obj, choice.result.block_upper_bound, choice.result.seconds)
    return mask.view(z.shape), choice.result, block_obj, kept.view(tally.matrices, -1).sum(1)


def conjugate_gradient(
    h: torch.Tensor,
    rhs: torch.Tensor,
    support: torch.Tensor,
    x0: torch.Tensor,
    iters: int,
    rtol: float = 1e-4,
) -> torch.Tensor:
    """Minimize ½ x Ĥ xᵀ − rhs·xᵀ for every row x of X on the fixed support (ALPS's `cg_batch`).

    h: (..., in, in) SPD; rhs, x0: (..., out, in); support: (..., out, in) bool → X (..., out, in) zero
    outside the support, for one matrix or a stack (each with its own Ĥ). Each row is an independent
    system x Ĥ = rhs restricted to its support; residuals are masked. A matrix stops once all its rows
    have converged (its steps become zero), as it would alone.
    """
    import torch

    s = support.to(h.dtype)
    x = x0 * s
    r = (rhs - x @ h) * s  # (..., out, in)
    p = r.clone()
    rz = r.square().sum(-1)  # (..., out)
    stop = rtol * rhs.norm(dim=-1)  # (..., out)
    running = torch.ones(rz.shape[:-1], dtype=torch.bool, device=rz.device)  # (...,) per matrix
    for _ in range(iters):
        hp = p @ h  # (..., out, in)
        denom = (p * hp).sum(-1)
        alpha = torch.where(denom > 0, rz / denom.clamp_min(torch.finfo(h.dtype).tiny), torch.zeros_like(rz))
        alpha = torch.where(running[..., None], alpha, torch.zeros_like(alpha))
        x = x + alpha[..., None] * p
        r = (r - alpha[..., None] * hp) * s
        rz_new = r.square().sum(-1)
        running = running & ~(rz_new.sqrt() <= stop).all(-1)
        if not bool(running.any()):
            break
        beta = torch.where(rz > 0, rz_new / rz.clamp_min(torch.finfo(h.dtype).tiny), torch.zeros_like(rz))
        p = r + beta[..., None] * p
        rz = rz_new
    return x * s


def _freeze(running: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """running: (...,) bool per matrix; new, old: (..., out, in) → new where the matrix still runs."""
    import torch

    return torch.where(running[..., None, None], new, old)


def _grow_rho(rho: torch.Tensor, change: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
    """rho, change: (...,) float64, running: (...,) bool → the next ρ of each running matrix: ×1.1, ×1.2 from a
    support change above 0.5%, ×1.3 above 10%, at most RHO_MAX; stopped matrices keep theirs."""
    import torch

    factor = torch.full_like(rho, 1.1)  # float64, as Python's float arithmetic was
    factor[change > 0.005] = 1.2
    factor[change > 0.1] = 1.3
    return torch.where(running, (rho * factor).clamp_max(RHO_MAX), rho)


def _inverse(evecs: torch.Tensor, evals: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """Q (..., in, in), Λ (..., in) of Ĥ, rho: (...,) float64 → (Ĥ + ρI)⁻¹ (..., in, in) float32, from the
    one eigendecomposition."""
    import torch

    return ((evecs / (evals + rho[..., None])[..., None, :]) @ evecs.mT).to(torch.float32)


def _show_rho(steps: Any, t: int, rho: torch.Tensor, change: torch.Tensor) -> None:
    """The ADMM bar's ρ and support change after iteration t, and the DEBUG line of each matrix's."""
    steps.set_postfix_str(f"rho {float(rho.max()):.3g}, support change {float(change.max()):.2e}", refresh=False)
    logger.debug("ADMM iter %d: rho %s, support change %s", t + 1, rho.tolist(), change.tolist())


def _final_infos(
    tally: SolveTally, final_result: SolveResult | None, block_obj: torch.Tensor | None
) -> list[MaskSolveInfo] | None:
    """One certificate per matrix, that of the final mask alone; seconds and calls count every projection."""
    from tsenor_cli.pruning.methods.masks import solve_info

    if final_result is None or block_obj is None:
        return None
    obj = tally.per_matrix(block_obj)
    ub = tally.per_matrix(final_result.block_upper_bound)
    return [
        solve_info([float(o)], [float(u)], [tally.seconds / tally.matrices], calls=tally.calls)
        for o, u in zip(obj.tolist(), ub.tolist(), strict=True)
    ]


class _Problem(NamedTuple):
    """The normalized problem ADMM solves: D (..., in) the damped Gram diagonal's square roots, Ĥ (...,
    in, in) with unit diagonal and its eigenvalues Λ (..., in) and vectors Q (float64), B̂ = W·D and
    Y = B̂Ĥ (..., out, in)."""

    scale: torch.Tensor
    h_hat: torch.Tensor
    evals: torch.Tensor
    evecs: torch.Tensor
    b_hat: torch.Tensor
    y: torch.Tensor


def _normalize(weights: torch.Tensor, stats: Statistics, percdamp: float) -> _Problem:
    """`weights` and their Gram matrices as ADMM reads them, with Ĥ's one eigendecomposition."""
    import torch

    from tsenor_cli.phases import phase
    from tsenor_cli.pruning.methods.linalg import symmetric_eigh
    from tsenor_cli.pruning.methods.stats import damped_gram

    with phase("factorize"):
        gram = stats.require_gram().to(weights.device)
        h = damped_gram(gram, percdamp)  # (..., in, in)
        scale = h.diagonal(dim1=-2, dim2=-1).sqrt()  # (..., in) D
        h_hat = h / scale[..., :, None] / scale[..., None, :]  # (..., in, in) unit diagonal
        evals, evecs = symmetric_eigh(h_hat.double())  # Λ (..., in), Q (..., in, in); thread-count independent
    b_hat = weights.to(torch.float32) * scale[..., None, :]  # (..., out, in) normalized weights
    return _Problem(scale, h_hat, evals, evecs, b_hat, b_hat @ h_hat)


class _Iterate(NamedTuple):
    """Where ADMM stopped: the last W, its mask and the solver's result (the warm start of the final
    projection), each matrix's steps (...,) and safeguarded tiles (one count per matrix)."""

    w: torch.Tensor
    mask: torch.Tensor
    result: SolveResult | None
    iterations: torch.Tensor
    safeguarded: torch.Tensor


def _admm(problem: _Problem, cfg: MatrixPruneConfig, tally: SolveTally) -> _Iterate:
    """The ADMM of eq. (7) on every matrix of `problem` side by side, each with its own ρ schedule, frozen
    once its support stops changing."""
    import torch

    opts = cfg.method_options(ALPSOptions)
    b_hat, y, device = problem.b_hat, problem.y, problem.b_hat.device
    lead = b_hat.shape[:-2]
    mask, result, _, _ = _project(b_hat, cfg, None, None, tally)
    d, v = b_hat * mask, torch.zeros_like(b_hat)
    kept_total = mask.sum((-2, -1)).clamp_min(1).double()  # (...,)
    rho = torch.full(lead, opts.rho0, dtype=torch.float64, device=device)  # (...,)
    inv = _inverse(problem.evecs, problem.evals, rho)
    checked_mask = mask
    safeguarded = torch.zeros(tally.matrices, dtype=torch.long, device=device)
    running = torch.ones(lead, dtype=torch.bool, device=device)  # (...,) matrices still iterating
    iterations = torch.zeros(lead, dtype=torch.long, device=device)
    w_t = b_hat
    inner = inner_solver_options(
        cfg.solver, opts.inner_sweeps, opts.inner_iterations, device, cfg.pattern.m, b_hat.numel()
    )
    steps = bar(total=opts.max_iter, desc="ADMM", unit="it", leave=False)
    for t in range(opts.max_iter):
        iterations += running.long()
        steps.update()
        rho_w = rho.to(torch.float32)[..., None, None]  # (..., 1, 1)
        # Ĥ + ρI is symmetric, so right-multiplying solves the row systems.
        w_t = _freeze(running, (y - v + rho_w * d) @ inv, w_t)
        z = w_t + v / rho_w
        new_mask, result, _, kept = _project(z, cfg, result, mask, tally, inner)
        safeguarded += kept * running.reshape(-1).long()
        mask = _freeze(running, new_mask, mask)
        d = _freeze(running, z * mask, d)
        v = _freeze(running, v + rho_w * (w_t - d), v)
        if (t + 1) % opts.update_iter == 0:
            change = (mask ^ checked_mask).sum((-2, -1)).double() / kept_total  # (...,)
            checked_mask = mask
            rho = _grow_rho(rho, change, running)
            inv = _inverse(problem.evecs, problem.evals, rho)
            _show_rho(steps, t, rho, change)
            if t >= opts.switch_iter:
                running = running & ~(change < opts.stop_change)
                if not bool(running.any()):
                    break
    steps.close()
    return _Iterate(w_t, mask, result, iterations, safeguarded)


def prune_batch(
    weights: torch.Tensor, stats: Statistics | None, cfg: MatrixPruneConfig, *, parts: Sequence[int] | None = None
) -> list[PruneOutcome]:
    """weights: (..., out, in), one matrix or a stack with Gram matrices (..., in, in) → one
    `PruneOutcome` per matrix from ADMM + CG; `iterations` counts each matrix's ADMM steps.

    A stack runs its ADMMs side by side: one batched eigendecomposition, every step's products batched,
    every projection one solver call for all matrices. Each matrix keeps its own ρ schedule and stops on
    its own support change; a stopped matrix is frozen (its state no longer changes) while the others
    run on. The ADMM loop shows a bar on a terminal and logs its ρ/support-change lines at DEBUG.
    parts: always None, ALPS does not prune linears stacked along their outputs (`PrunerSpec.fuses_rows`).
    """
    from tsenor_cli.phases import phase
    from tsenor_cli.pruning.methods.masks import SolveTally
    from tsenor_cli.pruning.methods.types import split_outcomes

    if stats is None or parts is not None:
        raise ValueError("alps needs each matrix's own Gram matrix (statistics with gram=True, no parts)")
    opts = cfg.method_options(ALPSOptions)
    problem = _normalize(weights, stats, opts.percdamp)
    tally = SolveTally(problem.b_hat[..., 0, 0].numel(), problem.b_hat.device)
    last = _admm(problem, cfg, tally)
    final_mask, final_result, block_obj, kept = _project(last.w, cfg, last.result, last.mask, tally)
    with phase("cg"):
        refined = conjugate_gradient(problem.h_hat, problem.y, final_mask, last.w * final_mask, opts.cg_iters)
    new_weight = refined / problem.scale[..., None, :]
    infos = _final_infos(tally, final_result, block_obj)
    iters, tiles = last.iterations.reshape(-1).tolist(), (last.safeguarded + kept).tolist()
    return split_outcomes(new_weight * final_mask, final_mask, infos, iterations=iters, safeguard_tiles=tiles)


def eigh_workspace(n: int, *, cuda: bool) -> int:
    """Bytes `torch.linalg.eigh` of an (n, n) float64 matrix holds beyond its input and its results:
    LAPACK dsyevd's work (1 + 6n + 2n² doubles) and iwork (3 + 5n ints), on CUDA cuSOLVER's
    (`EIGH_CUDA_SQUARES`)."""
    squares = EIGH_CUDA_SQUARES if cuda else 2
    return 8 * (1 + 6 * n + squares * n * n) + 4 * (3 + 5 * n)


def workspace(out_features: int, in_features: int, cost: MethodCost) -> int:
    """Peak bytes while one (out, in) matrix is pruned, read from `prune_batch` (F = 4·out·in, G = 4·in²,
    B = out·in, S the solver's; `memory.matrix_workspace`): the largest of
    - factorize: the dense copy, damped H, Ĥ, Ĥ in float64, its eigenvectors and the eigendecomposition's
      workspace (`eigh_workspace`): F + 6G + W;
    - the ADMM: H, Ĥ, Q (2G), (Ĥ+ρI)⁻¹ and the state (dense, B̂, Y, D, V, W, Z, the last solve's tiles;
      three masks): at a ρ change the new inverse's two float64 temporaries (+4G): 9G + 8F + 3B; at a
      projection the scores, the solver and the safeguard's per-tile copies: 5G + 10F + 3B + S;
    - the CG: 5G + 16F + 3B."""
    f, b, g = 4 * out_features * in_features, out_features * in_features, 4 * in_features * in_features
    factorize = f + 6 * g + eigh_workspace(in_features, cuda=cost.cuda) + 32 * in_features
    solver = cost.solver(out_features, in_features)
    return max(factorize, 9 * g + 8 * f + 3 * b, 5 * g + 10 * f + 3 * b + solver, 5 * g + 16 * f + 3 * b)


METHOD = PrunerSpec(
    "alps",
    "ADMM + conjugate gradient (ALPS, Proposition 1)",
    prune_batch,
    needs_data=True,
    options=ALPSOptions,
    workspace=workspace,
    iterative=True,
)


def prune(weight: torch.Tensor, stats: Statistics | None, cfg: MatrixPruneConfig) -> PruneOutcome:
    """weight: (out, in), one matrix → its `PruneOutcome` (`PrunerSpec.prune`)."""
    return METHOD.prune(weight, stats, cfg)

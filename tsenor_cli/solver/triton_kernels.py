"""Fused Triton kernels for `tsenor` on CUDA (the jitted code is in `_triton_jit.py`).

One program owns one M×M tile and keeps it in registers, so each step is one launch that reads the
scores once, instead of the torch path's several launches per iteration, each streaming the whole
(B, M, M) batch (the cost on a GPU; docs/measurements/benchmarks-cuda.md):

- `capped_sinkhorn_fused`: Algorithm 1 in potential form, every stage and iteration in one launch;
  the semantics of `tsenor.capped_sinkhorn` with one tile per chunk (each tile stops on its own
  marginal violation).
- `cycle_search_fused`: the cycle cancelling of `tsenor.cycle_search`, each tile to the end, one
  cycle per step.
- `coordinate_bound_fused`: `bounds.coordinate_upper_bound` with one round, without float64 copies.
- `maxplus_fused`: the max-plus product without the (B, M, M, M) temporary (the torch sweep loop).

`tests/test_solver_triton.py` checks each against the torch code under Triton's CPU interpreter
(`TRITON_INTERPRET=1`, set by tests/conftest.py when there is no GPU) and compiled on a GPU.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from tsenor_cli import settings
from tsenor_cli.solver.types import SinkhornSchedule


def available() -> bool:
    """Whether Triton is importable (it ships with CUDA builds of torch; CPU tests install it)."""
    return importlib.util.find_spec("triton") is not None


def supports(w: torch.Tensor) -> bool:
    """w: (B, M, M) → whether the fused kernel takes it: float32, M a power of two ≤ 64, CUDA
    (or Triton's CPU interpreter, for tests)."""
    _, M, _ = w.shape
    on_device = w.is_cuda or _interpreting()
    return on_device and available() and w.dtype == torch.float32 and M & (M - 1) == 0 and 2 <= M <= 64


def _interpreting() -> bool:
    return settings.triton_interpret()


def _jit() -> ModuleType:
    from tsenor_cli.solver import _triton_jit

    return _triton_jit


def maxplus_fused(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b: (B, M, M) float32 → (B, M, M), out[i, k] = max_t a[i, t] + b[t, k] (−inf entries allowed)."""
    B, M, _ = a.shape
    if not (supports(a) and supports(b)):
        raise ValueError("the fused max-plus product needs float32 (B, M, M) inputs with M a power of two <= 64")
    out = torch.empty_like(a)
    if B > 0:
        _jit().maxplus_kernel[(B,)](a.contiguous(), b.contiguous(), out, M=M, num_warps=1 if M <= 16 else 4)
    return out


def capped_sinkhorn_fused(
    w: torch.Tensor, n: int, schedule: SinkhornSchedule, u: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Same contract as `tsenor.capped_sinkhorn`: w (B, M, M) float32, u, v (B, M) → (u, v, most iterations)."""
    B, M, _ = w.shape
    if not supports(w):
        raise ValueError("the fused Sinkhorn needs float32 (B, M, M) scores with M a power of two <= 64 on CUDA")
    kernel = _jit().sinkhorn_kernel
    u = u.to(torch.float32).contiguous().clone()
    v = v.to(torch.float32).contiguous().clone()
    taus_t = torch.tensor(schedule.taus, dtype=torch.float32, device=w.device)
    ran = torch.zeros(B, dtype=torch.int32, device=w.device)
    iterations, absorb_every = schedule.iterations, schedule.absorb_every
    if B > 0:
        kernel[(B,)](
            w.contiguous(),
            u,
            v,
            taus_t,
            ran,
            float(n),
            float(schedule.tol * n),
            M=M,
            TAUS=len(schedule.taus),
            PERIODS=-(-iterations // absorb_every),
            ABSORB=absorb_every,
            LAST=iterations - absorb_every * (-(-iterations // absorb_every) - 1),
            num_warps=1 if M <= 16 else 4,
        )
    return u, v, int(ran.max()) if B > 0 else 0


def cycle_search_fused(mask: torch.Tensor, w: torch.Tensor, max_moves: int, tiny: float) -> tuple[torch.Tensor, int]:
    """mask: (B, M, M) bool feasible, w: (B, M, M) float32 → (mask with no positive cycle of length ≤ 4
    left, or `max_moves` cycles applied in a tile; the most cycles any tile applied)."""
    B, M, _ = w.shape
    if not supports(w):
        raise ValueError("the fused cycle search needs float32 (B, M, M) scores with M a power of two <= 64")
    out = mask.to(torch.int8).contiguous()
    scratch = w.new_empty(B, 3, M, M)
    moves = torch.zeros(B, dtype=torch.int32, device=w.device)
    if B > 0:
        _jit().cycle_kernel[(B,)](
            w.contiguous(), out, scratch, moves, max_moves, float(tiny), M=M, num_warps=1 if M <= 16 else 4
        )
    return out.bool(), int(moves.max()) if B > 0 else 0


def coordinate_bound_fused(w: torch.Tensor, n: int, col: torch.Tensor) -> torch.Tensor:
    """w: (B, M, M) float32, col: (B, M) column potentials → (B,) float64, the same certified bound as
    `bounds.coordinate_upper_bound(w, n, col=col, rounds=1)` (whose first step recomputes the row
    potentials) without its float64 copies of w."""
    B, M, _ = w.shape
    if not supports(w):
        raise ValueError("the fused bound needs float32 (B, M, M) scores with M a power of two <= 64")
    out = torch.empty(B, dtype=torch.float64, device=w.device)
    if B > 0:
        _jit().bound_kernel[(B,)](
            w.contiguous(),
            col.to(torch.float32).contiguous(),
            out,
            n,
            M=M,
            num_warps=1 if M <= 16 else 4,
        )
    return out

"""Fused Triton kernels for `tsenor` on CUDA: the capped Sinkhorn (paper Algorithm 1, potential
form) and the max-plus product of the cycle search.

The torch loop in `tsenor.capped_sinkhorn` launches ~8 kernels per iteration, each streaming the
whole (B, M, M) batch through memory: at 8192² that is ~2 GB of traffic per iteration and most of a
GPU solve. Here one program owns one M×M tile and keeps it in registers for every stage and
iteration: the scores are read once, the potentials written once.

The max-plus product out[i, k] = max_t a[i, t] + b[t, k] in torch materializes a (B, M, M, M)
temporary; the kernel keeps the (M, M) accumulator in registers and reads a and b once.

Semantics of the Sinkhorn are those of `capped_sinkhorn` with one block per chunk (so each tile leaves a stage on its
own marginal violation); `tests/test_solver_triton.py` checks the two agree under Triton's CPU
interpreter (`TRITON_INTERPRET=1`), and the max-plus product against the torch one.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


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
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernel(interpret: bool):
    """The jitted kernel, built on first use (importing Triton is slow); Triton reads
    TRITON_INTERPRET when a function is decorated, hence one build per mode."""
    import triton
    import triton.language as tl

    @triton.jit
    def sinkhorn_kernel(
        w_ptr,
        u_ptr,
        v_ptr,
        taus_ptr,
        ran_ptr,
        n,
        tol_n,
        M: tl.constexpr,
        TAUS: tl.constexpr,  # temperatures (ε-scaling stages)
        PERIODS: tl.constexpr,  # absorb periods per temperature: ceil(iterations / absorb_every)
        ABSORB: tl.constexpr,  # iterations per period
        LAST: tl.constexpr,  # iterations of the last period
    ):
        pid = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, M)
        cols = tl.arange(0, M)
        w = tl.load(w_ptr + pid * M * M + rows[:, None] * M + cols[None, :])  # (M, M)
        u = tl.load(u_ptr + pid * M + rows)  # (M,)
        v = tl.load(v_ptr + pid * M + cols)  # (M,)
        ran = 0
        for t in tl.static_range(TAUS):
            tau = tl.load(taus_ptr + t)
            stop = 0
            for period in tl.static_range(PERIODS):
                if stop == 0:
                    x = tau * (w - u[:, None] - v[None, :])
                    k = tl.exp(tl.minimum(tl.maximum(x, -60.0), 50.0))  # (M, M), clipped as EXP_MIN/MAX
                    p = tl.full((M,), 1.0, tl.float32)  # row scalings, absorbed into u below
                    q = tl.full((M,), 1.0, tl.float32)  # column scalings, absorbed into v below
                    violation = 0.0
                    for _ in tl.static_range(LAST if period == PERIODS - 1 else ABSORB):
                        s = tl.minimum(k * p[:, None] * q[None, :], 1.0)  # capacity projection (C3)
                        row_sum = tl.sum(s, axis=1)  # (M,)
                        violation = tl.max(tl.abs(row_sum - n), axis=0)
                        row_fac = n / row_sum  # row projection (C1)
                        col_sum = tl.sum(s * row_fac[:, None], axis=0)  # (M,)
                        p = p * row_fac
                        q = q * (n / col_sum)  # column projection (C2)
                    ran += LAST if period == PERIODS - 1 else ABSORB
                    u = u - tl.log(p) / tau
                    v = v - tl.log(q) / tau
                    if violation <= tol_n:
                        stop = 1
        tl.store(u_ptr + pid * M + rows, u)
        tl.store(v_ptr + pid * M + cols, v)
        tl.store(ran_ptr + pid, ran)

    return sinkhorn_kernel


@functools.cache
def _maxplus_kernel(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def maxplus_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, M)
        cols = tl.arange(0, M)
        base = pid * M * M
        acc = tl.full((M, M), float("-inf"), tl.float32)
        for t in range(M):
            a_col = tl.load(a_ptr + base + rows * M + t)  # (M,) a[:, t]
            b_row = tl.load(b_ptr + base + t * M + cols)  # (M,) b[t, :]
            acc = tl.maximum(acc, a_col[:, None] + b_row[None, :])
        tl.store(out_ptr + base + rows[:, None] * M + cols[None, :], acc)

    return maxplus_kernel


def maxplus_fused(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b: (B, M, M) float32 → (B, M, M), out[i, k] = max_t a[i, t] + b[t, k] (−inf entries allowed)."""
    B, M, _ = a.shape
    if not (supports(a) and supports(b)):
        raise ValueError("the fused max-plus product needs float32 (B, M, M) inputs with M a power of two <= 64")
    out = torch.empty_like(a)
    if B > 0:
        _maxplus_kernel(_interpreting())[(B,)](a.contiguous(), b.contiguous(), out, M=M, num_warps=1 if M <= 16 else 4)
    return out


def capped_sinkhorn_fused(
    w: torch.Tensor,
    n: int,
    taus: list[float],
    iterations: int,
    tol: float,
    u: torch.Tensor,
    v: torch.Tensor,
    absorb_every: int = 10,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Same contract as `tsenor.capped_sinkhorn`: w (B, M, M) float32, u, v (B, M) → (u, v, most iterations)."""
    B, M, _ = w.shape
    if not supports(w):
        raise ValueError("the fused Sinkhorn needs float32 (B, M, M) scores with M a power of two <= 64 on CUDA")
    kernel = _kernel(_interpreting())
    u = u.to(torch.float32).contiguous().clone()
    v = v.to(torch.float32).contiguous().clone()
    taus_t = torch.tensor(taus, dtype=torch.float32, device=w.device)
    ran = torch.zeros(B, dtype=torch.int32, device=w.device)
    if B > 0:
        kernel[(B,)](
            w.contiguous(),
            u,
            v,
            taus_t,
            ran,
            float(n),
            float(tol * n),
            M=M,
            TAUS=len(taus),
            PERIODS=-(-iterations // absorb_every),
            ABSORB=absorb_every,
            LAST=iterations - absorb_every * (-(-iterations // absorb_every) - 1),
            num_warps=1 if M <= 16 else 4,
        )
    return u, v, int(ran.max()) if B > 0 else 0

"""Dense factorizations that give the same bits whatever torch's CPU thread count.

On the CPU torch runs eigh and the Cholesky routines through MKL's LAPACK, which splits the work by
the thread count, so the last bits of the result depend on it. Matmuls do not (torch 2.13.0+cpu,
MKL 2024.2: `@` and `addmm` at SmolLM2's shapes are bit-identical on 1 and 2 threads, `eigh` of a
576² matrix is not). ALPS's ADMM turns such a bit into a different support of the same quality:
SmolLM2 ALPS T16:32 on 1 process × 2 threads and 2 processes × 1 thread differed in 6.4% of the mask
entries before these ran on one thread (docs/design/distributed.md, "Scaling"). So on the CPU they
run on one thread; what that costs is measured there. CUDA's solvers do not depend on the CPU's
threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def thread_independent(device: torch.device) -> Iterator[None]:
    """Run the body on one torch thread when `device` is the CPU, then restore the thread count."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def symmetric_eigh(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h: (..., n, n) symmetric → (Λ (..., n), Q (..., n, n)) with h = Q diag(Λ) Qᵀ per matrix, the same bits
    at any thread count."""
    with thread_independent(h.device):
        evals, evecs = torch.linalg.eigh(h)
    return evals, evecs


def inverse_cholesky_upper(h: torch.Tensor) -> torch.Tensor:
    """h: (..., n, n) SPD → U (..., n, n) upper triangular with UᵀU = h⁻¹ per matrix (SparseGPT's `Hinv`),
    the same bits at any thread count."""
    with thread_independent(h.device):
        lower = torch.linalg.cholesky(h)
        return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)

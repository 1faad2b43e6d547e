"""How many dual rounds the exact `flow` solver should run, and what a warm start saves (docs/design/solver.md).

Usage: .venv/bin/python scripts/flow_study.py [--size 2048] [--threads 1] [--repeats 3]
On a (size, size) matrix of real SmolLM2 tiles (the benchmark's `real_matrix`, |W|), prints per N:M
and number of dual rounds the augmenting paths per tile and the best-of-repeats seconds of `exact_flow`
(which normalizes each tile by its max), then a warm start from the cold potentials on 1%-perturbed
scores: from the potentials alone and from the previous mask with 0-3 centring sweeps.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from tsenor_cli.bench.solver import real_matrix
from tsenor_cli.models.embedded import DEFAULT_MODEL, materialize
from tsenor_cli.pruning import PRUNERS, InputStats, MatrixPruneConfig, SparsityPattern
from tsenor_cli.settings import RunContext
from tsenor_cli.solver import flow as flow_module
from tsenor_cli.solver import to_blocks
from tsenor_cli.solver.flow import FlowOptions, FlowResult, exact_flow


def best_of(
    repeats: int,
    w: torch.Tensor,
    n: int,
    col: torch.Tensor | None = None,
    init_mask: torch.Tensor | None = None,
    **options: Any,
) -> tuple[float, FlowResult]:
    seconds, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = exact_flow(w, n, col, init_mask, FlowOptions(**options))
        seconds = min(seconds, time.perf_counter() - start)
    assert result is not None
    return seconds, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--alps", action="store_true", help="also time ALPS on a random layer per retry threshold")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = materialize(DEFAULT_MODEL, RunContext.from_environment().cache_dir)
    print(f"{args.size}² real tiles, {args.threads} thread(s), best of {args.repeats}\n")
    print("| N:M | start | dual rounds | paths per tile | seconds |")
    print("|---|---|---:|---:|---:|")
    for n, m in ((8, 16), (16, 32)):
        blocks = to_blocks(real_matrix(path, args.size, m, 0), m)  # (B, M, M)
        exact_flow(blocks[:2], n)  # compile outside the timings
        cold = None
        for rounds in (0, 1, 2, 3):
            secs, res = best_of(args.repeats, blocks, n, rounds=rounds)
            cold = res if rounds == 2 else cold
            print(f"| {n}:{m} | cold (v = 0) | {rounds} | {res.paths.double().mean():.1f} | {secs:.3f} |")
        assert cold is not None
        gen = torch.Generator().manual_seed(1)
        noisy = (blocks * (1 + 0.01 * torch.randn(blocks.shape, generator=gen))).abs()
        col = cold.col * cold.scale[:, None]  # in score units; the kernel rescales per tile
        secs, res = best_of(args.repeats, noisy, n, rounds=2)
        print(f"| {n}:{m} | 1% noise, cold | 2 | {res.paths.double().mean():.1f} | {secs:.3f} |")
        for rounds in (0, 1):
            secs, res = best_of(args.repeats, noisy, n, col=col, rounds=rounds)
            label = "1% noise, warm (potentials)"
            print(f"| {n}:{m} | {label} | {rounds} | {res.paths.double().mean():.1f} | {secs:.3f} |")
        for sweeps in (0, 1, 2, 3):
            secs, res = best_of(args.repeats, noisy, n, col=col, rounds=0, init_mask=cold.mask, sweeps=sweeps)
            label = f"1% noise, warm (mask, {sweeps} sweeps)"
            print(f"| {n}:{m} | {label} | 0 | {res.paths.double().mean():.1f} | {secs:.3f} |")

    if args.alps:
        alps_retry(args.repeats)


def alps_retry(repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=gen)
    stats = InputStats.from_inputs(torch.randn(8192, 576, generator=gen))
    transposable = MatrixPruneConfig(SparsityPattern.from_nm(16, 32, transposable=True))
    ordinary = MatrixPruneConfig(SparsityPattern.from_nm(16, 32, transposable=False))
    print("\n| ALPS 16:32, random 1536×576 | retry above × M | ADMM iterations | seconds | in the solver |")
    print("|---|---:|---:|---:|---:|")
    default = flow_module.RETRY_EXCESS_PER_M
    for retry in (float(32), 0.5, 0.25, 0.0):  # 32·M: never
        flow_module.RETRY_EXCESS_PER_M = retry
        best, out = float("inf"), None
        for _ in range(repeats):
            start = time.perf_counter()
            out = PRUNERS["alps"].prune(weight, stats, transposable)
            best = min(best, time.perf_counter() - start)
        assert out is not None and out.solve is not None
        label = "never" if retry >= 32 else f"{retry}"
        print(f"| transposable | {label} | {out.iterations} | {best:.2f} | {out.solve.seconds:.2f} |")
    flow_module.RETRY_EXCESS_PER_M = default
    start = time.perf_counter()
    out = PRUNERS["alps"].prune(weight, stats, ordinary)
    print(f"| ordinary | — | {out.iterations} | {time.perf_counter() - start:.2f} | — |")


if __name__ == "__main__":
    main()

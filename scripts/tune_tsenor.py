"""Parameter sweep behind the `tsenor` defaults (docs/design/solver.md): error vs `exact` and time.

Usage: .venv/bin/python scripts/tune_tsenor.py [--tiles 600] [--threads 1] > table.md
Tiles come from every decoder linear of the embedded SmolLM2 (the benchmark's sampler), |W| scores.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from tsenor_cli.bench.solver import sample_real_tiles
from tsenor_cli.models.embedded import DEFAULT_MODEL, materialize
from tsenor_cli.settings import RunContext
from tsenor_cli.solver import from_blocks, solve

SETTINGS: list[dict[str, object]] = [
    {},
    {"tau": 100.0},
    {"tau": 400.0},
    {"stages": 3},
    {"iterations": 15},
    {"iterations": 50},
    {"rounding": "rowcol"},
    {"sweeps": 0},
    {"sweeps": 0, "rounding": "rowcol"},
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiles", type=int, default=600)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = materialize(DEFAULT_MODEL, RunContext.from_environment().cache_dir)
    print("| N:M | options | mean rel. error | max rel. error | optimal tiles | mean certified gap | seconds |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for n, m in [(8, 16), (16, 32), (8, 32)]:
        tiles = sample_real_tiles(path, m, args.tiles, args.seed).abs()
        scores = from_blocks(tiles, tiles.shape[0] * m, m)
        print(f"[tune] {n}:{m}: exact", file=sys.stderr, flush=True)
        opt = solve(scores, n, m, "exact").block_objective
        variants = [{"method": "tsenor", **s} for s in SETTINGS]
        runs: list[dict[str, Any]] = [{"method": "tsenor-reference"}, {"method": "flow"}]
        runs += variants
        for options in runs:
            method = str(options.pop("method"))
            start = time.perf_counter()
            res = solve(scores, n, m, method, **options)
            seconds = time.perf_counter() - start
            rel = ((opt - res.block_objective) / opt).clamp_min(0)
            gap = (res.block_upper_bound - res.block_objective) / res.block_upper_bound
            label = method + ("" if not options else " " + ", ".join(f"{k}={v}" for k, v in options.items()))
            print(
                f"| {n}:{m} | {label} | {100 * float(rel.mean()):.5f}% | {100 * float(rel.max()):.4f}% | "
                f"{100 * float((rel <= 1e-9).double().mean()):.1f}% | {100 * float(gap.mean()):.4f}% | {seconds:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

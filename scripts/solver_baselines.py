"""Quality and speed of the baseline mask methods against `exact` on real SmolLM2 tiles.

Usage: .venv/bin/python scripts/solver_baselines.py [--tiles 640] [--threads N] [--json out.json]
       [--skip-quality] [--skip-slab]
Progress goes to stderr; a table and (optionally) JSON with every number to stdout / --json.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from tsenor_cli import atomic
from tsenor_cli.models.embedded import materialize
from tsenor_cli.settings import RunContext
from tsenor_cli.solver import from_blocks, solve, to_blocks
from tsenor_cli.solver.reference import run_reference

PATTERNS = [(8, 16), (16, 32), (8, 32)]
METHODS = ["tsenor-reference", "two_approx", "bi_nm", "max_random"]
# 576×576 pieces of four different projection types across depth.
PIECES = [
    ("model.layers.0.self_attn.q_proj.weight", (slice(0, 576), slice(0, 576))),
    ("model.layers.10.self_attn.o_proj.weight", (slice(0, 576), slice(0, 576))),
    ("model.layers.20.mlp.down_proj.weight", (slice(0, 576), slice(0, 576))),
    ("model.layers.29.mlp.gate_proj.weight", (slice(0, 576), slice(0, 576))),
]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _tensors(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name).float() for name in names}


def quality(path: Path, tiles: int) -> list[dict[str, object]]:
    """Mean relative error (opt − obj)/opt per tile, and the mean certified gap, per method and pattern."""
    weights = _tensors(path, [name for name, _ in PIECES])
    matrix = torch.cat([weights[name][rs, cs] for name, (rs, cs) in PIECES], dim=1).abs()  # (576, 2304)
    rows: list[dict[str, object]] = []
    for n, m in PATTERNS:
        blocks = to_blocks(matrix, m)  # (B, M, M)
        step = max(1, blocks.shape[0] // tiles)
        chosen = blocks[::step][:tiles]  # (T, M, M), spread over all four pieces
        scores = from_blocks(chosen, chosen.shape[0] * m, m)  # (T·M, M): one tile per row band
        _log(f"{n}:{m}: {chosen.shape[0]} tiles, exact ...")
        ex = solve(scores, n, m, "exact")
        opt = ex.block_objective
        for method in METHODS:
            _log(f"{n}:{m}: {method} ...")
            res = solve(scores, n, m, method)
            rel = (opt - res.block_objective) / opt
            rows.append(
                {
                    "pattern": f"{n}:{m}",
                    "tiles": int(chosen.shape[0]),
                    "method": method,
                    "mean_rel_error": float(rel.mean()),
                    "max_rel_error": float(rel.max()),
                    "mean_certified_gap": float(
                        ((res.block_upper_bound - res.block_objective) / res.block_upper_bound).mean()
                    ),
                    "seconds": res.seconds,
                }
            )
        run = run_reference(to_blocks(scores, m), n)
        rows.append(
            {
                "pattern": f"{n}:{m}",
                "tiles": int(chosen.shape[0]),
                "method": "tsenor-reference (rounding counters)",
                "infeasible_after_local_search": run.infeasible_after_local_search,
                "forced_blocks": run.forced_blocks,
            }
        )
    return rows


def slab_timing(path: Path) -> list[dict[str, object]]:
    """Wall time of `exact` and `tsenor-reference` on a 2048×2048 |W| slab of real gate/up weights."""
    names = [f"model.layers.{k}.mlp.{p}_proj.weight" for k in range(8) for p in ("gate", "up")]
    w = _tensors(path, names)
    columns = [torch.cat([w[names[4 * c]], w[names[4 * c + 1]]], dim=0) for c in range(4)]  # 4 × (3072, 576)
    slab = torch.cat(columns, dim=1)[:2048, :2048].abs().contiguous()  # (2048, 2048)
    out: list[dict[str, object]] = []
    for n, m in [(8, 16), (16, 32)]:
        for method in ["exact", "tsenor-reference"]:
            _log(f"slab 2048x2048 {n}:{m}: {method} ...")
            start = time.perf_counter()
            res = solve(slab, n, m, method)
            wall = time.perf_counter() - start
            out.append(
                {
                    "pattern": f"{n}:{m}",
                    "tiles": (2048 // m) ** 2,
                    "method": method,
                    "solver_seconds": res.seconds,
                    "wall_seconds": wall,
                    "objective": res.objective,
                    "certified_gap": res.gap,
                    "torch_threads": torch.get_num_threads(),
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiles", type=int, default=640)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--skip-slab", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = materialize("smollm2-135m", RunContext.from_environment().cache_dir)
    quality_rows = [] if args.skip_quality else quality(path, args.tiles)
    slab_rows = [] if args.skip_slab else slab_timing(path)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "quality": quality_rows,
        "slab": slab_rows,
    }
    print(f"{'pattern':8} {'method':22} {'tiles':>6} {'mean rel err':>13} {'max rel err':>12} {'cert gap':>9} {'s':>7}")
    for row in quality_rows:
        if "mean_rel_error" in row:
            print(
                f"{row['pattern']:8} {row['method']:22} {row['tiles']:>6} {row['mean_rel_error']:>13.3e} "
                f"{row['max_rel_error']:>12.3e} {row['mean_certified_gap']:>9.2e} {row['seconds']:>7.2f}"
            )
        else:
            print(
                f"{row['pattern']:8} reference rounding: {row['infeasible_after_local_search']} tiles "
                f"infeasible after L=10, {row['forced_blocks']} needed a non-improving swap"
            )
    for row in slab_rows:
        print(
            f"slab {row['pattern']:6} {row['method']:18} tiles={row['tiles']:>6} "
            f"solver={row['solver_seconds']:.1f}s wall={row['wall_seconds']:.1f}s "
            f"gap={row['certified_gap']:.2e}"
        )
    if args.json is not None:
        atomic.write_json(args.json, result)


if __name__ == "__main__":
    main()

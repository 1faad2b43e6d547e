"""The mask solver on a CUDA device: 8192² timings next to the paper's Table 1, phases, memory, quality.

The GPU machine has no copy of the model, so the scores come from a *tile pool* made beforehand on a
machine that has it (real |W| tiles of every decoder linear of SmolLM2-135M, the same sampling as
`tsenor bench solver`):

    .venv/bin/python scripts/bench_cuda.py pool --output .gpu/pool.safetensors      # here, ~32 MiB
    python3 scripts/bench_cuda.py run --pool .gpu/pool.safetensors --json OUT.json  # on the GPU

`run` assembles each timed matrix from tiles drawn with replacement from the pool (2048² distinct real
tiles per pattern; the solver treats tiles independently, so repeats change no per-tile work), then
for 8:16 and 16:32 at 8192² (and 2048²) times `tsenor` cold (both roundings), warm from the cold
result on scores × (1 + 0.01·N(0,1)), `tsenor-reference` and `two_approx`; profiles the phases of one
cold solve; reports peak CUDA memory above the scores; checks every mask is exactly N per row and
column of every tile; and measures quality against `exact` (HiGHS, on the host) on pool tiles.
Timings are medians of `--repeats` after one warm-up, with device synchronization.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file

from tsenor_cli import atomic
from tsenor_cli.solver import SolveResult, from_blocks, solve, to_blocks
from tsenor_cli.solver.tsenor import (
    Rounding,
    Sinkhorn,
    _block_scale,
    _bound,
    _round,
    _sinkhorn,
    _tau_schedule,
    cycle_search,
)
from tsenor_cli.solver.types import SinkhornSchedule

T = TypeVar("T")
ROUNDINGS: tuple[Rounding, ...] = ("greedy", "rowcol")
SINKHORNS: tuple[Sinkhorn, ...] = ("torch", "triton")

PATTERNS = ((8, 16), (16, 32))
POOL_SIZE = 2048


def make_pool(output: Path, seed: int) -> None:
    from tsenor_cli.bench.solver import sample_real_tiles
    from tsenor_cli.models.embedded import materialize
    from tsenor_cli.settings import RunContext

    model_dir = materialize("smollm2-135m", RunContext.from_environment().cache_dir)
    tensors = {
        f"tiles_{m}": sample_real_tiles(model_dir, m, (POOL_SIZE // m) ** 2, seed).abs().contiguous()
        for _, m in PATTERNS
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output))
    print(f"wrote {output} ({output.stat().st_size / 2**20:.1f} MiB)")


def matrix(pool: dict[str, torch.Tensor], m: int, size: int, seed: int, device: torch.device) -> torch.Tensor:
    """(size, size) scores from pool tiles of side m, drawn with replacement (seeded)."""
    tiles = pool[f"tiles_{m}"]  # (P, m, m)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, tiles.shape[0], ((size // m) ** 2,), generator=gen)
    return from_blocks(tiles[idx], size, size).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], SolveResult], device: torch.device, repeats: int) -> tuple[list[float], SolveResult]:
    """One warm-up, then `repeats` synchronized wall-clock timings → (seconds list, last result)."""
    out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times, out


def feasible(mask: torch.Tensor, n: int, m: int) -> bool:
    blocks = to_blocks(mask, m)  # (B, M, M)
    return bool((blocks.sum(1) == n).all()) and bool((blocks.sum(2) == n).all())


def record(
    rows: list[dict[str, object]],
    pat: str,
    size: int,
    n: int,
    m: int,
    method: str,
    times: list[float],
    res: SolveResult,
    **more: float,
) -> None:
    """Append (and print) one timing row: medians, objective, certified gap, feasibility."""
    row: dict[str, object] = {
        "pattern": pat,
        "size": size,
        "method": method,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "objective": res.objective,
        "gap": res.gap,
        "feasible": feasible(res.mask, n, m),
        **more,
    }
    rows.append(row)
    print(json.dumps(row), flush=True)


def phases(scores: torch.Tensor, n: int, m: int, rounding: Rounding, backend: Sinkhorn) -> dict[str, float]:
    """Seconds of each step of one cold `tsenor` solve with its defaults (tsenor.py's pipeline)."""
    device = scores.device
    out: dict[str, float] = {}

    def step(name: str, fn: Callable[[], T]) -> T:
        sync(device)
        start = time.perf_counter()
        value = fn()
        sync(device)
        out[name] = time.perf_counter() - start
        return value

    blocks = to_blocks(scores, m)  # (B, M, M)
    B, M, _ = blocks.shape
    scale = _block_scale(blocks)
    w = blocks / scale[:, None, None]
    u0 = w.topk(n, dim=2).values[:, :, n - 1] - 0.5 / 200.0
    v0 = w.new_zeros(B, M)
    schedule = SinkhornSchedule(tuple(_tau_schedule(200.0, 4)), 25, 1e-3)
    u, v, _ = step("sinkhorn", lambda: _sinkhorn(backend, w, n, schedule, u0, v0))
    mask = step("rounding+completion", lambda: _round(w - u[:, :, None] - v[:, None, :], w, n, rounding))
    step("cycle search", lambda: cycle_search(mask, w, 30))
    step("cycle search (sweep loop)", lambda: cycle_search(mask, w, 30, fused=False))
    step("coordinate bound", lambda: _bound(w, u, v, n, "coordinate"))
    return out


def quality(pool: dict[str, torch.Tensor], n: int, m: int, tiles: int, device: torch.device) -> dict[str, float]:
    """Mean and max relative error of `tsenor` on the device against `exact` on the host, per tile."""
    blocks = pool[f"tiles_{m}"][:tiles]  # (T, m, m)
    scores = from_blocks(blocks, tiles * m, m)
    fast = solve(scores.to(device), n, m, "tsenor")
    best = solve(scores, n, m, "exact")
    rel = 1 - fast.block_objective.cpu() / best.block_objective
    return {"tiles": tiles, "mean_rel_error": float(rel.mean()), "max_rel_error": float(rel.max())}


WARM = "tsenor warm (1% noise)"


def warm_row(
    rows: list[dict[str, object]],
    pat: str,
    size: int,
    n: int,
    m: int,
    scores: torch.Tensor,
    cold: SolveResult,
    device: torch.device,
    args: argparse.Namespace,
) -> None:
    """The warm re-solve row: scores × (1 + 0.01·N(0,1)) solved from `cold`, beside its cold solve."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    noisy = (scores * (1 + 0.01 * torch.randn(scores.shape, generator=gen).to(scores))).abs()
    warm_times, warm = timed(partial(solve, noisy, n, m, "tsenor", init=cold), device, args.repeats)
    cold_times, cold_noisy = timed(partial(solve, noisy, n, m, "tsenor"), device, args.repeats)
    record(
        rows,
        pat,
        size,
        n,
        m,
        WARM,
        warm_times,
        warm,
        cold_median_s=statistics.median(cold_times),
        cold_objective=cold_noisy.objective,
    )


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    pool = load_file(str(args.pool))
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "repeats": args.repeats,
    }
    rows: list[dict[str, object]] = []
    extra: dict[str, object] = {"phases": {}, "quality": {}, "peak_mib": {}}
    for n, m in PATTERNS:
        pat = f"{n}:{m}"
        extra["quality"][pat] = quality(pool, n, m, args.quality_tiles, device)  # type: ignore[index]
        for size in args.sizes:
            scores = matrix(pool, m, size, args.seed, device)
            runs: dict[str, Callable[[], SolveResult]] = {
                "tsenor": partial(solve, scores, n, m, "tsenor"),
                "tsenor rounding=rowcol": partial(solve, scores, n, m, "tsenor", rounding="rowcol"),
                "tsenor rounding=greedy": partial(solve, scores, n, m, "tsenor", rounding="greedy"),
                "tsenor max_elements=2^24": partial(solve, scores, n, m, "tsenor", max_elements=1 << 24),
                "tsenor max_elements=2^22": partial(solve, scores, n, m, "tsenor", max_elements=1 << 22),
                "tsenor sinkhorn=torch": partial(solve, scores, n, m, "tsenor", sinkhorn="torch"),
                "two_approx": partial(solve, scores, n, m, "two_approx"),
            }
            results: dict[str, SolveResult] = {}

            def wanted(name: str) -> bool:
                return args.methods is None or name in args.methods

            for name, fn in runs.items():
                if wanted(name) or (name == "tsenor" and wanted(WARM)):
                    times, results[name] = timed(fn, device, args.repeats)
                    record(rows, pat, size, n, m, name, times, results[name])
            if wanted("tsenor-reference"):
                ref_times, ref = timed(partial(solve, scores, n, m, "tsenor-reference"), device, args.ref_repeats)
                record(rows, pat, size, n, m, "tsenor-reference", ref_times, ref)
            if wanted(WARM):
                warm_row(rows, pat, size, n, m, scores, results["tsenor"], device, args)
            if size == max(args.sizes):
                extra["phases"][pat] = {  # type: ignore[index]
                    f"{r}, sinkhorn={b}": phases(scores, n, m, r, b)
                    for r in ROUNDINGS
                    for b in (SINKHORNS if device.type == "cuda" else SINKHORNS[:1])
                }
                if device.type == "cuda":
                    sync(device)
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                    for label, opts in (("default", {}), ("max_elements=2^24", {"max_elements": 1 << 24})):
                        torch.cuda.reset_peak_memory_stats(device)
                        solve(scores, n, m, "tsenor", **opts)  # type: ignore[arg-type]
                        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
                        extra["peak_mib"][f"{pat} {label}"] = {  # type: ignore[index]
                            "scores_mib": scores.numel() * 4 / 2**20,
                            "peak_extra_mib": peak,
                        }
            del scores, results
    report = {"info": info, "rows": rows, **extra}
    if args.json:
        atomic.write_json(args.json, report)
    text = to_markdown(report)
    if args.markdown:
        atomic.write_text(args.markdown, text)
    print(text)


# The paper's Table 1: its TSENOR implementation on an 8192×8192 matrix, 8:16, one H100.
PAPER_8192_8x16_S = 1.06


def layers_markdown(layers: dict[str, Any]) -> list[str]:
    out = [
        "",
        "## Pruning one layer on the GPU (LLaMA-3.2-1B shapes, 16:32)",
        "",
        f"`scripts/bench_cuda.py layers`: random weights (σ = 0.02) and {layers['tokens']} random low-rank-"
        "correlated input rows per layer, so the errors only show that every run finished normally; the "
        "quality comparison of the methods is docs/results.md. Seconds for one layer after a warm-up.",
        "",
        "| layer | shape (out×in) | method | transposable s | ordinary s | transposable / ordinary |",
        "|---|---|---|---:|---:|---:|",
    ]
    rows = layers["rows"]
    for r in rows:
        if not r["transposable"]:
            continue
        o = next(x for x in rows if x["layer"] == r["layer"] and x["method"] == r["method"] and not x["transposable"])
        out.append(
            f"| {r['layer']} | {r['shape']} | {r['method']} | {r['seconds']:.3f} | {o['seconds']:.3f} | "
            f"{r['seconds'] / o['seconds']:.1f}× |"
        )
    return out


def to_markdown(report: dict[str, Any], layers: dict[str, Any] | None = None) -> str:
    info, rows = report["info"], report["rows"]
    out = [
        "# The mask solver on a GPU",
        "",
        f"Written by `scripts/bench_cuda.py` (see its docstring for the protocol). Device: {info['device']}; "
        f"torch {info['torch']}; {info['date']}; medians of {info['repeats']} synchronized runs after a "
        "warm-up (tsenor-reference: of 2). Scores: |W| tiles of SmolLM2-135M's decoder linears, drawn "
        "with replacement from a pool of 2048² distinct real tiles per pattern.",
        "",
        "## Time against the paper's Table 1 (8192×8192)",
        "",
        "| N:M | method | seconds | × faster than tsenor-reference | × faster than the paper (1.06 s, H100) "
        "| objective vs tsenor | certified gap | exact N per row and column |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for size in sorted({r["size"] for r in rows}, reverse=True):
        if size != max(r["size"] for r in rows):
            out += [
                "",
                f"## {size}×{size}",
                "",
                "| N:M | method | seconds | × faster than tsenor-reference | objective vs tsenor | certified gap "
                "| exact N per row and column |",
                "|---|---|---:|---:|---:|---:|---|",
            ]
        for pat in dict.fromkeys(r["pattern"] for r in rows):
            sel = [r for r in rows if r["pattern"] == pat and r["size"] == size]
            # `run --methods` may leave the reference out: its column then says "-".
            ref = next((r["median_s"] for r in sel if r["method"] == "tsenor-reference"), None)
            best = next(r["objective"] for r in sel if r["method"] == "tsenor")
            for r in sel:
                paper = f" {PAPER_8192_8x16_S / r['median_s']:.1f} |" if size == 8192 and pat == "8:16" else " - |"
                faster = "-" if ref is None else f"{ref / r['median_s']:.1f}"
                out.append(
                    f"| {pat} | {r['method']} | {r['median_s']:.4f} | {faster} |"
                    + (paper if size == max(x["size"] for x in rows) else "")
                    + f" {r['objective'] / best - 1:+.4%} | {r['gap']:.3%} | {'yes' if r['feasible'] else 'NO'} |"
                )
    out += [
        "",
        "`tsenor warm (1% noise)` re-solves the scores × (1 + 0.01·N(0,1)) from the cold result; its objective "
        "is compared with the cold solve of the same perturbed scores (the table's column compares with the "
        "unperturbed optimum, hence the small positive difference).",
        "",
        "## Where the time goes (one cold solve, 8192²)",
        "",
        "| N:M | rounding, Sinkhorn | Sinkhorn s | rounding + completion s | cycle search s | "
        "cycle search, sweep loop s | coordinate bound s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for pat, variants in report["phases"].items():
        for name, ph in variants.items():
            out.append(
                f"| {pat} | {name} | {ph['sinkhorn']:.4f} | {ph['rounding+completion']:.4f} | "
                f"{ph['cycle search']:.4f} | {ph.get('cycle search (sweep loop)', float('nan')):.4f} | "
                f"{ph['coordinate bound']:.4f} |"
            )
    out += ["", "## Memory (8192², peak CUDA allocation above the scores)", ""]
    out += ["| N:M | scores MiB | peak extra MiB | peak / scores |", "|---|---:|---:|---:|"]
    for pat, mem in report["peak_mib"].items():
        out.append(
            f"| {pat} | {mem['scores_mib']:.0f} | {mem['peak_extra_mib']:.0f} | "
            f"{mem['peak_extra_mib'] / mem['scores_mib']:.1f}× |"
        )
    out += ["", "## Quality on the GPU against `exact` (HiGHS on the host), per tile", ""]
    out += ["| N:M | tiles | mean rel. error | max rel. error |", "|---|---:|---:|---:|"]
    for pat, q in report["quality"].items():
        out.append(f"| {pat} | {q['tiles']} | {q['mean_rel_error']:.5%} | {q['max_rel_error']:.5%} |")
    if layers is not None:
        out += layers_markdown(layers)
    return "\n".join(out) + "\n"


# LLaMA-3.2-1B's decoder linears, (out, in): q/o, k/v, gate/up, down.
LLAMA_1B_SHAPES = {"q_proj": (2048, 2048), "k_proj": (512, 2048), "up_proj": (8192, 2048), "down_proj": (2048, 8192)}


def layers(args: argparse.Namespace) -> None:
    """Per-layer pruning time and error on the device for LLaMA-3.2-1B-shaped layers (random weights,
    low-rank-correlated random inputs: this times the methods at the real sizes; quality belongs to
    docs/results.md), every method × transposable / ordinary 16:32, one process."""
    from tsenor_cli.pattern import SparsityPattern
    from tsenor_cli.pruning.methods.registry import get_pruner
    from tsenor_cli.pruning.methods.stats import InputStats, reconstruction_error
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig

    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[dict[str, object]] = []
    for name, (out_f, in_f) in LLAMA_1B_SHAPES.items():
        out_f, in_f = out_f // args.shrink, in_f // args.shrink
        w = torch.randn(out_f, in_f, generator=gen, device=device) * 0.02
        x = torch.randn(args.tokens, 64, generator=gen, device=device) @ torch.randn(
            64, in_f, generator=gen, device=device
        )
        x = x + 0.5 * torch.randn(args.tokens, in_f, generator=gen, device=device)
        stats = InputStats.from_inputs(x, gram=True)
        for method in args.methods:
            for transposable in (True, False):
                cfg = MatrixPruneConfig(pattern=SparsityPattern.from_nm(16, 32, transposable=transposable))
                fn = get_pruner(method).prune
                if not any(r["method"] == method and r["transposable"] == transposable for r in rows):
                    small = InputStats.from_inputs(x[:256, :256], gram=True)
                    fn(w[:256, :256].contiguous(), small, cfg)  # warm-up: kernels, handles, Triton compiles
                sync(device)
                start = time.perf_counter()
                outcome = fn(w, stats, cfg)
                sync(device)
                seconds = time.perf_counter() - start
                err = reconstruction_error(w, outcome.weight, stats.require_gram())
                rows.append(
                    {
                        "layer": name,
                        "shape": f"{out_f}x{in_f}",
                        "method": method,
                        "transposable": transposable,
                        "seconds": seconds,
                        "iterations": outcome.iterations,
                        "rel_error": err,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        atomic.write_json(
            args.json,
            {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "tokens": args.tokens,
                "rows": rows,
            },
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pool", help="sample the real tile pool (needs the embedded model)")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="time the solvers on the device")
    r.add_argument("--pool", type=Path, required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--ref-repeats", type=int, default=2)
    r.add_argument("--quality-tiles", type=int, default=500)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--json", type=Path)
    r.add_argument(
        "--methods", nargs="+", help="only these rows, e.g. tsenor 'tsenor warm (1%% noise)' (default: every row)"
    )
    r.add_argument("--markdown", type=Path)
    la = sub.add_parser("layers", help="time the pruning methods on LLaMA-3.2-1B-shaped layers")
    la.add_argument("--device", default="cuda")
    la.add_argument("--tokens", type=int, default=8192)
    la.add_argument("--methods", nargs="+", default=["alps", "sparsegpt", "wanda"])
    la.add_argument("--shrink", type=int, default=1, help="divide every shape (smoke tests)")
    la.add_argument("--json", type=Path)
    d = sub.add_parser("render", help="Markdown from a saved JSON result")
    d.add_argument("--json", type=Path, required=True)
    d.add_argument("--layers", type=Path, help="the JSON of a `layers` run, appended as a section")
    d.add_argument("--markdown", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "pool":
        make_pool(args.output, args.seed)
    elif args.command == "run":
        run(args)
    elif args.command == "layers":
        layers(args)
    elif args.command == "render":
        layers_report = json.loads(args.layers.read_text()) if args.layers else None
        atomic.write_text(args.markdown, to_markdown(json.loads(args.json.read_text()), layers_report))
    else:
        raise SystemExit(f"unknown command {args.command!r}")


if __name__ == "__main__":
    main()

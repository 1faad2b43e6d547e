"""`tsenor bench solver`: quality against `exact` on real tiles, and speed ratios in one run.

Quality: tiles sampled from every linear layer of every decoder block of a real checkpoint (fixed
seed), scores |W| and W² (the ALPS case). Speed: a 2048×2048 matrix assembled from real tiles,
every method solving the same matrix in the same process, so ratios are comparable even on a
noisy machine; warm start re-solves the matrix perturbed by 1% relative noise from the cold
result, for every timed method that takes one (`flow`, `tsenor`); the large case reports seconds and
peak extra memory of the default solver on 8192×8192 (what `auto` runs on the device: `flow` on CPU).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import resource
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

from tsenor_cli.bench.machine import environment
from tsenor_cli.errors import UsageError
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.progress import Progress, sink
from tsenor_cli.solver import METHODS, SolveResult, from_blocks, resolve_method, solve, to_blocks

ScoreKind = Literal["abs", "sq"]
SCORE_KINDS: tuple[ScoreKind, ...] = ("abs", "sq")
_SCORE_LABEL = {"abs": "|W|", "sq": "W²"}


@dataclass(frozen=True)
class BenchConfig:
    model_dir: Path
    model_name: str
    patterns: tuple[SparsityPattern, ...]
    methods: tuple[str, ...]
    tiles: int = 500
    time_size: int = 2048
    time_patterns: tuple[SparsityPattern, ...] = ()
    time_methods: tuple[str, ...] = ()
    large_size: int = 0
    repeats: int = 1  # timed solves per method, round-robin; the minimum is reported
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if not set(self.time_methods) <= set(self.methods):
            raise UsageError(
                f"--time-methods {','.join(self.time_methods)} must be among --methods {','.join(self.methods)}"
            )
        for pat in self.time_patterns:
            if self.time_size % pat.m or (self.large_size and self.large_size % pat.m):
                raise UsageError(f"--time-size/--large-size must be multiples of M={pat.m} for pattern {pat}")


@dataclass(frozen=True)
class QualityRow:
    pattern: str
    score: str
    method: str
    tiles: int
    mean_rel_error: float
    max_rel_error: float
    optimal_share: float
    mean_certified_gap: float
    bound_holds: bool  # certified bound ≥ exact optimum on every tile
    seconds: float


@dataclass(frozen=True)
class TimingRow:
    pattern: str
    size: int
    method: str
    seconds: float
    objective: float
    rel_to_best: float  # 1 − objective / best objective among the timed methods
    certified_gap: float


@dataclass(frozen=True)
class WarmRow:
    pattern: str
    size: int
    method: str
    cold_seconds: float
    warm_seconds: float
    speedup: float
    cold_objective: float
    warm_objective: float
    warm_vs_cold: float  # warm objective / cold objective − 1 on the perturbed scores


@dataclass(frozen=True)
class LargeRow:
    pattern: str
    size: int
    method: str
    seconds: float
    matrix_mib: float
    peak_extra_mib: float  # peak memory above the process's footprint with the scores allocated
    # CPU: the median, min and max over LARGE_REPEATS fresh processes (seconds: the median too). The
    # resident-memory peak of one identical solve varied 1.37-1.63× the scores at 8:16 and 1.44-1.87×
    # at 16:32 over three runs (docs/design/solver.md), so one run cannot show a change. CUDA: one exact count.
    peak_extra_min_mib: float | None = None
    peak_extra_max_mib: float | None = None


@dataclass(frozen=True)
class BenchResult:
    machine: dict[str, Any]
    config: dict[str, object]
    quality: list[QualityRow] = field(default_factory=list)
    timing: list[TimingRow] = field(default_factory=list)
    warm: list[WarmRow] = field(default_factory=list)
    large: list[LargeRow] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _decoder_weight_names(model_file: Path) -> list[str]:
    with safe_open(str(model_file), "pt") as f:
        return sorted(k for k in f.keys() if ".layers." in k and k.endswith("_proj.weight"))  # noqa: SIM118


def sample_real_tiles(model_dir: Path, m: int, count: int, seed: int) -> torch.Tensor:
    """→ (count, m, m) float32 raw weights: the same number of random m×m tiles from every decoder
    linear of the checkpoint (row-major tile grid of each matrix), then a seeded shuffle."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}; pass a materialized HF checkpoint folder")
    gen = torch.Generator().manual_seed(seed)
    picked: list[torch.Tensor] = []
    names = [(f, k) for f in files for k in _decoder_weight_names(f)]
    if not names:
        raise ValueError(f"{model_dir} has no decoder-block linear weights (*.layers.*_proj.weight)")
    per = math.ceil(count / len(names))
    for file, name in names:
        with safe_open(str(file), "pt") as f:
            w = f.get_tensor(name).float()
        rows, cols = (w.shape[0] // m) * m, (w.shape[1] // m) * m
        blocks = to_blocks(w[:rows, :cols], m)  # (B, m, m)
        picked.append(blocks[torch.randint(0, blocks.shape[0], (per,), generator=gen)])
    tiles = torch.cat(picked)
    return tiles[torch.randperm(tiles.shape[0], generator=gen)[:count]]


def _scores(tiles: torch.Tensor, kind: ScoreKind) -> torch.Tensor:
    if kind == "abs":
        return tiles.abs()
    if kind == "sq":
        return tiles.square()
    raise ValueError(f"unknown score kind {kind!r}")


def _as_matrix(tiles: torch.Tensor) -> torch.Tensor:
    """tiles (B, M, M) → (B·M, M) matrix whose `to_blocks` gives the tiles back in order."""
    B, M, _ = tiles.shape
    return from_blocks(tiles, B * M, M)


def real_matrix(model_dir: Path, size: int, m: int, seed: int) -> torch.Tensor:
    """(size, size) |W| assembled from real m×m tiles: real value statistics at any size."""
    tiles = sample_real_tiles(model_dir, m, (size // m) ** 2, seed)
    return from_blocks(tiles.abs(), size, size)


def _applicable(method: str, m: int) -> bool:
    limit = METHODS[method].max_m
    return limit is None or m <= limit


def run_quality(cfg: BenchConfig, progress: Progress) -> list[QualityRow]:
    rows: list[QualityRow] = []
    for pat in cfg.patterns:
        tiles = sample_real_tiles(cfg.model_dir, pat.m, cfg.tiles, cfg.seed).to(cfg.device)
        for kind in SCORE_KINDS:
            scores = _as_matrix(_scores(tiles, kind))
            progress(f"quality {pat} {_SCORE_LABEL[kind]}: exact on {tiles.shape[0]} tiles")
            ref = solve(scores, pat.n, pat.m, "exact")
            opt = ref.block_objective
            for method in cfg.methods:
                if not _applicable(method, pat.m):
                    continue
                progress(f"quality {pat} {_SCORE_LABEL[kind]}: {method}")
                res = ref if method == "exact" else solve(scores, pat.n, pat.m, method)
                rel = ((opt - res.block_objective) / opt.clamp_min(1e-300)).clamp_min(0)
                gap = (res.block_upper_bound - res.block_objective) / res.block_upper_bound.clamp_min(1e-300)
                holds = bool((res.block_upper_bound >= opt * (1 - 1e-9) - 1e-12).all())
                rows.append(
                    QualityRow(
                        pattern=str(pat),
                        score=_SCORE_LABEL[kind],
                        method=method,
                        tiles=int(opt.numel()),
                        mean_rel_error=float(rel.mean()),
                        max_rel_error=float(rel.max()),
                        optimal_share=float((rel <= 1e-9).double().mean()),
                        mean_certified_gap=float(gap.mean()),
                        bound_holds=holds,
                        seconds=res.seconds,
                    )
                )
    return rows


def _timed_solve(scores: torch.Tensor, pat: SparsityPattern, method: str, **kw: object) -> SolveResult:
    return solve(scores, pat.n, pat.m, method, **kw)  # type: ignore[arg-type]


def run_timing(cfg: BenchConfig, progress: Progress) -> tuple[list[TimingRow], list[WarmRow]]:
    timing: list[TimingRow] = []
    warm: list[WarmRow] = []
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    for pat in cfg.time_patterns:
        scores = real_matrix(cfg.model_dir, cfg.time_size, pat.m, cfg.seed).to(cfg.device)
        methods = [m for m in cfg.time_methods if _applicable(m, pat.m)]
        # Warm up lazy initialization (compiled kernels, thread pools) outside the timed calls.
        for method in methods:
            solve(scores[: pat.m * 4, : pat.m * 4], pat.n, pat.m, method)
        # Round-robin repeats, minimum time kept: a burst of load from a neighbour then slows one
        # repeat of one method instead of biasing the ratios (the masks are identical every repeat).
        results: dict[str, SolveResult] = {}
        seconds: dict[str, float] = {}
        for rep in range(cfg.repeats):
            for method in methods:
                progress(f"timing {pat} {cfg.time_size}x{cfg.time_size}: {method} ({rep + 1}/{cfg.repeats})")
                results[method] = _timed_solve(scores, pat, method)
                seconds[method] = min(seconds.get(method, float("inf")), results[method].seconds)
        best = max(r.objective for r in results.values())
        for method, r in results.items():
            timing.append(
                TimingRow(str(pat), cfg.time_size, method, seconds[method], r.objective, 1 - r.objective / best, r.gap)
            )
        noise = 1 + 0.01 * torch.randn(scores.shape, generator=gen).to(scores)
        perturbed = (scores * noise).abs()
        for method in [m for m in methods if METHODS[m].supports_init and METHODS[m].choose is None]:
            cold_s, warm_s = float("inf"), float("inf")
            for rep in range(cfg.repeats):
                progress(f"warm start {pat} {method}: 1% relative noise ({rep + 1}/{cfg.repeats})")
                cold = _timed_solve(perturbed, pat, method)
                hot = _timed_solve(perturbed, pat, method, init=results[method])
                cold_s, warm_s = min(cold_s, cold.seconds), min(warm_s, hot.seconds)
            warm.append(
                WarmRow(
                    pattern=str(pat),
                    size=cfg.time_size,
                    method=method,
                    cold_seconds=cold_s,
                    warm_seconds=warm_s,
                    speedup=cold_s / max(warm_s, 1e-9),
                    cold_objective=cold.objective,
                    warm_objective=hot.objective,
                    warm_vs_cold=hot.objective / cold.objective - 1,
                )
            )
    return timing, warm


# Fresh processes per large CPU solve: the resident-memory peak is noisy (see LargeRow).
LARGE_REPEATS = 3


def _rss_mib() -> float:
    with Path("/proc/self/statm").open() as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


class _RssSampler:
    """Polls this process's resident memory in a thread: the peak during a `with` block."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_mib())
            time.sleep(self.interval)

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mib())


def _large_child(
    model_dir: str, size: int, pattern: SparsityPattern, seed: int, method: str, queue: multiprocessing.Queue
) -> None:
    # Runs in a fresh process so the memory it reports belongs to this solve alone.
    n, m = pattern.n, pattern.m
    scores = real_matrix(Path(model_dir), size, m, seed)
    solve(scores[: m * 4, : m * 4], n, m, method)
    before = _rss_mib()
    with _RssSampler() as sampler:
        res = solve(scores, n, m, method)
    queue.put((res.seconds, scores.numel() * scores.element_size() / 2**20, max(sampler.peak - before, 0.0)))


def run_large(cfg: BenchConfig, progress: Progress) -> list[LargeRow]:
    rows: list[LargeRow] = []
    if cfg.large_size <= 0:
        return rows
    for pat in cfg.time_patterns:
        method = resolve_method("auto", torch.device(cfg.device), pat.m).name  # the default solver there
        progress(f"large {pat} {cfg.large_size}x{cfg.large_size}: {method}")
        if cfg.device.startswith("cuda"):
            scores = real_matrix(cfg.model_dir, cfg.large_size, pat.m, cfg.seed).to(cfg.device)
            solve(scores[: pat.m * 4, : pat.m * 4], pat.n, pat.m, method)
            torch.cuda.reset_peak_memory_stats(scores.device)
            base = torch.cuda.memory_allocated(scores.device)
            res = solve(scores, pat.n, pat.m, method)
            peak = (torch.cuda.max_memory_allocated(scores.device) - base) / 2**20
            rows.append(LargeRow(str(pat), cfg.large_size, method, res.seconds, scores.numel() * 4 / 2**20, peak))
            continue
        ctx = multiprocessing.get_context("spawn")
        runs: list[tuple[float, float, float]] = []  # (seconds, scores MiB, peak extra MiB) per process
        for _ in range(LARGE_REPEATS):
            queue: multiprocessing.Queue = ctx.Queue()
            proc = ctx.Process(
                target=_large_child, args=(str(cfg.model_dir), cfg.large_size, pat, cfg.seed, method, queue)
            )
            proc.start()
            runs.append(queue.get())
            proc.join()
        peaks = [peak for _, _, peak in runs]
        rows.append(
            LargeRow(
                str(pat),
                cfg.large_size,
                method,
                statistics.median(seconds for seconds, _, _ in runs),
                runs[0][1],
                statistics.median(peaks),
                min(peaks),
                max(peaks),
            )
        )
    return rows


def run_bench(cfg: BenchConfig, progress: Progress | None = None) -> BenchResult:
    progress = sink(progress)
    quality = run_quality(cfg, progress)
    timing, warm = run_timing(cfg, progress)
    large = run_large(cfg, progress)
    config = {
        "model": cfg.model_name,
        "patterns": [str(p) for p in cfg.patterns],
        "methods": list(cfg.methods),
        "tiles": cfg.tiles,
        "time_size": cfg.time_size,
        "time_patterns": [str(p) for p in cfg.time_patterns],
        "time_methods": list(cfg.time_methods),
        "large_size": cfg.large_size,
        "repeats": cfg.repeats,
        "seed": cfg.seed,
    }
    return BenchResult(environment(cfg.device), config, quality, timing, warm, large)


def _pct(x: float) -> str:
    return f"{100 * x:.4f}%"


def to_markdown(result: BenchResult) -> str:
    """The human tables: quality per pattern and score, then speed ratios, warm start, large."""
    m = result.machine
    lines = [
        f"Machine: {m['processor']}, {m['cpu_threads']} torch threads, {m['platform']}; device {m['device']}"
        + (f" ({m['gpu']})" if "gpu" in m else "")
        + f"; torch {m['torch']}; tsenor {m['tsenor']}; {m['date']}.",
        f"Model: `{result.config['model']}`; {result.config['tiles']} tiles per pattern; seed {result.config['seed']}; "
        f"timings are the minimum of {result.config.get('repeats', 1)} round-robin repeats.",
        "",
        "### Quality against `exact` (relative error = 1 − objective/optimum, per tile)",
        "",
        "| N:M | score | method | mean rel. error | max rel. error | optimal tiles | mean certified gap "
        "| bound ≥ opt |",
        "|---|---|---|---:|---:|---:|---:|:-:|",
    ]
    for r in result.quality:
        lines.append(
            f"| {r.pattern} | {r.score} | {r.method} | {_pct(r.mean_rel_error)} | {_pct(r.max_rel_error)} | "
            f"{100 * r.optimal_share:.1f}% | {_pct(r.mean_certified_gap)} | {'yes' if r.bound_holds else 'NO'} |"
        )
    lines += _timing_lines(result.timing) + _warm_lines(result.warm) + _large_lines(result.large)
    return "\n".join(lines) + "\n"


def _timing_lines(timing: Sequence[TimingRow]) -> list[str]:
    """The speed table's lines (none without timings)."""
    if not timing:
        return []
    lines = [
        "",
        "### Speed on one matrix (same process, same matrix for every method)",
        "",
        "| N:M | size | method | seconds | × faster than tsenor-reference | objective below best | certified gap |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for t_row in timing:
        ref = next(
            (t.seconds for t in timing if t.pattern == t_row.pattern and t.method == "tsenor-reference"),
            None,
        )
        ratio = f"{ref / t_row.seconds:.1f}" if ref else "–"
        lines.append(
            f"| {t_row.pattern} | {t_row.size}² | {t_row.method} | {t_row.seconds:.3f} | {ratio} | "
            f"{_pct(t_row.rel_to_best)} | {_pct(t_row.certified_gap)} |"
        )
    return lines


def _warm_lines(warm: Sequence[WarmRow]) -> list[str]:
    """The warm-start table's lines (none without warm starts)."""
    if not warm:
        return []
    lines = [
        "",
        "### Warm start (`init=` the cold result; scores × (1 + 0.01·N(0,1)))",
        "",
        "| N:M | size | method | cold s | warm s | speed-up | warm objective vs cold |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for w in warm:
        lines.append(
            f"| {w.pattern} | {w.size}² | {w.method} | {w.cold_seconds:.3f} | {w.warm_seconds:.3f} | "
            f"{w.speedup:.1f}× | "
            f"{100 * w.warm_vs_cold:+.4f}% |"
        )
    return lines


def _large_lines(large: Sequence[LargeRow]) -> list[str]:
    """The large-matrix table's lines (none without large runs)."""
    if not large:
        return []
    lines = [
        "",
        "### Large matrix",
        "",
        "| N:M | size | method | seconds | scores MiB | peak extra MiB | peak / scores | range over runs |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for g in large:
        spread = (
            "one exact count"
            if g.peak_extra_min_mib is None or g.peak_extra_max_mib is None
            else f"{g.peak_extra_min_mib / g.matrix_mib:.2f}-{g.peak_extra_max_mib / g.matrix_mib:.2f}× "
            f"({LARGE_REPEATS} processes, median shown)"
        )
        lines.append(
            f"| {g.pattern} | {g.size}² | {g.method} | {g.seconds:.2f} | {g.matrix_mib:.0f} | "
            f"{g.peak_extra_mib:.0f} | {g.peak_extra_mib / g.matrix_mib:.2f}× | {spread} |"
        )
    return lines

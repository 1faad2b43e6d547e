"""`tsenor bench moe`: what the expert stacks of a mixture-of-experts block cost, as ratios in one run.

The block is a Qwen3-MoE decoder block at tiny width (64 experts, top-8) built from the
installed transformers' config with seeded random weights; its calibration inputs are the embeddings
of random token ids, captured as `tsenor prune` captures them (`replay.capture_block_inputs`). Measured
in one process, so compare the ratios, not the seconds (shared 2-core machines):

- statistics / dense: collecting the routed statistics (Gram matrices and norms) of every expert of
  every stack (`gather.unit_input_stats` with the default options: one forward per sample, watched
  inside the experts module only, plus the every-token pass for experts below the token threshold, if
  any) against one dense forward of the block over the same samples. The default calibration
  (32 × 128 tokens, 512 routed rows per expert on average) gives every expert more rows than its input
  dimension, as a real calibration set does (128 × 2048 tokens); the count of experts that fell back is
  reported. The engine collects them group by group when pruning sequentially (a stack's inputs change
  once the stack before it is pruned); that cost, one pass per group, is given too, and so is
  `--moe-calibration all` (every token through every expert, for the statistics).
- batched / one by one: pruning every expert of the largest stack with `PrunerSpec.prune_batch` (the
  engine's path: one solver call per chunk of experts) against `prune` called once per expert.

Each time is the median of `repeats` runs; the forward and the statistics are timed in turn within
each repeat, so that a slower spell of the shared machine weighs on both.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tsenor_cli.bench.machine import environment
from tsenor_cli.errors import UsageError
from tsenor_cli.models.structure import discover_structure
from tsenor_cli.progress import Progress
from tsenor_cli.pruning.block.gather import MoeOptions, unit_input_stats
from tsenor_cli.pruning.block.observe import matrices, observe_block
from tsenor_cli.pruning.methods.method import PruneFn
from tsenor_cli.pruning.methods.registry import get_pruner
from tsenor_cli.pruning.methods.stats import ExpertStats
from tsenor_cli.pruning.methods.types import MatrixPruneConfig, SparsityPattern
from tsenor_cli.replay import block_output, capture_block_inputs, input_key

# This bench's target: the routed statistics of all experts cost at most this many dense forwards.
STATS_TARGET = 1.5


@dataclass(frozen=True)
class MoeBenchConfig:
    """experts / top_k / hidden / expert_width: the block's shape (Qwen3-MoE's `num_experts`,
    `num_experts_per_tok`, `hidden_size`, `moe_intermediate_size`); samples × seqlen: calibration tokens;
    methods: pruned batched and one by one on the largest stack with pattern n:m (transposable)."""

    experts: int = 64
    top_k: int = 8
    hidden: int = 128
    expert_width: int = 64
    samples: int = 32
    seqlen: int = 128
    methods: tuple[str, ...] = ("wanda", "sparsegpt")
    n: int = 16
    m: int = 32
    repeats: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts:
            raise UsageError(f"--top-k {self.top_k} must be between 1 and --experts {self.experts}")
        for option, width in (("--hidden", self.hidden), ("--expert-width", self.expert_width)):
            if width < self.m or width % self.m:
                raise UsageError(f"{option} {width} must be a multiple of {self.m} (the {self.n}:{self.m} pattern)")
        if not self.methods:
            raise UsageError("--methods must name at least one pruning method, e.g. wanda,sparsegpt")


@dataclass
class MoeBenchResult:
    config: MoeBenchConfig
    environment: dict[str, Any]
    dense_seconds: float = 0.0
    stats_seconds: float = 0.0
    stats_grouped_seconds: float = 0.0
    stats_all_seconds: float = 0.0
    stacks: list[str] = field(default_factory=list)
    tokens_per_expert: dict[str, float] = field(default_factory=dict)
    fallback_experts: int = 0
    prune: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def stats_ratio(self) -> float:
        return self.stats_seconds / self.dense_seconds

    @property
    def grouped_ratio(self) -> float:
        return self.stats_grouped_seconds / self.dense_seconds

    @property
    def all_ratio(self) -> float:
        return self.stats_all_seconds / self.dense_seconds

    def to_json(self) -> str:
        data = asdict(self)
        data["stats_ratio"] = self.stats_ratio
        data["stats_grouped_ratio"] = self.grouped_ratio
        data["stats_all_ratio"] = self.all_ratio
        data["stats_target"] = STATS_TARGET
        return json.dumps(data, indent=2)


def _interleaved(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """The median seconds of each of `fns`, each repeat running all of them in turn."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def _moe_block(cfg: MoeBenchConfig) -> Any:
    """A one-block Qwen3-MoE causal LM with seeded random weights, fp32, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=cfg.hidden,
        intermediate_size=cfg.expert_width * 2,
        moe_intermediate_size=cfg.expert_width,
        num_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=cfg.hidden // 4,
        vocab_size=1024,
        max_position_embeddings=max(512, cfg.seqlen),
        dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(config).eval()


def _one_by_one(prune: PruneFn, weights: torch.Tensor, stats: ExpertStats, cfg: MatrixPruneConfig) -> None:
    """weights: (E, out, in) → `prune` called once per expert with that expert's statistics."""
    for expert in range(weights.shape[0]):
        prune(weights[expert], stats.select(torch.tensor(expert)), cfg)


@torch.no_grad()
def run_moe_bench(cfg: MoeBenchConfig, progress: Progress) -> MoeBenchResult:
    """Build the block, time its dense forward, its routed statistics and batched vs per-expert pruning."""
    device = torch.device("cpu")
    model = _moe_block(cfg)
    structure = discover_structure(model)
    ids = torch.randint(0, 1024, (cfg.samples, cfg.seqlen), generator=torch.Generator().manual_seed(cfg.seed))
    captured = capture_block_inputs(structure, ids, device)
    block, call, hidden = structure.blocks[0], captured.calls[0], captured.hidden  # hidden: (S, T, H)
    seen = observe_block(block, lambda: block_output(block, call, hidden[:1]), input_key=input_key)
    stacks = {name: unit for name, unit in seen.units.items() if unit.geometry.experts}
    result = MoeBenchResult(cfg, environment(device), stacks=sorted(stacks))
    moe = MoeOptions()

    def dense() -> None:
        for j in range(hidden.shape[0]):
            block_output(block, call, hidden[j : j + 1])

    groups = [kept for group in seen.groups if (kept := [n for n in group if n in stacks])]
    found: dict[str, Any] = {}
    progress(
        f"dense forward of one {cfg.experts}-expert top-{cfg.top_k} block over {cfg.samples}×{cfg.seqlen} tokens, "
        f"then its routed statistics in one pass, in {len(groups)} passes (one per group) and under "
        "--moe-calibration all, in turn"
    )
    timed = _interleaved(
        [
            dense,
            lambda: found.update(unit_input_stats(block, stacks, hidden, call, moe)),
            lambda: [unit_input_stats(block, {n: stacks[n] for n in g}, hidden, call, moe) for g in groups],
            lambda: unit_input_stats(block, stacks, hidden, call, MoeOptions(calibration="all")),
        ],
        cfg.repeats,
    )
    result.dense_seconds, result.stats_seconds, result.stats_grouped_seconds, result.stats_all_seconds = timed
    for name in stacks:
        routed: ExpertStats = found[name].routed
        result.tokens_per_expert[name] = float(routed.tokens.float().mean())
        result.fallback_experts += len(found[name].fallback)

    largest = max(stacks, key=lambda n: stacks[n].geometry.out_features * stacks[n].geometry.in_features)
    geometry = stacks[largest].geometry
    weights = matrices(block.get_parameter(largest).data, geometry).to(torch.float32).clone()  # (E, out, in)
    stats: ExpertStats = found[largest].routed
    matrix_cfg = MatrixPruneConfig(SparsityPattern.from_nm(cfg.n, cfg.m, transposable=True))
    for method in cfg.methods:
        spec = get_pruner(method)
        progress(f"{method}: {geometry.experts} experts of {largest} batched, then one by one")
        batched, single = _interleaved(
            [
                functools.partial(spec.prune_batch, weights, stats, matrix_cfg),
                functools.partial(_one_by_one, spec.prune, weights, stats, matrix_cfg),
            ],
            cfg.repeats,
        )
        result.prune[method] = {"batched_seconds": batched, "single_seconds": single, "speedup": single / batched}
    return result


def to_markdown(result: MoeBenchResult) -> str:
    """The result as the Markdown section of docs/measurements/benchmarks-moe.md."""
    c, env = result.config, result.environment
    verdict = "meets" if result.stats_ratio <= STATS_TARGET else "misses"
    lines = [
        f"## Qwen3-MoE block: {c.experts} experts, top-{c.top_k}, hidden {c.hidden}, expert width {c.expert_width}",
        "",
        f"{c.samples}×{c.seqlen} calibration tokens, medians of {c.repeats}; {env['date']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, {env['device']} ({env['cpu_threads']} threads, load average "
        f"{env['load_average']:.1f} at the start).",
        "",
        "| what | seconds | × dense forward |",
        "| --- | ---: | ---: |",
        f"| dense forward of the block | {result.dense_seconds:.3f} | 1.00 |",
        f"| routed statistics, every stack in one pass | {result.stats_seconds:.3f} | {result.stats_ratio:.2f} |",
        f"| routed statistics, one pass per group (sequential engine) | {result.stats_grouped_seconds:.3f} | "
        f"{result.grouped_ratio:.2f} |",
        f"| every token through every expert (--moe-calibration all) | {result.stats_all_seconds:.3f} | "
        f"{result.all_ratio:.2f} |",
        "",
        f"The one-pass ratio {verdict} issue 26's target (≤ {STATS_TARGET}×). Mean routed tokens per expert: "
        + ", ".join(f"{name} {tokens:.0f}" for name, tokens in result.tokens_per_expert.items())
        + f"; experts below the threshold (every-token fallback): {result.fallback_experts}.",
        "",
        f"| method (T{c.n}:{c.m}, every expert of the largest stack) | batched s | one by one s | speedup |",
        "| --- | ---: | ---: | ---: |",
    ]
    for method, t in result.prune.items():
        lines.append(f"| {method} | {t['batched_seconds']:.3f} | {t['single_seconds']:.3f} | {t['speedup']:.2f}× |")
    return "\n".join(lines) + "\n"

"""`tsenor bench kernels`: what `--kernels sparse` buys a 2:4-pruned model, prefill and a training step.

The model is the first `blocks` decoder blocks of a published shape (`configs/models/NAME.json`, as
`tsenor bench prune` builds it) with seeded random weights in bf16, every linear of the blocks pruned
directly to a transposable 2:4 mask of its |w| (`bench.speedup.two_four_masks`; no calibration, no
method: the kernels' speed does not depend on which weights were kept). The blocks' linears are then
handed to `kernels.sparse.plan_kernels` as a checkpoint's sparsity record names them, so the bench runs
the plan, the weight checks and the installation a run does.

- prefill: the language model's forward on `tokens` tokens of random hidden states (the blocks, the
  rotary embeddings and the final norm; the embedding lookup and the output head are the same dense
  work with or without the kernels and depend on the vocabulary, so they are left out), as tokens per
  second, dense against sparse.
- training step of the MLPs: each block's MLP (the child of the block holding the linear that reads
  the intermediate width: found by shape) forward and backward on `tokens` tokens, the input gradient
  and every weight gradient; with the kernels, the compressed copies are made again inside the step,
  as a fine-tuning step does after its optimizer update. The optimizer's own update is the same in both
  and left out. The step is also timed with the compressed copies kept (the products alone: what each
  further micro-batch of an optimizer step costs under gradient accumulation, `tsenor finetune
  --grad-accum`), which splits the sparse step into its products and its compression, and gives the
  tokens per optimizer step at which the sparse step breaks even with the dense one.
- per shape: each distinct linear shape's forward product alone on `tokens` tokens, dense against sparse,
  the compression of W and of Wᵀ apart, and both in one pass by the fused kernel where it was checked for
  the shape (`kernels.sparse.fused_problem`; the MLP step uses it there), so a report shows which
  linears gain and what a refresh costs.

On a CUDA GPU the kernels are the real ones (bf16); on the CPU (the CPU mode of `make gpu-check`, toy
sizes) the same autograd function runs with the dense stand-in in fp32, so the path is exercised and
its results checked, but its times say nothing about sparse tensor cores.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tsenor_cli.bench.machine import environment
from tsenor_cli.bench.prune import build_random_model, shape_config
from tsenor_cli.bench.speedup import two_four_masks
from tsenor_cli.errors import UsageError
from tsenor_cli.kernels.sparse import STAND_IN, KernelPlan, SparseOperand, fused_operands, fused_problem, plan_kernels
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.progress import Progress, sink
from tsenor_cli.runfiles import PrunedWeight, SparsityRecord


@dataclass(frozen=True)
class KernelsConfig:
    model: str = "llama-3.1-8b"
    blocks: int = 2
    tokens: int = 8192
    scale_down: int = 1
    device: str = "cpu"
    warmup: int = 3
    repeats: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.tokens < 8 or self.warmup < 0 or self.repeats < 1:
            raise UsageError("--blocks and --repeats must be >= 1, --tokens >= 8 and --warmup >= 0")


@dataclass(frozen=True)
class KernelsResult:
    config: dict[str, Any]
    environment: dict[str, Any]
    backend: str
    line: str
    linears: int
    prefill: dict[str, float]
    graphed: dict[str, Any]
    mlp_step: dict[str, float | None]
    shapes: list[dict[str, Any]]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of one call of `fn` over `repeats` after `warmup` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    spans = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            spans.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            spans.append((time.perf_counter() - began) * 1e3)
    return statistics.median(spans)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def _pruned_model(cfg: KernelsConfig, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, SparsityRecord]:
    """(the model, its structure, the sparsity record of its blocks' linears, each pruned to transposable 2:4)."""
    from tsenor_cli.models.structure import discover_structure

    config, _ = shape_config(cfg.model, cfg.blocks, cfg.scale_down)
    model = build_random_model(config, device, dtype, cfg.seed).to(device)
    structure = discover_structure(model)
    names = {id(module): name for name, module in model.named_modules()}
    pruned = []
    with torch.no_grad():
        for block in structure.blocks:
            for module in block.modules():
                if isinstance(module, nn.Linear):
                    module.weight.mul_(two_four_masks(module.weight)["transposable"])
                    pruned.append(PrunedWeight(names[id(module)], f"{names[id(module)]}.weight"))
    pattern = SparsityPattern.from_nm(2, 4, transposable=True)
    return model, structure, SparsityRecord("magnitude", pattern, None, None, tuple(pruned), (), None)


def _mlps(structure: Any, intermediate: int) -> list[nn.Module]:
    """Each block's MLP: the block's child holding a linear that reads the intermediate width."""
    found = []
    for block in structure.blocks:
        children = [
            child
            for child in block.children()
            if any(isinstance(m, nn.Linear) and m.in_features == intermediate for m in child.modules())
        ]
        if len(children) != 1:
            raise UsageError(f"found {len(children)} MLPs in a block of this shape, not one; pass a LLaMA shape")
        found.append(children[0])
    return found


def _mlp_step(mlps: list[nn.Module], x: torch.Tensor, grad: torch.Tensor, plan: KernelPlan | None) -> Callable:
    """One MLP training step per block: forward, then the input and weight gradients (autograd.grad, so
    nothing accumulates between timed calls); with kernels, the compressed copies made first."""
    weights = [p for mlp in mlps for p in mlp.parameters()]

    def step() -> list[torch.Tensor]:
        if plan is not None:
            plan.refresh()
        out = [mlp(x) for mlp in mlps]
        return list(torch.autograd.grad(out, [x, *weights], grad_outputs=[grad] * len(out)))

    return step


def breakeven_tokens(tokens: int, dense_ms: float, kept_ms: float, compress_ms: float) -> float | None:
    """Tokens per optimizer step from which the sparse step is no slower than the dense one: k micro-batches
    of `tokens` cost k·kept + compress sparse against k·dense, equal at k = compress / (dense − kept);
    None when the products alone are no faster (never)."""
    if dense_ms <= kept_ms:
        return None
    return tokens * max(compress_ms, 0.0) / (dense_ms - kept_ms)


def _shape_rows(model: nn.Module, plan: KernelPlan, gen: torch.Generator, cfg: KernelsConfig) -> list[dict[str, Any]]:
    """Each distinct shape (out, in) of the plan's linears: the forward product on `cfg.tokens` random
    tokens dense and sparse, and the compression of W and of Wᵀ (milliseconds, medians)."""
    backend = str(plan.backend)
    weights: dict[tuple[int, int], list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        if name in plan.linears and isinstance(module, nn.Linear):
            weights.setdefault((module.out_features, module.in_features), []).append(module.weight.detach())
    return [
        {"shape": list(shape), "linears": len(found), **_time_shape(found[0], backend, gen, cfg)}
        for shape, found in weights.items()
    ]


def _time_shape(weight: torch.Tensor, backend: str, gen: torch.Generator, cfg: KernelsConfig) -> dict[str, Any]:
    """weight (out, in): its forward product on `cfg.tokens` random tokens dense and on `backend`, its
    compression and its transpose's, and both by the fused kernel (`fused`: "" where it runs, else why
    not and `compress_fused_ms` None), in milliseconds."""
    device = weight.device
    x = torch.randn(cfg.tokens, weight.shape[1], generator=gen, device=device, dtype=weight.dtype)  # (T, in)
    operand = SparseOperand(weight, backend)
    calls = {
        "dense_ms": lambda: F.linear(x, weight),
        "sparse_ms": lambda: operand.linear(x),
        "compress_ms": lambda: SparseOperand(weight, backend),
        "compress_t_ms": lambda: SparseOperand(weight.t(), backend),
    }
    timed: dict[str, Any] = {key: median_ms(call, device, cfg.warmup, cfg.repeats) for key, call in calls.items()}
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    direct = backend == "cusparselt-direct"
    timed["fused"] = fused_problem(shape, device, weight.dtype) if direct else f"not for {backend}"
    timed["compress_fused_ms"] = None
    if not timed["fused"]:
        timed["compress_fused_ms"] = median_ms(lambda: fused_operands(weight), device, cfg.warmup, cfg.repeats)
    # A call's fixed cost, host or device: the sparse product alone took 0.4-0.8 ms at every token count
    # on an H200 where the dense one took 0.04-0.38 ms (docs/measurements/gpu.md, Runs). Issued back to back, the
    # host's time per call (before synchronizing) and the wall time per call (after) tell the two apart.
    for key in ("dense", "sparse"):
        timed[f"{key}_host_ms"], timed[f"{key}_burst_ms"] = burst_ms(calls[f"{key}_ms"], device, cfg)
    return timed


def burst_ms(fn: Callable[[], object], device: torch.device, cfg: KernelsConfig) -> tuple[float, float]:
    """(host milliseconds to issue one call, wall milliseconds a call) over `cfg.repeats` calls issued back
    to back after `cfg.warmup`, synchronized once at the end."""
    for _ in range(cfg.warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    for _ in range(cfg.repeats):
        fn()
    issued = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    done = time.perf_counter()
    return (issued - began) * 1e3 / cfg.repeats, (done - began) * 1e3 / cfg.repeats


def run_kernels(cfg: KernelsConfig, progress: Progress | None = None) -> KernelsResult:
    """Prefill and MLP training step, dense then on the sparse kernels (module docstring)."""
    from tsenor_cli.models.loading import resolve_device

    say = sink(progress)
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, structure, record = _pruned_model(cfg, device, dtype)
    backend = None if device.type == "cuda" else STAND_IN
    plan = plan_kernels(model, record, device, dtype, backend=backend, training=True)
    say(plan.line())
    if plan.backend is None:
        raise UsageError(f"the sparse kernels cannot run here: {plan.line()}")
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    hidden = int(model.config.hidden_size)
    x = torch.randn(1, cfg.tokens, hidden, generator=gen, device=device, dtype=dtype)  # (1, T, H)

    def prefill() -> torch.Tensor:
        with torch.no_grad():
            return structure.base(inputs_embeds=x, use_cache=False).last_hidden_state  # (1, T, H)

    flat = x[0].detach().clone().requires_grad_(True)  # (T, H)
    grad = torch.randn(cfg.tokens, hidden, generator=gen, device=device, dtype=dtype)
    mlps = _mlps(structure, int(model.config.intermediate_size))
    say(f"{cfg.model}: {cfg.blocks} blocks, {cfg.tokens} tokens, dense")
    dense_out, dense_grads = prefill(), _mlp_step(mlps, flat, grad, None)()
    dense_ms = median_ms(prefill, device, cfg.warmup, cfg.repeats)
    dense_step_ms = median_ms(_mlp_step(mlps, flat, grad, None), device, cfg.warmup, cfg.repeats)
    installed = plan.install(model)
    say(f"{cfg.model}: the same on the sparse kernels ({installed} linears)")
    sparse_out, sparse_grads = prefill(), _mlp_step(mlps, flat, grad, plan)()
    sparse_ms = median_ms(prefill, device, cfg.warmup, cfg.repeats)
    sparse_step_ms = median_ms(_mlp_step(mlps, flat, grad, plan), device, cfg.warmup, cfg.repeats)
    # The same step with the copies of the step before kept: the products alone.
    kept_ms = median_ms(_mlp_step(mlps, flat, grad, None), device, cfg.warmup, cfg.repeats)
    step_grads = max(_rel(s, d) for s, d in zip(sparse_grads, dense_grads, strict=True))
    say(f"{cfg.model}: each linear shape alone on {cfg.tokens} tokens")
    shapes = _shape_rows(model, plan, gen, cfg)
    # The graphs last, sparse then dense: a capture that fails may leave the device unusable for the rest
    # of the process, and every other measurement is made by then.
    sparse_graphed = graphed_ms(prefill, device, cfg)
    plan.uninstall()
    failed = isinstance(sparse_graphed, str) and device.type == "cuda"
    dense_graphed = "not measured: the sparse capture failed" if failed else graphed_ms(prefill, device, cfg)
    return KernelsResult(
        config=asdict(cfg),
        environment=environment(device),
        backend=str(plan.backend),
        line=plan.line(),
        linears=installed,
        prefill={
            "dense_tokens_per_s": cfg.tokens / dense_ms * 1e3,
            "sparse_tokens_per_s": cfg.tokens / sparse_ms * 1e3,
            "speedup": dense_ms / sparse_ms,
            "rel_diff": _rel(sparse_out, dense_out),
        },
        graphed=_graphed_record(cfg.tokens, dense_graphed, sparse_graphed),
        mlp_step=_step_record(cfg.tokens, dense_step_ms, sparse_step_ms, kept_ms) | {"rel_diff": step_grads},
        shapes=shapes,
    )


def graphed_ms(fn: Callable[[], object], device: torch.device, cfg: KernelsConfig) -> float | str:
    """Median milliseconds of `fn` replayed as one CUDA graph (no host work per kernel: the prefill's
    shapes are fixed), or why it could not be captured. Warm-up runs first on a side stream, as
    torch.cuda.graph requires, so the capture sees compressed copies and searched algorithms already made."""
    if device.type != "cuda":
        return "CUDA graphs need a CUDA GPU"
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(cfg.warmup, 1)):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:
        return f"not captured: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return median_ms(graph.replay, device, cfg.warmup, cfg.repeats)


def _graphed_record(tokens: int, dense: float | str, sparse: float | str) -> dict[str, Any]:
    """The prefill replayed as CUDA graphs: tokens/s dense and sparse and their ratio, or why not."""
    if isinstance(sparse, str):
        return {"note": sparse if sparse == dense else f"sparse {sparse}"}
    if isinstance(dense, str):
        return {"note": f"dense {dense}"}
    return {
        "dense_tokens_per_s": tokens / dense * 1e3,
        "sparse_tokens_per_s": tokens / sparse * 1e3,
        "speedup": dense / sparse,
    }


def _step_record(tokens: int, dense_ms: float, sparse_ms: float, kept_ms: float) -> dict[str, float | None]:
    """The MLP step's times: dense, sparse with the copies made again, sparse with them kept (ms)."""
    return {
        "dense_ms": dense_ms,
        "sparse_ms": sparse_ms,
        "speedup": dense_ms / sparse_ms,
        "sparse_kept_ms": kept_ms,
        "kept_speedup": dense_ms / kept_ms,
        "compress_ms": sparse_ms - kept_ms,
        "breakeven_tokens": breakeven_tokens(tokens, dense_ms, kept_ms, sparse_ms - kept_ms),
    }


def to_markdown(result: KernelsResult) -> str:
    """The result as Markdown tables: the summary (prefill, the MLP step) and each linear shape alone."""
    cfg, env, pre, step = result.config, result.environment, result.prefill, result.mlp_step
    kept = step["sparse_kept_ms"]
    even = step["breakeven_tokens"]
    lines = [
        f"# --kernels sparse at the {cfg['model']} shape: {cfg['blocks']} blocks, {cfg['tokens']} tokens",
        "",
        f"- device: {env.get('gpu', env.get('device', '?'))}; torch {env.get('torch', '?')}, "
        f"cuSPARSELt {env.get('cusparselt', '–')}; {env.get('date', '')}",
        f"- {result.line}",
        f"- medians of {cfg['repeats']} calls after {cfg['warmup']} warm-up calls",
        "",
        "| what | dense | sparse | dense / sparse | largest rel. difference |",
        "|---|---:|---:|---:|---:|",
        f"| prefill tokens/s | {pre['dense_tokens_per_s']:,.0f} | {pre['sparse_tokens_per_s']:,.0f} | "
        f"{pre['speedup']:.2f} | {pre['rel_diff']:.1e} |",
        _graphed_row(result.graphed),
        f"| MLP training step ms, compressed copies made again | {step['dense_ms']:.3f} | {step['sparse_ms']:.3f} | "
        f"{step['speedup']:.2f} | {step['rel_diff']:.1e} |",
        f"| MLP training step ms, copies kept (the products alone) | {step['dense_ms']:.3f} | {kept:.3f} | "
        f"{step['kept_speedup']:.2f} | |",
        "",
        f"The compression costs {step['compress_ms']:.3f} ms a step. "
        + (
            "The sparse step is never as fast as the dense one: the products alone are no faster."
            if even is None
            else f"The sparse step is as fast as the dense one from {even:,.0f} tokens per optimizer step "
            "(`tsenor finetune --grad-accum`: the copies are made once per optimizer step)."
        ),
        "",
        "| shape (out×in) | linears | dense ms | sparse ms | dense / sparse | compress W ms | compress Wᵀ ms "
        "| both fused ms | host ms a call, dense / sparse | burst ms a call, dense / sparse |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in result.shapes:
        out_features, in_features = row["shape"]
        lines.append(
            f"| {out_features}×{in_features} | {row['linears']} | {row['dense_ms']:.3f} | {row['sparse_ms']:.3f} | "
            f"{row['dense_ms'] / row['sparse_ms']:.2f} | {row['compress_ms']:.3f} | {row['compress_t_ms']:.3f} | "
            f"{_fused_cell(row)} | {row['dense_host_ms']:.3f} / {row['sparse_host_ms']:.3f} | "
            f"{row['dense_burst_ms']:.3f} / {row['sparse_burst_ms']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _fused_cell(row: dict[str, Any]) -> str:
    """The fused compression's time, or why it did not run (rows of older results have neither)."""
    if row.get("compress_fused_ms") is not None:
        return f"{row['compress_fused_ms']:.3f}"
    return str(row.get("fused") or "–")


def _graphed_row(graphed: dict[str, Any]) -> str:
    if "note" in graphed:
        return f"| prefill tokens/s as a CUDA graph | {graphed['note']} | | | |"
    return (
        f"| prefill tokens/s as a CUDA graph | {graphed['dense_tokens_per_s']:,.0f} | "
        f"{graphed['sparse_tokens_per_s']:,.0f} | {graphed['speedup']:.2f} | |"
    )

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
  and left out.

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
from torch import nn

from tsenor_cli.bench.machine import environment
from tsenor_cli.bench.prune import build_random_model, shape_config
from tsenor_cli.bench.speedup import two_four_masks
from tsenor_cli.errors import UsageError
from tsenor_cli.kernels.sparse import STAND_IN, KernelPlan, plan_kernels
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
    mlp_step: dict[str, float]

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


def run_kernels(cfg: KernelsConfig, progress: Progress | None = None) -> KernelsResult:
    """Prefill and MLP training step, dense then on the sparse kernels (module docstring)."""
    from tsenor_cli.models.loading import resolve_device

    say = sink(progress)
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, structure, record = _pruned_model(cfg, device, dtype)
    plan = plan_kernels(model, record, device, dtype, backend=None if device.type == "cuda" else STAND_IN)
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
    plan.uninstall()
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
        mlp_step={
            "dense_ms": dense_step_ms,
            "sparse_ms": sparse_step_ms,
            "speedup": dense_step_ms / sparse_step_ms,
            "rel_diff": max(_rel(s, d) for s, d in zip(sparse_grads, dense_grads, strict=True)),
        },
    )

"""`tsenor bench speedup`: what 2:4 sparsity buys a linear layer on a GPU, dense vs ordinary vs transposable.

A linear layer's training step runs three matmuls on W (out, in) and tokens X (T, in):
Y = X·Wᵀ (forward), dX = dY·W (input gradient) and dW = dYᵀ·X (weight gradient). Sparse tensor cores
take one 2:4-sparse operand whose groups of 4 run along the reduction dimension:

- ordinary 2:4 (groups along W's rows) serves Y = X·Wᵀ only; Wᵀ is not 2:4, so dX stays dense;
- transposable 2:4 (every 4×4 tile keeps 2 per row and per column, our solver's `exhaustive` mask) makes
  Wᵀ 2:4 as well, so dX = dY·W runs on the sparse copy of Wᵀ;
- dW = dYᵀ·X has no sparse operand: every variant runs the same dense GEMM.

Sparse operands are torch's semi-structured tensors (`to_sparse_semi_structured` builds them; here the
backend classes' `from_dense` are called directly to time CUTLASS and cuSPARSELt side by side). A
transposable weight is one tensor holding W's compressed form (packed/meta) and Wᵀ's (packed_t/meta_t),
which is what `.t()` of a semi-structured tensor switches to. Every call through such a tensor pays
Python dispatch and layout handling: on the first H100 run (docs/measurements/benchmarks-speedup.md) cuSPARSELt through
`F.linear(x, semi_structured)` was 0.03–0.5× dense at 4096 tokens. So cuSPARSELt is also timed
directly (`cusparselt-direct`): the weight compressed once with `torch._cslt_compress`, the product by
`torch._cslt_sparse_mm` with `transpose_result` (Y comes out (T, out) without a copy) and the algorithm
chosen once per shape by `torch._cslt_sparse_mm_search`, outside the timing. A backend the GPU or the
torch build cannot run (torch's CUTLASS kernels need compute capability 8.x) is not timed: its cells
say why. Times are CUDA-event medians after warm-up, in bf16. Everything needing CUDA happens inside
`run_speedup`; the shape tables, masks, the backend selection and the Markdown rendering run on a CPU.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from tsenor_cli.bench.machine import environment
from tsenor_cli.errors import UsageError
from tsenor_cli.kernels.sparse import SparseOperand, backend_unavailable
from tsenor_cli.progress import Progress, sink
from tsenor_cli.solver import nm_mask, transposable_nm_mask

VARIANTS = ("dense", "ordinary", "transposable")
VARIANT_LABELS = {"dense": "dense", "ordinary": "ordinary 2:4", "transposable": "transposable 2:4"}
BACKENDS = ("cutlass", "cusparselt", "cusparselt-direct")
OPS = ("Y=XWᵀ", "dX=dY·W", "dW=dYᵀX", "MLP fwd", "MLP fwd+bwd")


@dataclass(frozen=True)
class ModelShape:
    """The linear shapes of one decoder block: hidden, intermediate and key/value widths."""

    name: str
    hidden: int
    intermediate: int
    kv: int

    def linears(self) -> dict[str, tuple[int, int]]:
        """{layer: (out_features, in_features)}, one entry per distinct shape of the block."""
        return {
            "q_proj/o_proj": (self.hidden, self.hidden),
            "k_proj/v_proj": (self.kv, self.hidden),
            "gate_proj/up_proj": (self.intermediate, self.hidden),
            "down_proj": (self.hidden, self.intermediate),
        }


# From the models' config.json: 32 heads of 64 (1B) / 128 (8B), 8 key/value heads.
MODELS: dict[str, ModelShape] = {
    "llama-3.2-1b": ModelShape("llama-3.2-1b", hidden=2048, intermediate=8192, kv=512),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", hidden=4096, intermediate=14336, kv=1024),
}


def two_four_masks(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight (out, in) → {"ordinary": 2:4 along rows, "transposable": 2:4 along rows and columns}, (out, in) bool.

    Ordinary keeps the 2 largest |w| of every 4 consecutive inputs; transposable is the optimal
    transposable 2:4 mask of |w| (enumeration of the 90 patterns per 4×4 tile).
    """
    scores = weight.abs().float()
    return {
        "ordinary": nm_mask(scores, 2, 4),
        "transposable": transposable_nm_mask(scores, 2, 4, method="exhaustive"),
    }


def is_two_four(mask: torch.Tensor) -> bool:
    """mask (R, C) bool: exactly 2 kept in every group of 4 consecutive entries of every row."""
    rows, cols = mask.shape
    return bool((mask.reshape(rows, cols // 4, 4).sum(2) == 2).all())


@dataclass(frozen=True)
class SpeedupConfig:
    models: tuple[str, ...] = tuple(MODELS)
    tokens: tuple[int, ...] = (4096, 16384)
    backends: tuple[str, ...] = BACKENDS
    warmup: int = 10
    repeats: int = 30
    inner: int = 5  # calls per timed repeat, so one event pair spans enough work
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in MODELS]
        if unknown:
            raise UsageError(f"unknown model shape(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
        bad = [b for b in self.backends if b not in BACKENDS]
        if bad or not self.backends:
            raise UsageError(f"--backends must name some of {', '.join(BACKENDS)}, got {', '.join(self.backends)}")
        if not self.tokens or any(t < 64 or t % 64 for t in self.tokens):
            raise UsageError(f"--tokens must be multiples of 64 (the sparse kernels' tile), got {self.tokens}")
        if min(self.warmup, self.repeats - 1, self.inner - 1) < 0:
            raise UsageError("--warmup must be >= 0 and --repeats, --inner >= 1")


@dataclass(frozen=True)
class Timing:
    """One measured operation. ms: median milliseconds per call; None when the backend failed (`error`).

    rel_error: ‖sparse result − dense result with the masked W‖ / ‖dense result‖, the check that the
    sparse kernel computed the same product (None for dense rows).
    """

    model: str
    layer: str
    shape: tuple[int, int]
    tokens: int
    op: str
    variant: str
    backend: str
    ms: float | None
    rel_error: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class SpeedupResult:
    config: dict[str, Any]
    timings: tuple[Timing, ...]
    environment: dict[str, Any]
    date: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    # {backend: why it was not timed on this GPU, e.g. "not available on 9.0"}
    unavailable: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "config": self.config,
                "environment": self.environment,
                "date": self.date,
                "notes": list(self.notes),
                "unavailable": self.unavailable,
                "timings": [asdict(t) for t in self.timings],
            },
            indent=2,
        )


def _semi_structured(weight: torch.Tensor, backend: str, *, with_transpose: bool) -> Any:
    """weight (out, in) bf16 CUDA, 2:4 along rows (and columns when with_transpose) → a semi-structured
    tensor holding W's compressed form and, with_transpose, Wᵀ's as packed_t/meta_t."""
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    cls = SparseSemiStructuredTensorCUTLASS if backend == "cutlass" else SparseSemiStructuredTensorCUSPARSELT
    forward = cls.from_dense(weight.contiguous())
    if not with_transpose:
        return forward
    backward = cls.from_dense(weight.t().contiguous())
    return cls(
        weight.shape,
        packed=forward.packed,
        meta=forward.meta,
        packed_t=backward.packed,
        meta_t=backward.meta,
        compressed_swizzled_bitmask=None,
    )


Op = Callable[[torch.Tensor], torch.Tensor]


def _cslt_product(weight: torch.Tensor, sample: torch.Tensor) -> Op:
    """weight (out, in) bf16 CUDA, 2:4 along rows; sample (T, in) → inp (T, in) ↦ inp·weightᵀ (T, out): the
    product `--kernels sparse` runs (`kernels.sparse.SparseOperand`: the weight compressed once,
    `torch._cslt_sparse_mm` with `transpose_result`), called once on `sample` here so that its algorithm
    search for this shape (each candidate run: seconds) happens outside every timed call."""
    operand = SparseOperand(weight, "cusparselt-direct")
    operand.linear(sample)
    return operand.linear


def _operators(
    pruned: torch.Tensor, backend: str, transposable: bool, x: torch.Tensor, dy: torch.Tensor
) -> tuple[Op, Op | None]:
    """pruned (out, in) 2:4 weight, x (T, in), dy (T, out) samples → (X ↦ X·Wᵀ, dY ↦ dY·W or None when the
    variant leaves dX dense), both on `backend`'s sparse kernels."""
    if backend == "cusparselt-direct":
        forward = _cslt_product(pruned, x)
        return forward, _cslt_product(pruned.t(), dy) if transposable else None
    sparse = _semi_structured(pruned, backend, with_transpose=transposable)
    return (lambda inp: F.linear(inp, sparse)), ((lambda grad: grad @ sparse) if transposable else None)


def available_backends(backends: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the backends this GPU and torch build run, {backend: why not} for the others)."""
    capability = torch.cuda.get_device_capability()
    unavailable = {b: why for b in backends if (why := backend_unavailable(b, capability)) is not None}
    return tuple(b for b in backends if b not in unavailable), unavailable


class _Linear(torch.autograd.Function):
    """Y = forward_op(X), dX = backward_op(dY) (each a dense or sparse product with W), dW = dYᵀ·X dense:
    one linear layer of a sparse training step."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, forward_op: Op, backward_op: Op) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.backward_op = backward_op
        return forward_op(x)  # (T, out)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        (x,) = ctx.saved_tensors
        return ctx.backward_op(dy), dy.t() @ x, None, None  # (T, in), (out, in)


def _dense_ops(weight: torch.Tensor) -> tuple[Op, Op]:
    return (lambda inp: F.linear(inp, weight)), (lambda grad: grad @ weight)


def _time(fn: Callable[[], object], cfg: SpeedupConfig) -> float:
    """Median milliseconds per call of `fn` over cfg.repeats CUDA-event spans of cfg.inner calls."""
    for _ in range(cfg.warmup):
        fn()
    spans = []
    for _ in range(cfg.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(cfg.inner):
            fn()
        end.record()
        end.synchronize()
        spans.append(start.elapsed_time(end) / cfg.inner)
    return statistics.median(spans)


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def _failure(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _layer_timings(
    linear: tuple[str, str],
    shape: tuple[int, int],
    tokens: int,
    cfg: SpeedupConfig,
    gen: torch.Generator,
    backends: tuple[str, ...],
) -> list[Timing]:
    """The three matmuls of one linear layer (`linear`: the model's name and the layer's): dense, then each
    backend × (ordinary, transposable)."""
    model, layer = linear
    out_features, in_features = shape
    device = torch.device("cuda")
    weight = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)  # (out, in)
    x = torch.randn(tokens, in_features, generator=gen, device=device, dtype=torch.bfloat16)  # (T, in)
    dy = torch.randn(tokens, out_features, generator=gen, device=device, dtype=torch.bfloat16)  # (T, out)
    masks = two_four_masks(weight)
    rows: list[Timing] = []

    def row(op: str, variant: str, backend: str, ms: float | None, **extra: Any) -> None:
        rows.append(Timing(model, layer, shape, tokens, op, variant, backend, ms, **extra))

    row("Y=XWᵀ", "dense", "cublas", _time(lambda: F.linear(x, weight), cfg))
    row("dX=dY·W", "dense", "cublas", _time(lambda: dy @ weight, cfg))
    row("dW=dYᵀX", "dense", "cublas", _time(lambda: dy.t() @ x, cfg))
    for backend in backends:
        for variant in ("ordinary", "transposable"):
            pruned = weight * masks[variant]
            ops = ("Y=XWᵀ", "dX=dY·W") if variant == "transposable" else ("Y=XWᵀ",)
            try:
                forward, backward = _operators(pruned, backend, variant == "transposable", x, dy)
                error = _rel_error(forward(x), F.linear(x, pruned))
                row("Y=XWᵀ", variant, backend, _time(partial(forward, x), cfg), rel_error=error)
                if backward is not None:
                    error = _rel_error(backward(dy), dy @ pruned)
                    row("dX=dY·W", variant, backend, _time(partial(backward, dy), cfg), rel_error=error)
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                # Recorded in the table, not hidden: e.g. a shape the kernel refuses.
                done = {r.op for r in rows if r.variant == variant and r.backend == backend}
                for op in ops:
                    if op not in done:
                        row(op, variant, backend, None, error=_failure(exc))
    return rows


def _mlp_timings(
    model: ModelShape, tokens: int, cfg: SpeedupConfig, gen: torch.Generator, backends: tuple[str, ...]
) -> list[Timing]:
    """A LLaMA MLP block, down(silu(gate(X)) · up(X)), forward and forward+backward, per variant and backend."""
    device = torch.device("cuda")
    shapes = {"gate": (model.intermediate, model.hidden), "up": (model.intermediate, model.hidden)}
    shapes["down"] = (model.hidden, model.intermediate)
    dense = {
        name: torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) * 0.02 for name, s in shapes.items()
    }
    x = torch.randn(tokens, model.hidden, generator=gen, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, model.hidden, generator=gen, device=device, dtype=torch.bfloat16)
    label = f"MLP {model.hidden}→{model.intermediate}→{model.hidden}"
    rows: list[Timing] = []

    def record(op: str, variant: str, backend: str, ms: float | None, error: str | None = None) -> None:
        shape = (model.hidden, model.intermediate)
        rows.append(Timing(model.name, label, shape, tokens, op, variant, backend, ms, error=error))

    def measure(variant: str, backend: str, weights: dict[str, torch.Tensor], ops: dict[str, tuple[Op, Op]]) -> None:
        params = {k: w.detach().requires_grad_(True) for k, w in weights.items()}

        def block() -> torch.Tensor:
            def lin(name: str, inp: torch.Tensor) -> torch.Tensor:
                out: torch.Tensor = _Linear.apply(inp, params[name], *ops[name])
                return out

            return lin("down", F.silu(lin("gate", x)) * lin("up", x))  # (T, hidden)

        def forward() -> None:
            with torch.no_grad():
                block()

        def train_step() -> None:
            # autograd.grad, not backward(): no accumulation into .grad, so only the block's own work is timed.
            torch.autograd.grad(block(), [x, *params.values()], grad_outputs=dy)

        record("MLP fwd", variant, backend, _time(forward, cfg))
        record("MLP fwd+bwd", variant, backend, _time(train_step, cfg))

    measure("dense", "cublas", dense, {n: _dense_ops(w) for n, w in dense.items()})
    # Samples of each linear's input and output gradient, for the direct path's algorithm search.
    inputs = {"gate": x.detach(), "up": x.detach()}
    inputs["down"] = torch.zeros(tokens, model.intermediate, device=device, dtype=torch.bfloat16)
    grads = {n: torch.zeros(tokens, s[0], device=device, dtype=torch.bfloat16) for n, s in shapes.items()}
    for variant in ("ordinary", "transposable"):
        pruned = {name: w * two_four_masks(w)[variant] for name, w in dense.items()}
        for backend in backends:
            try:
                ops = {}
                for n, w in pruned.items():
                    forward, backward = _operators(w, backend, variant == "transposable", inputs[n], grads[n])
                    ops[n] = (forward, backward if backward is not None else _dense_ops(w)[1])
                measure(variant, backend, pruned, ops)
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                done = {r.op for r in rows if r.variant == variant and r.backend == backend}
                for op in ("MLP fwd", "MLP fwd+bwd"):
                    if op not in done:
                        record(op, variant, backend, None, _failure(exc))
    return rows


def require_cuda() -> None:
    """UsageError unless a CUDA GPU with sparse tensor cores (compute capability 8.0+) is present."""
    if not torch.cuda.is_available():
        raise UsageError(
            "tsenor bench speedup needs a CUDA GPU (2:4 sparse tensor cores); run it on a CUDA machine (make bench-gpu)"
        )
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        raise UsageError(
            f"tsenor bench speedup needs compute capability 8.0+ for 2:4 sparse tensor cores, "
            f"this GPU has {major}.x; run it on an A100/H100-class GPU"
        )


def run_speedup(cfg: SpeedupConfig, progress: Progress | None = None) -> SpeedupResult:
    """Time every linear shape of cfg.models at cfg.tokens, and their MLP blocks (CUDA only), on the
    backends of cfg.backends this GPU runs (the others are listed in `unavailable`, not timed)."""
    require_cuda()
    backends, unavailable = available_backends(cfg.backends)
    for backend, why in unavailable.items():
        sink(progress)(f"{backend}: {why}; skipped")
    gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
    timings: list[Timing] = []
    for name in cfg.models:
        model = MODELS[name]
        for tokens in cfg.tokens:
            for layer, shape in model.linears().items():
                sink(progress)(f"{name} {layer} {shape[0]}×{shape[1]}, {tokens} tokens")
                timings += _layer_timings((name, layer), shape, tokens, cfg, gen, backends)
            sink(progress)(f"{name} MLP block, {tokens} tokens")
            timings += _mlp_timings(model, tokens, cfg, gen, backends)
            torch.cuda.empty_cache()
    return SpeedupResult(
        config=asdict(cfg),
        timings=tuple(timings),
        environment=environment("cuda" if torch.cuda.is_available() else "cpu"),
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        unavailable=unavailable,
    )


def _cell(dense_ms: float | None, timing: Timing | None) -> str:
    if timing is None:
        return "—"
    if timing.ms is None:
        return "failed"
    if dense_ms is None:
        return f"{timing.ms:.3f} ms"
    return f"{dense_ms / timing.ms:.2f}×"


def _dense_only(op: str, variant: str) -> bool:
    """Whether `variant` runs `op` as the dense GEMM by construction (no sparse operand: not measured)."""
    return op == "dW=dYᵀX" or (op == "dX=dY·W" and variant == "ordinary")


BACKEND_NOTES = {
    "cusparselt": "cusparselt: cuSPARSELt through torch's semi-structured tensor (`F.linear(x, W_sparse)`, "
    "`dY @ W_sparse`), as a model calls it; each call pays Python dispatch and layout handling.",
    "cusparselt-direct": "cusparselt-direct: the cuSPARSELt kernel itself, `torch._cslt_sparse_mm` on the weight "
    "compressed once (`torch._cslt_compress`) with `transpose_result=True`, the algorithm chosen once per shape "
    "by `torch._cslt_sparse_mm_search` outside the timing.",
    "cutlass": "cutlass: torch's CUTLASS semi-structured kernels (compute capability 8.x only).",
}


def _header(result: SpeedupResult) -> list[str]:
    env, cfg = result.environment, result.config
    lines = [
        "# 2:4 sparse matmul speedups: dense vs ordinary vs transposable",
        "",
        "Written by `tsenor bench speedup` (`make bench-gpu`); every number below comes from that run.",
        "",
        f"- device: {env.get('gpu', env.get('device', '?'))} "
        f"(compute capability {env.get('compute_capability', '?')}); "
        f"torch {env['torch']}, CUDA {env.get('cuda', 'none')}, cuSPARSELt {env.get('cusparselt', '?')}; {result.date}",
        f"- bf16, random weights and activations; CUDA-event median of {cfg['repeats']} spans of "
        f"{cfg['inner']} calls after {cfg['warmup']} warm-up calls",
        "- speedup = dense time / sparse time (>1 is faster). Ordinary 2:4 can only make Y = X·Wᵀ sparse: "
        "its Wᵀ is not 2:4, so dX = dY·W stays dense (1.00× by construction, not measured). "
        "Transposable 2:4 also runs dX = dY·W on the sparse Wᵀ (packed_t/meta_t). dW = dYᵀ·X has no "
        "sparse operand: the same dense GEMM in every variant.",
        "- MLP block: gate/up/down linears with SiLU, forward (no grad) and forward+backward (dX and the "
        "three dW), through the same kernels.",
        "- **M > 4 has no tensor-core path today**: sparse tensor cores (Ampere, Hopper) take 2:4 only, so "
        "16:32 (transposable or not) buys accuracy, not speed, on current GPUs; only 2:4 is timed here.",
    ]
    lines += [f"- {BACKEND_NOTES[b]}" for b in cfg["backends"] if b in BACKEND_NOTES]
    lines += [f"- {backend} not timed: {why}." for backend, why in result.unavailable.items()]
    lines += [f"- {note}" for note in result.notes]
    return [*lines, ""]


def to_markdown(result: SpeedupResult) -> str:
    """One table per model: rows = (layer, tokens, op), columns = dense ms and each variant's speedup
    per backend (a backend this GPU cannot run says why in its cells)."""
    backends = tuple(result.config["backends"])
    by_key = {(t.model, t.layer, t.tokens, t.op, t.variant, t.backend): t for t in result.timings}
    lines = _header(result)
    failures = [t for t in result.timings if t.error]
    for model in result.config["models"]:
        head = ["layer (out×in)", "tokens", "op", "dense"]
        for backend in backends:
            head += [f"ordinary ({backend})", f"transposable ({backend})"]
        lines += [f"## {model}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        keys = dict.fromkeys((t.layer, t.shape, t.tokens) for t in result.timings if t.model == model)
        for layer, shape, tokens in keys:
            for op in OPS:
                dense = by_key.get((model, layer, tokens, op, "dense", "cublas"))
                if dense is None:
                    continue
                cells = [f"{layer} ({shape[0]}×{shape[1]})", str(tokens), op, _cell(None, dense)]
                for backend in backends:
                    for variant in ("ordinary", "transposable"):
                        if _dense_only(op, variant):
                            cells.append("= dense")
                        elif backend in result.unavailable:
                            cells.append(result.unavailable[backend])
                        else:
                            cells.append(_cell(dense.ms, by_key.get((model, layer, tokens, op, variant, backend))))
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if failures:
        lines += ["## Failed measurements", ""]
        lines += [f"- {t.model} {t.layer} {t.tokens} {t.op} {t.variant} ({t.backend}): {t.error}" for t in failures]
        lines.append("")
    checked = [t.rel_error for t in result.timings if t.rel_error is not None]
    if checked:
        lines.append(
            f"Every sparse product was checked against the dense product with the same masked weight: "
            f"largest relative difference {max(checked):.2e} (bf16 rounding)."
        )
    return "\n".join(lines) + "\n"

"""The 2:4-pruned linears of a model on the GPU's 2:4 sparse tensor cores (`--kernels sparse`).

A linear layer's training step runs three products on W (out, in) and tokens X (T, in): Y = X·Wᵀ,
dX = dY·W and dW = dYᵀ·X. Sparse tensor cores take one operand whose rows keep at most 2 of every 4
consecutive entries. W is such an operand when its mask is 2:4, so Y runs sparse; Wᵀ is one only when
the mask is also 2:4 along W's columns, which is what a transposable mask guarantees (every 4×4 tile
keeps 2 per row and per column, paper Section 1): then dX = dY·W runs on Wᵀ's compressed form, the same
mask, with no second pruning. dW has no sparse operand and stays dense; the pruned positions of its
result are zeroed by `fixedmask.FixedMask`'s gradient hook, as in dense training.

Which linears: the checkpoint's sparsity record (`runfiles.read_sparsity`) names the pruned matrices
and their pattern; those that are nn.Linear weights of a 2:4 pattern, with a shape the kernel takes,
are chosen (`plan_kernels`), and each one's weights are checked to be 2:4 (along columns too when
transposable) when its kernel is installed (`KernelPlan.install`), never assumed from names. Anything
else (another pattern, a CPU, an old GPU, fp32 weights) runs dense, and `KernelPlan.line` says so in
one line.

Backends: cuSPARSELt called directly (`torch._cslt_compress` once per weight, `torch._cslt_sparse_mm`
per product), where torch has it: through torch's semi-structured tensor each call pays Python
dispatch and layout handling, measured at 0.07-0.9× dense on an H100 (tsenor bench speedup,
docs/measurements/gpu.md), which would undo the speedup; else CUTLASS through
`torch.sparse.SparseSemiStructuredTensorCUTLASS` (compute capability 8.x). A third, `STAND_IN`, runs the
same autograd function with dense products on a copy of the weights: the CPU tests and the CPU mode of
`make gpu-check` check the function's math with it, never a user's run.

The compressed copies are made from the weights once and reused, so whoever changes the weights
(an optimizer step, a checkpoint loaded into them) calls `KernelPlan.refresh` (finetune's MaskCallback
does, after each step's mask). A training step therefore pays the compression of W and of Wᵀ again:
cuSPARSELt's own took 42% of a sparse 8B MLP step's CUDA time on an H200, with Wᵀ's transposed copies
another 6% (docs/measurements/gpu.md, Runs). For a transposable mask on cuSPARSELt, torch's fused 2:4
tile kernel makes both copies in one pass over W instead (`fused_operands`), for each shape where it
was checked, once in the process, to write the same bytes as cuSPARSELt's compression (`fused_problem`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tsenor_cli.errors import VerificationError
from tsenor_cli.runfiles import SparsityRecord

STAND_IN = "dense-stand-in"
KERNEL_BACKENDS = ("cusparselt-direct", "cutlass")
BACKEND_NAMES = {"cusparselt-direct": "cuSPARSELt", "cutlass": "CUTLASS", STAND_IN: "a dense stand-in"}
# The torch ops the direct cuSPARSELt path calls (`torch.X` attributes; absent from some builds).
CSLT_OPS = ("_cslt_compress", "_cslt_sparse_mm", "_cslt_sparse_mm_search")
# The 16-bit dtypes the sparse tensor cores take (cuSPARSELt's fp32 is not offered by torch).
SPARSE_DTYPES = (torch.bfloat16, torch.float16)
# The sparse operand's (rows, columns) must be multiples of these for 16-bit values: torch.sparse's
# shape constraints of SparseSemiStructuredTensorCUSPARSELT and ...CUTLASS; the stand-in takes groups of 4.
SPARSE_TILE = {"cusparselt-direct": (16, 16), "cutlass": (32, 64), STAND_IN: (1, 4)}
# The dense operand's rows (the tokens) are padded to a multiple of 8, the same constraints' dense minimum.
TOKEN_MULTIPLE = 8


def backend_unavailable(backend: str, capability: tuple[int, int]) -> str | None:
    """Why `backend` (a `tsenor bench speedup` backend: cutlass, cusparselt, cusparselt-direct) cannot run
    on a GPU of compute `capability` with this torch build, or None."""
    major, minor = capability
    if backend == "cutlass" and major != 8:
        # torch's CUTLASS semi-structured kernels: "Supported only on GPUs with compute capability 8.x"
        # (every CUTLASS row failed so on the H100, 9.0: docs/measurements/benchmarks-speedup.md).
        return f"not available on {major}.{minor}"
    if backend.startswith("cusparselt") and not torch.backends.cusparselt.is_available():
        return "not available (no cuSPARSELt in this torch)"
    if backend == "cusparselt-direct" and not all(hasattr(torch, op) for op in CSLT_OPS):
        return f"not available (torch {torch.__version__} lacks torch._cslt_*)"
    return None


def cuda_backend(device: torch.device) -> tuple[str | None, str]:
    """(the kernel backend that runs 2:4 products on `device`, "") or (None, why none does)."""
    if device.type != "cuda":
        return None, f"the model runs on the {device.type}; 2:4 sparse tensor cores are a CUDA GPU's"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return None, f"this GPU (compute capability {major}.{minor}) has no 2:4 sparse tensor cores (8.0 or later)"
    for backend in KERNEL_BACKENDS:
        if backend_unavailable(backend, (major, minor)) is None:
            return backend, ""
    return None, f"this torch {torch.__version__} has no cuSPARSELt, and CUTLASS's 2:4 kernels need a GPU of 8.x"


# cuSPARSELt's algorithm for each product shape, searched on first use and kept for the process:
# {(device, dtype, A's rows, A's columns, padded tokens rounded up to a power of two): alg_id}; the
# tokens by powers of two so that inputs of many lengths (lm-eval's documents) search a few times, not
# once per length. The default algorithm (0) left the 8B
# MLP training step at 0.59x dense and prefill at 0.84x on an H200, 0.68x and 0.97x with the searched one
# (docs/measurements/gpu.md, Runs). Shared by every linear of a shape and kept across `refresh`: the
# search runs each candidate algorithm (0.5 s for the 8B MLP's shapes), far more than a product costs.
_ALGORITHMS: dict[tuple[str, torch.dtype, int, int, int], int] = {}


def cslt_algorithm(packed: torch.Tensor, shape: tuple[int, int], dense: torch.Tensor) -> int:
    """The searched cuSPARSELt algorithm for the compressed A of `shape` (r, c) times `dense`ᵀ, dense (T', c)."""
    key = (str(dense.device), dense.dtype, shape[0], shape[1], 1 << (int(dense.shape[0]) - 1).bit_length())
    if key not in _ALGORITHMS:
        _ALGORITHMS[key] = int(torch._cslt_sparse_mm_search(packed, dense.t(), transpose_result=True))
    return _ALGORITHMS[key]


class SparseOperand:
    """A matrix A (r, c) keeping at most 2 of every 4 consecutive entries of each row, compressed once
    for `backend`: `linear(y)` is y·Aᵀ (T, r) for y (T, c), in A's dtype. `compressed`: A's compressed
    form made elsewhere (cuSPARSELt's, by `fused_operands`), taken as it is."""

    def __init__(self, matrix: torch.Tensor, backend: str, *, compressed: torch.Tensor | None = None) -> None:
        self.backend = backend
        self.shape = (int(matrix.shape[0]), int(matrix.shape[1]))
        if compressed is not None:
            self.data: torch.Tensor = compressed
            return
        dense = matrix.detach().contiguous()
        if backend == "cusparselt-direct":
            self.data = torch._cslt_compress(dense)
        elif backend == "cutlass":
            from torch.sparse import SparseSemiStructuredTensorCUTLASS

            self.data = SparseSemiStructuredTensorCUTLASS.from_dense(dense)
        else:
            # A copy, not a view: a weight changed after compression is seen only after a refresh, as with
            # the real kernels, so a test of the stand-in catches a missing refresh.
            self.data = dense.clone()

    def linear(self, y: torch.Tensor) -> torch.Tensor:
        if self.backend != "cusparselt-direct":
            return F.linear(y, self.data)  # the CUTLASS tensor pads the tokens itself
        tokens = y.shape[0]
        pad = -tokens % TOKEN_MULTIPLE
        dense = F.pad(y, (0, 0, 0, pad)) if pad else y.contiguous()  # (T', c)
        # (A·yᵀ)ᵀ = y·Aᵀ, written (T', r) by the kernel itself (transpose_result), no copy.
        alg = cslt_algorithm(self.data, self.shape, dense)
        out = torch._cslt_sparse_mm(self.data, dense.t(), transpose_result=True, alg_id=alg)
        return out[:tokens] if pad else out


# torch's fused 2:4 tile kernel (the op behind torch.sparse's semi-structured training path): one pass
# over W writes cuSPARSELt's compressed forms of W and of Wᵀ. Within each aligned 4×4 tile it keeps
# values greedily from the largest |w| while their row and column hold fewer than 2: on the weights of a
# transposable 2:4 mask (at most 2 non-zeros per row and per column of every tile) it keeps every
# non-zero before any zero is reached, so it compresses those weights exactly; it is used for nothing else.
FUSED_OP = "_sparse_semi_structured_tile"
FUSED_ALGORITHM = "largest_abs_values_greedy"
# Its cuSPARSELt layout takes rows and columns that are multiples of 128 (torch's own check).
FUSED_MULTIPLE = 128
# That layout is torch's reconstruction of cuSPARSELt's format, not cuSPARSELt's API, so each
# (device, dtype, rows, columns) is checked once a process against cuSPARSELt's compression of a probe
# (`_check_fused`): {key: "" when the bytes are equal, else why the fused kernel is not used}.
_FUSED: dict[tuple[str, torch.dtype, int, int], str] = {}


def tile_patterns() -> torch.Tensor:
    """(90, 4, 4) bool: every 4×4 tile that keeps 2 entries in each row and 2 in each column."""
    pairs = torch.tensor(list(itertools.combinations(range(4), 2)))  # (6, 2): the rows' kept columns
    rows = torch.zeros(6, 4, dtype=torch.bool).scatter_(1, pairs, True)  # (6, 4)
    tiles = rows[torch.cartesian_prod(*[torch.arange(6)] * 4)]  # (1296, 4, 4): 2 per row
    return tiles[(tiles.sum(1) == 2).all(1)]


def transposable_probe(shape: tuple[int, int], device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A seeded (r, c) matrix, r and c multiples of 4, whose aligned 4×4 tiles each keep one of the 90
    transposable 2:4 patterns at random, with kept values of |v| in [0.5, 1.5): every pattern's
    metadata is exercised and no kept value is zero (a zero could be stored in another slot)."""
    rows, cols = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    patterns = tile_patterns().to(device)
    chosen = patterns[torch.randint(len(patterns), (rows // 4, cols // 4), generator=gen, device=device)]
    mask = chosen.permute(0, 2, 1, 3).reshape(rows, cols)  # (r/4, 4, c/4, 4) → (r, c)
    values = torch.rand(rows, cols, generator=gen, device=device) + 0.5
    signs = torch.randint(2, (rows, cols), generator=gen, device=device) * 2 - 1
    return (values * signs * mask).to(dtype)


def fused_compress(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """matrix (r, c), contiguous, 2:4 along rows and along columns → (cuSPARSELt's compressed form of
    it, of its transpose), from the one fused kernel."""
    packed, _, packed_t, _, _ = getattr(torch, FUSED_OP)(matrix, algorithm=FUSED_ALGORITHM, use_cutlass=False)
    return packed, packed_t


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _check_fused(shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> str:
    probe = transposable_probe(shape, device, dtype)
    try:
        packed, packed_t = fused_compress(probe)
    except RuntimeError as exc:
        return f"torch.{FUSED_OP} failed ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    own = torch._cslt_compress(probe), torch._cslt_compress(probe.t().contiguous())
    if _same_bytes(packed, own[0]) and _same_bytes(packed_t, own[1]):
        return ""
    return "its layout differs from cuSPARSELt's compression on this GPU"


def fused_problem(shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> str:
    """Why the fused kernel does not make the cuSPARSELt copies of a transposable (r, c) weight on
    `device` in `dtype`, or "" when it does (checked once a process for each shape, `_check_fused`)."""
    rows, cols = shape
    if rows % FUSED_MULTIPLE or cols % FUSED_MULTIPLE:
        return f"a shape not in multiples of {FUSED_MULTIPLE}"
    if not hasattr(torch, FUSED_OP):
        return f"torch {torch.__version__} lacks torch.{FUSED_OP}"
    key = (str(device), dtype, rows, cols)
    if key not in _FUSED:
        _FUSED[key] = _check_fused(shape, device, dtype)
    return _FUSED[key]


def fused_operands(weight: torch.Tensor) -> tuple[SparseOperand, SparseOperand]:
    """weight (out, in) of a transposable 2:4 mask → (W's, Wᵀ's) cuSPARSELt operands from one fused pass."""
    dense = weight.detach().contiguous()
    packed, packed_t = fused_compress(dense)
    backend = "cusparselt-direct"
    return SparseOperand(dense, backend, compressed=packed), SparseOperand(dense.t(), backend, compressed=packed_t)


class LinearKernel:
    """One linear's compressed weights: W's for the forward, Wᵀ's for the input gradient when
    `transposable`, each made on first use in the dtype the layer computes in and kept until `refresh`.
    A forward whose input gradient will be wanted (training) asks for `both`: made at once by the fused
    kernel when computing in `fused` (the dtype it was checked for, or None). An evaluation never makes
    Wᵀ's copy, which it would not use."""

    def __init__(self, backend: str, transposable: bool, fused: torch.dtype | None = None) -> None:
        self.backend = backend
        self.transposable = transposable
        self.fused = fused if backend == "cusparselt-direct" and transposable else None
        self._operands: dict[tuple[bool, torch.dtype], SparseOperand] = {}

    def operand(self, weight: torch.Tensor, *, transposed: bool, both: bool = False) -> SparseOperand:
        key = (transposed, weight.dtype)
        if key not in self._operands:
            if both and weight.dtype == self.fused:
                self._operands[(False, weight.dtype)], self._operands[(True, weight.dtype)] = fused_operands(weight)
            else:
                self._operands[key] = SparseOperand(weight.t() if transposed else weight, self.backend)
        return self._operands[key]

    @property
    def compressed(self) -> tuple[bool, ...]:
        """Which compressed copies exist now: False for W's, True for Wᵀ's."""
        return tuple(sorted(transposed for transposed, _ in self._operands))

    def refresh(self) -> None:
        self._operands.clear()


class SparseLinearFunction(torch.autograd.Function):
    """Y = X·Wᵀ + b on W's compressed form; dX = dY·W on Wᵀ's compressed form when the kernel is
    transposable, else the dense product; dW = dYᵀ·X and db dense."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernel: LinearKernel,
        grad_enabled: bool,
    ) -> torch.Tensor:
        # x (T, in), weight (out, in), bias (out,) → (T, out). grad_enabled: the caller's grad mode
        # (needs_input_grad says True under no_grad too, where no backward follows).
        ctx.save_for_backward(x, weight)
        ctx.kernel = kernel
        ctx.has_bias = bias is not None
        both = kernel.transposable and grad_enabled and ctx.needs_input_grad[0]  # dX will run on Wᵀ's copy
        out = kernel.operand(weight, transposed=False, both=both).linear(x)
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        kernel: LinearKernel = ctx.kernel
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = kernel.operand(weight, transposed=True).linear(grad) if kernel.transposable else grad @ weight
        if ctx.needs_input_grad[1]:
            grad_w = grad.t() @ x  # (out, in), dense: FixedMask's hook zeroes its pruned positions
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b, None, None


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype a linear computes in: autocast's when it is on for x's device, else the weight's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


def _sparse_forward(module: nn.Linear, kernel: LinearKernel, dtypes: tuple[torch.dtype, ...]) -> Callable[..., Any]:
    """module's forward through `SparseLinearFunction`; a call in a dtype the kernel does not take (an
    fp32 evaluation of a model trained under bf16 autocast) runs the layer's own dense forward, as the
    plan's line says."""
    dense_forward = type(module).forward.__get__(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x, module.weight)
        if dtype not in dtypes:
            return dense_forward(x)
        bias = module.bias.to(dtype) if module.bias is not None else None
        flat = x.reshape(-1, x.shape[-1]).to(dtype)  # (B·S, in)
        with torch.autocast(x.device.type, enabled=False):  # the inputs are cast already
            out = SparseLinearFunction.apply(flat, module.weight.to(dtype), bias, kernel, torch.is_grad_enabled())
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


def two_four_rows(weight: torch.Tensor) -> bool:
    """weight (R, C), C a multiple of 4: at most 2 non-zeros in every 4 consecutive entries of each row."""
    rows, cols = weight.shape
    return bool(((weight.reshape(rows, cols // 4, 4) != 0).sum(2) <= 2).all())


@dataclass
class KernelPlan:
    """The linears that run on 2:4 kernels and how: backend (None: every linear dense, `reason` says
    why), {module name: whether its input gradient runs on Wᵀ's compressed form}, {module name: why a
    recorded pruned matrix stays dense}, the dtypes the kernels take and a note for the line.

    training: the kernels serve training steps, whose refreshes make W's and Wᵀ's copies again each
    optimizer step; then `install` checks the fused kernel for the transposable linears' shapes in
    `dtype` (the dtype the model computes in) and `fused` records, per linear, "" where it makes the
    copies or why not."""

    backend: str | None
    linears: Mapping[str, bool] = field(default_factory=dict)
    dense: Mapping[str, str] = field(default_factory=dict)
    reason: str = ""
    dtypes: tuple[torch.dtype, ...] = SPARSE_DTYPES
    note: str = ""
    training: bool = False
    dtype: torch.dtype | None = None
    kernels: dict[str, LinearKernel] = field(default_factory=dict)
    patched: list[nn.Module] = field(default_factory=list)
    fused: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        """The one line a run prints about its kernels."""
        if self.backend is None:
            return f"kernels: dense, not sparse: {self.reason}"
        backward = sum(self.linears.values())
        both = f", {backward} of them also for the input gradient (the transposable mask on Wᵀ)" if backward else ""
        left = Counter(self.dense.values())
        rest = f"; {len(self.dense)} pruned matrices dense ({', '.join(f'{n} {why}' for why, n in left.items())})"
        note = f"; {self.note}" if self.note else ""
        return (
            f"kernels: sparse ({BACKEND_NAMES[self.backend]}) for the forward of {len(self.linears)} "
            f"2:4-pruned linears{both}{rest if self.dense else ''}{self._fused_part()}{note}"
        )

    def _fused_part(self) -> str:
        """How a training step's copies are made, once `install` has checked the fused kernel."""
        if not self.fused:
            return ""
        done = sum(not why for why in self.fused.values())
        part = "; W and Wᵀ compressed in one pass (torch's fused 2:4 kernel, checked against cuSPARSELt's own)"
        apart = Counter(why for why in self.fused.values() if why)
        if not apart:
            return f"{part} for {done}"
        reasons = ", ".join(f"{n} {why}" for why, n in apart.items())
        return f"{part} for {done}, apart by cuSPARSELt for {sum(apart.values())} ({reasons})"

    def install(self, root: nn.Module, prefix: str = "") -> int:
        """Route each planned linear under `root` (whose own name in the model is `prefix`) through its
        kernel, after checking its weights are 2:4 (along columns too when transposable); a linear
        installed before (a streamed block read again) gets fresh compressed copies. → linears installed.

        VerificationError when a planned weight breaks 2:4: the checkpoint changed after pruning."""
        if self.backend is None:
            return 0
        count = 0
        for name, module in root.named_modules(prefix=prefix):
            if name not in self.linears or not isinstance(module, nn.Linear):
                continue
            weight = module.weight.detach()
            if not two_four_rows(weight) or (self.linears[name] and not two_four_rows(weight.t())):
                kind = "2:4 along rows and columns" if self.linears[name] else "2:4"
                raise VerificationError(
                    f"{name}: its weights are not {kind}, as the checkpoint's sparsity record says; "
                    "the checkpoint was modified after pruning (tsenor verify shows where), re-run tsenor prune"
                )
            kernel = LinearKernel(self.backend, self.linears[name], self._fused_dtype(name, weight))
            self.kernels[name] = kernel
            module.forward = _sparse_forward(module, kernel, self.dtypes)  # type: ignore[method-assign]
            self.patched.append(module)
            count += 1
        return count

    def _fused_dtype(self, name: str, weight: torch.Tensor) -> torch.dtype | None:
        """The dtype in which the fused kernel makes this linear's two copies, or None (`fused` says why)."""
        wanted = self.training and self.linears[name] and self.backend == "cusparselt-direct"
        if not wanted or self.dtype is None:
            return None
        self.fused[name] = fused_problem((int(weight.shape[0]), int(weight.shape[1])), weight.device, self.dtype)
        return None if self.fused[name] else self.dtype

    def refresh(self) -> None:
        """Drop every compressed copy: made again from the weights at the next call (after the weights changed)."""
        for kernel in self.kernels.values():
            kernel.refresh()

    def uninstall(self) -> None:
        """Every patched linear back to its own forward."""
        for module in self.patched:
            if "forward" in vars(module):
                del module.forward
        self.patched.clear()
        self.kernels.clear()


def _shape_problem(out_features: int, in_features: int, backend: str, transposable: bool) -> str | None:
    rows, cols = SPARSE_TILE[backend]
    if out_features % rows or in_features % cols:
        return f"of a shape {BACKEND_NAMES[backend]} does not take"
    if transposable and (in_features % rows or out_features % cols):
        return f"of a shape whose transpose {BACKEND_NAMES[backend]} does not take"
    return None


def plan_kernels(
    model: nn.Module,
    record: SparsityRecord | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    backend: str | None = None,
    training: bool = False,
) -> KernelPlan:
    """Which linears of `model` run on 2:4 kernels on `device` when computing in `dtype`, from the
    checkpoint's sparsity `record` (None: not a pruned checkpoint). backend: the kernel backend, by
    default the device's (`cuda_backend`); the stand-in is named by tests and CPU benchmarks only.
    training: for training steps (`KernelPlan.training`).
    The model's blocks may be on the meta device (a streamed model): only names and shapes are read."""
    if record is None:
        return KernelPlan(None, reason="the checkpoint records no sparsity (not an output of tsenor prune)")
    pattern = record.pattern
    if pattern.kind == "unstructured" or (pattern.n, pattern.m) != (2, 4):
        return KernelPlan(None, reason=f"its pattern is {pattern.label} {pattern.kind}; sparse tensor cores take 2:4")
    if backend is None:
        backend, why = cuda_backend(device)
        if backend is None:
            return KernelPlan(None, reason=why)
    dtypes = SPARSE_DTYPES if backend != STAND_IN else (dtype,)
    if dtype not in dtypes:
        name = str(dtype).removeprefix("torch.")
        return KernelPlan(None, reason=f"the model computes in {name}; the kernels take bf16 or fp16 (--dtype bf16)")
    modules = dict(model.named_modules())
    linears: dict[str, bool] = {}
    dense: dict[str, str] = {}
    for pruned in record.pruned:
        module = modules.get(pruned.name)
        if not isinstance(module, nn.Linear) or pruned.expert is not None or pruned.param != f"{pruned.name}.weight":
            dense[pruned.name] = "not nn.Linear weights"
            continue
        problem = _shape_problem(module.out_features, module.in_features, backend, pattern.transposable)
        if problem is not None:
            dense[pruned.name] = problem
            continue
        linears[pruned.name] = pattern.transposable
    if not linears:
        reasons = ", ".join(sorted(set(dense.values())))
        return KernelPlan(None, reason=f"none of its {len(record.pruned)} pruned matrices can: {reasons}")
    return KernelPlan(backend, linears, dense, dtypes=dtypes, training=training, dtype=dtype)

"""`tsenor finetune --dry-run`: what one process of a fine-tuning run will hold, before any weight is read.

The parameters come from the checkpoints' configs (the models built on the meta device, `models.loading.
meta_model`), the pruned weights from the run's sparsity record, and what the forward keeps for backward
from watching one forward of the student on the meta device at the run's micro-batch (`saved_bytes`):
shapes without storage, so a model of any size is watched in about a second. The terms and their sum are
the one memory estimate's (`pruning/block/memory.training_estimate`). The run itself prints the same
estimate before it loads the model, and refuses one that cannot fit (exit 5).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tsenor_cli.errors import DoesNotFitError, UsageError
from tsenor_cli.finetune.config import CALIBRATION_DATA, FinetuneConfig
from tsenor_cli.finetune.distill import CHUNK_BYTES, GROUP_BYTES, last_hidden
from tsenor_cli.finetune.masks import RunSparsity, read_run_sparsity
from tsenor_cli.outputs import human_bytes
from tsenor_cli.precision import warn_slow_products
from tsenor_cli.pruning.block.memory import (
    TRAINING_TERMS,
    TrainingEstimate,
    TrainingWorkload,
    available_host_bytes,
    device_present,
    device_total_bytes,
    resident_bytes,
    training_estimate,
)
from tsenor_cli.settings import RunContext

_SDPA = torch.nn.functional.scaled_dot_product_attention
_PRODUCTS = frozenset({torch.nn.functional.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm})


class _Watch(TorchFunctionMode):
    """While active, with `saved_tensors_hooks(self.pack, self.unpack)`: the storages the forward keeps for
    backward (parameters' own excepted, each storage once) and the parameters its matrix products take.

    On the meta device SDPA runs its math path, which keeps the (T, T) attention probabilities; the fused
    kernels that run on CPU and CUDA keep their inputs, their output (laid out as (B, T, heads, D)) and one
    float32 log-sum-exp per query row instead, so a call is counted as those."""

    def __init__(self, model: nn.Module, *, widen: bool = False) -> None:
        super().__init__()
        self.params = {id(p): p for p in model.parameters()}
        self.own = {id(p.untyped_storage()) for p in model.parameters()}
        self.storages: dict[int, Any] = {}
        self.widen = widen
        self.widened: set[int] = set()
        self.extra = 0
        self.products: dict[int, nn.Parameter] = {}
        self.paused = False

    def keep(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if id(storage) not in self.own:
            self.storages.setdefault(id(storage), storage)
            if self.widen and tensor.dtype in (torch.bfloat16, torch.float16):
                self.widened.add(id(storage))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.paused:
            self.keep(tensor)
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def saved(self) -> int:
        """widen: a 2-byte storage counts as the float32 one the real run keeps (`saved_bytes`)."""
        return (
            sum(storage.nbytes() * (2 if key in self.widened else 1) for key, storage in self.storages.items())
            + self.extra
        )

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _PRODUCTS:
            for arg in (*args, *kwargs.values()):
                if id(arg) in self.params:
                    self.products[id(arg)] = self.params[id(arg)]
        if func is not _SDPA:
            return func(*args, **kwargs)
        self.paused = True
        try:
            out = func(*args, **kwargs)
        finally:
            self.paused = False
        if out.dim() == 4:  # the fused kernels' layout, (B, T, heads, D) in memory: the usual transpose back
            batch, heads, length, width = out.shape  # and reshape are then views of it, as on a real device
            out = out.as_strided(out.shape, (length * heads * width, width, heads * width, 1))
        query = args[0] if args else kwargs["query"]
        for tensor in (*args[:3], *(kwargs[k] for k in ("query", "key", "value") if k in kwargs), out):
            self.keep(tensor)
        self.extra += 4 * query[..., 0].numel()  # (B, heads, T) float32 log-sum-exps
        return out


@dataclass(frozen=True)
class Watched:
    """One forward of a model watched on the meta device: saved, the bytes kept for backward (float32);
    cast, the parameters its matrix products take (what bf16 autocast copies)."""

    saved: int
    cast: int


def saved_bytes(model: nn.Module, batch: int, seqlen: int, *, distill: bool) -> Watched:
    """model: on the meta device, in train mode → what one forward of a (batch, seqlen) micro-batch keeps
    for backward (`_Watch`). distill: the output layer computes no logits (the distillation loss takes the
    last hidden states, `distill.last_hidden`; its own memory is `training_estimate`'s loss term); else
    the model's own cross-entropy runs on the logits, as Trainer's loss does."""
    try:
        return _watched(model, batch, seqlen, distill=distill)
    except RuntimeError as exc:
        # torch's meta kernel of the grouped expert product (transformers' fused experts) takes bf16 only,
        # while its CPU and CUDA kernels take the float32 a run trains: the stacks are watched in bf16 and
        # what they make counted at float32's width (equal, to the byte, to a real CPU forward's storages
        # on tiny Qwen3-MoE and Mixtral, tests/test_finetune.py).
        stacks = [p for p in model.parameters() if p.dim() == 3 and p.dtype == torch.float32]
        if not stacks:
            raise
        for p in stacks:
            p.data = p.data.to(torch.bfloat16)
        try:
            return _watched(model, batch, seqlen, distill=distill, widen=True)
        except RuntimeError:
            raise exc from None
        finally:
            for p in stacks:
                p.data = p.data.to(torch.float32)


def _watched(model: nn.Module, batch: int, seqlen: int, *, distill: bool, widen: bool = False) -> Watched:
    ids = torch.zeros(batch, seqlen, dtype=torch.long, device="meta")
    watch = _Watch(model, widen=widen)
    with watch, torch.autograd.graph.saved_tensors_hooks(watch.pack, watch.unpack), torch.enable_grad():
        if distill:
            with last_hidden(model):
                model(input_ids=ids)
        else:
            model(input_ids=ids, labels=ids)
    return Watched(watch.saved, sum(p.numel() for p in watch.products.values()))


# What makes a fine-tuning run fit, in `tsenor finetune`'s flags.
# The fix named when bf16 training would run on a device without bf16 products (`precision.py`): both commands' flags,
# as the same plan serves `tsenor finetune` and the distillation of `tsenor prune --distill-steps`.
FINETUNE_FP32 = "--dtype fp32 to tsenor finetune (--distill-dtype fp32 to tsenor prune)"
FIT_FLAGS = "pass a smaller --batch-size (a larger --grad-accum keeps the step's windows) or --seqlen"


@dataclass(frozen=True)
class FinetunePlan:
    """What the run will hold (`TrainingEstimate`), from what it was made of (`TrainingWorkload`), and
    the memory it may take here (`available`: the host's, or the CUDA device's total). unwatched: why the
    student's forward could not be watched on the meta device (then its activations are not in the
    estimate, and the plan says so), else None. before: planned before the prune (`plan_finetune`'s), its
    pruned weights an upper bound."""

    cfg: FinetuneConfig
    work: TrainingWorkload
    estimate: TrainingEstimate
    seqlen: int
    available: int | None
    unwatched: str | None = None
    before: bool = False

    @property
    def fits(self) -> bool:
        return self.available is None or self.estimate.total <= self.available

    def lines(self) -> list[str]:
        cfg, work, est = self.cfg, self.work, self.estimate
        teacher = (
            f"; teacher {cfg.teacher}: {work.teacher / 1e6:.1f}M parameters, {human_bytes(est.teacher)}"
            if cfg.teacher
            else ""
        )
        frozen = f", {work.frozen / 1e6:.1f}M frozen (--freeze-embeddings)" if work.frozen else ""
        pruned = (
            f"up to {work.pruned / 1e6:.1f}M pruned (the prune decides)"
            if self.before
            else f"{work.pruned / 1e6:.1f}M pruned"
        )
        return [
            f"fine-tuning plan of {cfg.run_dir} (nothing read but configs, nothing written)",
            f"  student: {work.params / 1e6:.1f}M parameters, {pruned}{frozen}{teacher}",
            f"  micro-batch: {cfg.batch_size} windows x {self.seqlen} tokens, {cfg.dtype}, on {cfg.device}",
            f"  memory of one process: {_parts(est)}",
            *(f"  {line}" for line in self.summary()),
        ]

    def summary(self) -> list[str]:
        """The lines the run itself prints before it loads the model: the total, and what it leaves out."""
        est = self.estimate
        room = "" if self.available is None else f" ({human_bytes(self.available)} available here)"
        missing = (
            []
            if self.unwatched is None
            else [f"activations not estimated: the forward does not run on the meta device ({self.unwatched})"]
        )
        return [
            *missing,
            f"memory: total {human_bytes(est.total)} beside the runtime's {human_bytes(est.runtime)}, "
            f"peak about {human_bytes(est.peak)}{room}",
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.cfg.run_dir),
            "batch": self.cfg.batch_size,
            "seqlen": self.seqlen,
            "dtype": self.cfg.dtype,
            "device": self.cfg.device,
            "params": self.work.params,
            "pruned": self.work.pruned,
            "frozen": self.work.frozen,
            "teacher_params": self.work.teacher,
            "memory": self.estimate.to_dict(),
            "available": self.available,
            "fits": self.fits,
            "activations_unwatched": self.unwatched,
        }

    def check(self, fix: str = FIT_FLAGS) -> None:
        """DoesNotFitError when the run's total exceeds the memory available (one line, exit 5). fix: the
        flags that would make it fit, as the command that runs it names them."""
        if self.fits:
            return
        assert self.available is not None
        raise DoesNotFitError(
            f"fine-tuning needs about {human_bytes(self.estimate.total)} ({_parts(self.estimate)}), but "
            f"{human_bytes(self.available)} are available; {fix} (nothing was written)"
        )


# How the plan names each term of `TRAINING_TERMS` (the others by their own name).
_LABELS = {
    "optimizer": "AdamW moments",
    "loss": "distillation loss",
    "allocator": "beyond the tensors (allocator, mapped files)",
}


def _parts(est: TrainingEstimate) -> str:
    """The estimate's non-zero terms for a person: "weights 513.1 MiB, gradients 513.1 MiB, ..."."""
    values = ((_LABELS.get(name, name), getattr(est, name)) for name in TRAINING_TERMS)
    return ", ".join(f"{label} {human_bytes(value)}" for label, value in values if value)


def _meta(name: str, ctx: RunContext, trust_remote_code: bool) -> Any:
    from tsenor_cli.models.loading import meta_model, read_config, resolve_source

    source, is_local = resolve_source(name, ctx)
    config = read_config(name, source, is_local, ctx, trust_remote_code=trust_remote_code)
    return meta_model(config, trust_remote_code=trust_remote_code)


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def frozen_parameters(model: nn.Module, cfg: FinetuneConfig) -> list[nn.Parameter]:
    """The parameters `cfg` keeps out of training, each once: with --freeze-embeddings the input embeddings and
    the output layer, as transformers names them (`get_input_embeddings`, `get_output_embeddings`), tied or not;
    none otherwise. A model that names neither is a UsageError (nothing would be frozen)."""
    if not cfg.freeze_embeddings:
        return []
    layers: list[Any] = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            layers.append(getattr(model, getter)())
        except (AttributeError, NotImplementedError):  # transformers' answer for a model without the layer
            layers.append(None)
    found = {id(p): p for layer in layers if layer is not None for p in layer.parameters()}
    if not found:
        raise UsageError(
            f"--freeze-embeddings: {type(model).__name__} names no input embeddings or output layer "
            "(get_input_embeddings, get_output_embeddings); drop --freeze-embeddings"
        )
    return list(found.values())


def _pruned(model: nn.Module, sparsity: RunSparsity) -> int:
    """The pruned weights the record lists: each matrix's [out, in], an expert's own slice of its stack (a
    record that names modules only: the whole parameter, once)."""
    shapes = {(w.param, w.expert): w.shape for w in sparsity.record.pruned}
    return sum(
        shape[0] * shape[1] if shape is not None else model.get_parameter(param).numel()
        for (param, _), shape in shapes.items()
    )


def plan_finetune(
    cfg: FinetuneConfig,
    ctx: RunContext,
    sparsity: RunSparsity | None = None,
    *,
    before: str | None = None,
) -> FinetunePlan:
    """The plan of `cfg` (`FinetunePlan`): the student and the teacher built from their configs on the meta
    device, one forward of the student watched (`saved_bytes`), the estimate's terms. sparsity: the run's
    recorded pattern (None: read from `cfg.run_dir`, `masks.read_run_sparsity`). before: for a run planned
    before its checkpoint is pruned (`tsenor prune --distill-steps`), the dense model whose config the student
    shares; nothing is read from `cfg.run_dir` then, and every parameter counts as pruned (the masks' bytes:
    an upper bound)."""
    seqlen = cfg.seqlen
    if before is not None:
        if cfg.data == CALIBRATION_DATA:
            raise UsageError("a distillation planned before its prune trains on text, not on --data calibration")
        student = _meta(before, ctx, cfg.trust_remote_code).train()
        pruned = _params(student)
    else:
        sparsity = sparsity if sparsity is not None else read_run_sparsity(cfg.run_dir)
        student = _meta(str(cfg.run_dir), ctx, cfg.trust_remote_code).train()
        pruned = _pruned(student, sparsity)
        seqlen = int(sparsity.report.settings["seqlen"]) if cfg.data == CALIBRATION_DATA else cfg.seqlen
    distill = cfg.teacher is not None
    try:
        watched: Watched | None = saved_bytes(student, cfg.batch_size, seqlen, distill=distill)
        unwatched = None
    except (RuntimeError, NotImplementedError) as exc:  # an op without a meta kernel (grouped expert products)
        watched, unwatched = None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    head = student.get_output_embeddings().weight
    teacher = _params(_meta(str(cfg.teacher), ctx, cfg.trust_remote_code)) if distill else 0
    work = TrainingWorkload(
        params=_params(student),
        frozen=sum(p.numel() for p in frozen_parameters(student, cfg)),
        pruned=pruned,
        teacher=teacher,
        teacher_width=2 if cfg.bf16 else 4,
        saved=watched.saved if watched is not None else 0,
        cast=watched.cast if watched is not None and cfg.bf16 else 0,
        tokens=cfg.batch_size * seqlen,
        vocab=int(head.shape[0]),
        hidden=int(head.shape[1]),
        chunk=CHUNK_BYTES if distill else 0,
        # the bf16 gradient group exists only for the output layer's own gradient
        group=min(GROUP_BYTES, 2 * cfg.batch_size * seqlen * int(head.shape[0]))
        if distill and cfg.bf16 and not cfg.freeze_embeddings
        else 0,
    )
    estimate = replace(training_estimate(work), runtime=resident_bytes())
    device = torch.device(cfg.device)
    if cfg.bf16:
        warn_slow_products(device, torch.bfloat16, ["training under bf16 autocast"], FINETUNE_FP32)
    available: int | None
    if device.type == "cpu":
        available = available_host_bytes()
    else:  # planned on a machine without the GPU (a login node): not checked
        available = device_total_bytes(device) if device_present(device) else None
    return FinetunePlan(cfg, work, estimate, seqlen, available, unwatched, before=before is not None)

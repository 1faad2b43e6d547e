"""The dry run: `plan_model(cfg, ctx) -> PrunePlan`, what a run would do without reading any weight.

The plan lists the linears and their compatibility with the pattern, and estimates the memory (host and
each rank's device, `MemoryEstimate`) and the disk (checkpoint, resume state) a run needs. `prune_model`
makes the same plan first and refuses what cannot fit; `tsenor prune --dry-run` prints it (`render.py`) and
ends as the run would (`advice.check_plan`, which names the flags that would make a refused run fit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tsenor_cli.data.calibration import STAND_IN_SEQLEN
from tsenor_cli.errors import IncompatibleModelError, UsageError
from tsenor_cli.packed.layout import MatrixPattern
from tsenor_cli.precision import NAMES, warn_slow_products
from tsenor_cli.progress import Progress, logger
from tsenor_cli.pruning.block.idle import UNKNOWN_ORIENTATION
from tsenor_cli.pruning.block.memory import (
    HostEstimate,
    MemoryEstimate,
    MethodCost,
    Workload,
    curvature_bytes,
    estimate_device_memory,
    host_estimate,
    resident_bytes,
)
from tsenor_cli.pruning.block.observe import BlockObservation
from tsenor_cli.pruning.block.outside import (
    OutsideWeight,
    outside_linears,
    selected_outside,
)
from tsenor_cli.pruning.block.slots import (
    LinearSlot,
    incompatible_slots,
    linear_slots,
    observed_slots,
)
from tsenor_cli.pruning.methods.registry import get_pruner
from tsenor_cli.pruning.methods.types import LayerRecord
from tsenor_cli.pruning.plan.probe import probe_blocks
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.pruning.settings.selection import Selection
from tsenor_cli.settings import RunContext
from tsenor_cli.solver.registry import resolve_method

if TYPE_CHECKING:
    from tsenor_cli.models.structure import ModelStructure


def reads_data(cfg: PruneConfig) -> bool:
    """Whether the run reads calibration text: its method needs data (`PrunerSpec.needs_data`), or
    `--refine block` trains each block towards the dense one's outputs on it. A magnitude prune without
    it takes no calibration pass: its blocks run on a few stand-in tokens
    (`data.calibration.stand_in_batches`) and it gathers no statistics."""
    return get_pruner(cfg.method).needs_data or cfg.refine.on or cfg.loss_aware > 0


def dtype_and_device(
    cfg: PruneConfig, ctx: RunContext | None = None, *, present: bool = True
) -> tuple[torch.dtype, torch.device]:
    """The run's dtype and this rank's device: in a distributed run `--device cuda` means the GPU of the
    rank's LOCAL_RANK (one GPU per process). present: refuse a device this machine lacks (a run);
    False for a plan, which is arithmetic and may be made on a machine without the device."""
    from tsenor_cli.models.loading import default_dtype, parse_dtype, resolve_device

    device = resolve_device(cfg.device) if present else planned_device(cfg.device)
    if ctx is not None and ctx.distributed.distributed and device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{ctx.distributed.local_rank}")
    dtype = parse_dtype(cfg.dtype)
    return (dtype if dtype is not None else default_dtype(device)), device


def planned_device(name: str) -> torch.device:
    """The device `name` names, whether or not this machine has it (UsageError for what is no device)."""
    try:
        return torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from exc


@dataclass(frozen=True)
class ProbedWeights:
    """Every weight matrix of the decoder blocks once their forwards were watched (by the run on its
    weights, or by the dry run's probe on random ones: `pruning/plan/probe.py`).

    slots: the matrices (a stack of experts is one slot), watched blocks' with orientation, experts and
    role from the watch, the others as found without running; ignored: {full name: reason} left dense by
    --ignore/--targets or by rule (routers, gates); unused: per block, the records of its parameters that
    are not matmul weights; ruled: {role: how many} of the slots left dense by rule.
    """

    slots: list[LinearSlot]
    ignored: dict[str, str]
    unused: dict[int, list[LayerRecord]]
    ruled: dict[str, int]


def probed_weights(
    structure: ModelStructure,
    static: Sequence[LinearSlot],
    observed: dict[int, BlockObservation],
    selection: Selection,
) -> ProbedWeights:
    """Slots of watched blocks take their orientation, experts and role from the watch; routers and gates
    are left dense unless a --targets pattern names them; the other patterns as for nn.Linear layers.
    selection: the plan's `--ignore`/`--targets` selection (`PrunePlan.selection`), applied to the
    watched names with the same patterns and outside names as the plan's own."""
    slots: list[LinearSlot] = []
    unused: dict[int, list[LayerRecord]] = {}
    for index in range(len(structure)):
        if index not in observed:
            slots += [s for s in static if s.block == index]
            continue
        watched = observed[index]
        seen = {s.param_name: s for s in observed_slots(structure, index, watched)}
        # nn.Linear layers that never ran keep their slot: `BlockPruner.prune` names them in its error.
        kept = list(seen.values()) + [
            s for s in static if s.block == index and s.param_name not in seen and not s.param
        ]
        slots += kept
        block = structure.blocks[index]
        in_slots = {s.param_name for s in kept}
        for name, why in watched.unused.items():
            if name not in in_slots:
                shape = tuple(block.get_parameter(name).shape)
                full = structure.full_name(index, name)
                unused.setdefault(index, []).append(
                    LayerRecord(index, full, int(shape[-2]), int(shape[-1]), "ignored", why, param=full)
                )
    names = [s.full_name for s in slots]
    ignored = selection.excluded(names)
    targeted = {n for n in names if selection.targeted(n)}
    ruled: dict[str, int] = {}
    for slot in slots:
        if slot.role != "weight" and slot.full_name not in targeted:
            ignored[slot.full_name] = f"{slot.role}, left dense (--targets {slot.full_name} prunes it)"
            ruled[slot.role] = ruled.get(slot.role, 0) + 1
    return ProbedWeights(slots, ignored, unused, ruled)


def say_ruled(plan: ProbedWeights) -> None:
    """One stderr line per kind of weight left dense by a rule."""
    ruled, unused = plan.ruled, plan.unused
    for role, count in ruled.items():
        logger.warning(
            "leaving %d %s(s) dense: routing decisions are fragile (--targets names one to prune it)", count, role
        )
    if unused:
        count = sum(len(v) for v in unused.values())
        logger.warning(
            "%d decoder weight(s) are not matmul weights of their block's forward and stay dense (see the report)",
            count,
        )


def say_slow_products(cfg: PruneConfig, dtype: torch.dtype, device: torch.device) -> None:
    """One stderr line when the run asks `device` for half-precision products it has no instructions for
    (`precision.py`: tens of times slower than float32 there): the weights' dtype, the refinement's and the
    distillation's autocast, each named by its flag with the flag that avoids it."""
    asked: dict[torch.dtype, list[tuple[str, str]]] = {}
    if dtype in (torch.bfloat16, torch.float16):
        setting = f"--dtype {cfg.dtype}" if cfg.dtype != "auto" else f"--dtype auto ({NAMES[dtype]} on {device.type})"
        asked.setdefault(dtype, []).append((setting, "--dtype fp32"))
    if cfg.refine.on and cfg.refine.dtype == "bf16":
        asked.setdefault(torch.bfloat16, []).append(("--refine-dtype bf16", "--refine-dtype fp32"))
    if cfg.distill.on and cfg.distill.dtype == "bf16":
        asked.setdefault(torch.bfloat16, []).append(("--distill-dtype bf16", "--distill-dtype fp32"))
    for half, pairs in asked.items():
        warn_slow_products(device, half, [setting for setting, _ in pairs], " ".join(fix for _, fix in pairs))


def _selection(cfg: PruneConfig, model: Any, structure: ModelStructure) -> tuple[Selection, tuple[OutsideWeight, ...]]:
    """The run's `--ignore`/`--targets` selection (made here only: `PrunePlan.selection`) and the linears
    outside the language model it selects (`PrunePlan.outside_targets`). The selection knows the module names (as
    patterns see them) of the weight matrices outside the decoder blocks (a vision tower's and projector's
    linears, the embeddings, the output head) for its error line, and which of them are selectable
    linears."""
    in_blocks = {id(m) for m in structure.blocks.modules()}
    outside = tuple(
        name
        for name, module in model.named_modules()
        if id(module) not in in_blocks and any(p.dim() >= 2 for p in module.parameters(recurse=False))
    )
    linears = outside_linears(model, structure)
    outside_targets = selected_outside(linears, cfg.targets, cfg.ignore, cfg.pattern) if cfg.targets else ()
    return Selection(tuple(cfg.ignore), tuple(cfg.targets), outside, tuple(linears)), outside_targets


def _idle_reason(structure: ModelStructure, index: int) -> str:
    """How the run prunes an nn.Linear of idle block `index` (`pruning/block/idle.py`)."""
    kind = type(structure.blocks[index]).__name__
    return f"its block ({kind}) never runs on text: calibrated on the text reaching its own forward, else by magnitude"


def _idle_dense(idle: dict[str, str], modules: frozenset[str]) -> dict[str, str]:
    """The entries of `idle` (slots of blocks the text-only forward skips) that are no nn.Linear (`modules`)."""
    return {name: reason for name, reason in idle.items() if name not in modules}


def _checkable(
    slots: Sequence[LinearSlot], dense: Sequence[dict[str, str]], observed: frozenset[str]
) -> list[LinearSlot]:
    """The slots not left dense (by any of `dense`) whose shape can be checked against the pattern now:
    the observed ones, and nn.Linear layers of more than one output (a one-output layer is a gate, left
    dense whatever its shape). The orientation and role of other matrices are found at run time."""
    return [
        s
        for s in slots
        if not any(s.full_name in reasons for reasons in dense)
        and (s.full_name in observed or (not s.param and s.out_features > 1))
    ]


@dataclass(frozen=True)
class PrunePlan:
    """What a run would do, without loading weights: layers, compatibility, memory and disk estimates (bytes).

    slots: every weight matrix of the decoder blocks (a stack of experts is one); incompatible / ignored:
    {full name: reason}; unused: the block parameters of two or more dimensions that are not matmul
    weights (records "ignored" with what read them); idle: {full name: reason} of the slots of blocks the
    text-only forward never runs, pruned (`pruning/block/idle.py`) but for those that are no nn.Linear
    (`idle_dense`: no forward shows their orientation); pending: {full name: reason} of the slots whose
    orientation and role are decided at prune time; observed: the slots the probe watched
    (`pruning/plan/probe.py`); probe_bytes: the most bytes the probe gave real storage at once (random values,
    not the checkpoint's).
    resume_bytes: the most the resume state holds at
    once (every block's parameters and two (S, T, H) hidden-state files while one replaces the other,
    each with the dense stream's too with --refine block).
    device_memory: the peak device memory of each rank (one for a single process); device_bytes: the
    largest of them; host_memory: the peak host memory of one process (`memory.HostEstimate`; a streamed
    run holds the weights outside the blocks and one block); stream: the plan is for --stream;
    outside_targets: the linears outside the language model that --targets selects (pruned by magnitude,
    `pruning/block/outside.py`). seqlen is --seqlen capped at the model's positions. selection: the
    `--ignore`/`--targets` selection with the names beside the blocks it judges (`selection.Selection`);
    the plan is the only place that makes it: the run reads `ignored` for the nn.Linear check before
    calibration, `selection` for the watched matrices, `outside_targets` for the linears outside the language
    model and `seqlen` for the calibration. What a run can take from the plan instead of recomputing
    it: sizing (the estimates' inputs, `advice.fixes` re-estimates other flags; the parameter and byte
    counts derive from it), weights (the probe's `ProbedWeights`: slots, ignored, unused, ruled; None
    without the probe), world_size (the processes it was made for), modules (the full names of the
    blocks' nn.Linear layers).
    calibrate: the run reads calibration text (`reads_data`); without it (magnitude, no --refine block)
    its blocks run on one stand-in sample of a few tokens per process (`calibration_samples`,
    `calibration_seqlen`) and the estimates hold no activations of size.
    """

    model: str
    method: str
    pattern: str
    source: str
    model_type: str
    slots: tuple[LinearSlot, ...]
    incompatible: dict[str, str]
    ignored: dict[str, str]
    seqlen: int
    nsamples: int
    device_memory: tuple[MemoryEstimate, ...]
    device: str
    dtype: str
    blocks: int
    resume_bytes: int
    host_memory: HostEstimate
    selection: Selection
    sizing: Sizing
    unused: tuple[LayerRecord, ...] = ()
    idle: dict[str, str] = field(default_factory=dict)
    pending: dict[str, str] = field(default_factory=dict)
    observed: frozenset[str] = frozenset()
    probe_bytes: int = 0
    stream: bool = False
    outside_targets: tuple[OutsideWeight, ...] = ()
    weights: ProbedWeights | None = None
    world_size: int = 1
    modules: frozenset[str] = frozenset()
    calibrate: bool = True
    packed_savings: int = 0

    @property
    def calibration_seqlen(self) -> int:
        """The tokens per sample the run's blocks run on: `seqlen` when it reads calibration text
        (`calibrate`), else the stand-in's few (`data.calibration.STAND_IN_SEQLEN`)."""
        return self.seqlen if self.calibrate else min(self.seqlen, STAND_IN_SEQLEN)

    @property
    def calibration_samples(self) -> int:
        """The samples the run's blocks run on: --nsamples when it reads calibration text (`calibrate`),
        else one stand-in sample per process (each block runs once per sample: 128 samples of a few
        tokens cost a SmolLM2 run 23 s per block, one sample under a second)."""
        return self.nsamples if self.calibrate else self.world_size

    @property
    def device_bytes(self) -> int:
        return max(estimate.total for estimate in self.device_memory)

    @property
    def params(self) -> int:
        """The model's parameters."""
        return self.sizing.params

    @property
    def width(self) -> int:
        """Bytes per element of the run's dtype."""
        return int(torch.finfo(getattr(torch, self.dtype)).bits // 8)

    @property
    def checkpoint_bytes(self) -> int:
        """The pruned checkpoint's weights: all the model's parameters in the run's dtype, less what the
        packed format saves on the matrices it prunes (`packed_savings`; 0 for a dense checkpoint)."""
        return self.params * self.width - self.packed_savings

    @property
    def cpu_bytes(self) -> int:
        """The whole model's weights in host memory (those of a load that is not streamed)."""
        return self.params * self.width

    @property
    def blocks_bytes(self) -> int:
        """Every block's parameters: what a streamed run without a resume state keeps on disk until the write."""
        return sum(self.sizing.per_block) * self.width

    @property
    def candidates(self) -> list[LinearSlot]:
        """The slots the run would prune whose shape and role are known now (the compatibility check's)."""
        return _checkable(self.slots, (self.ignored, self.idle_dense, self.pending), self.observed)

    @property
    def idle_dense(self) -> dict[str, str]:
        """{full name: reason} of the slots of idle blocks left dense: those that are no nn.Linear."""
        return _idle_dense(self.idle, self.modules)

    def verdict(self, name: str) -> tuple[str, str | None]:
        """(status, reason) of the slot or parameter `name`: "prune", "ignored" (--ignore/--targets, a
        router or gate rule), "incompatible", "idle" (no nn.Linear in an idle block, one that never runs on text),
        "not a matmul weight", "decided at prune time" (a block the probe could not watch), or "prune" (with
        a reason for an nn.Linear of a block that never runs on text: how it is pruned)."""
        for status, reasons in (
            ("ignored", self.ignored),
            ("idle", self.idle_dense),
            ("decided at prune time", self.pending),
            ("incompatible", self.incompatible),
        ):
            if name in reasons:
                return status, reasons[name]
        for record in self.unused:
            if record.name == name:
                return "not a matmul weight", record.reason
        return "prune", self.idle.get(name)

    def check_processes(self) -> None:
        """IncompatibleModelError when the plan is for several processes (--nproc, torchrun) and would prune
        a matrix that is not an nn.Linear (an expert stack, Conv1D or bare parameter): their statistics
        are not summed across ranks (`engine.BlockPruner`). Known before any work: expert stacks from the
        checkpoint's shapes, the others once the probe has watched them."""
        if self.world_size <= 1:
            return
        dense = (self.ignored, self.idle_dense, self.pending)
        for slot in self.slots:
            known = slot.experts or slot.full_name in self.observed
            linear = slot.full_name in self.modules
            if not linear and known and not any(slot.full_name in reasons for reasons in dense):
                raise IncompatibleModelError(
                    f"{slot.full_name} is not an nn.Linear (an expert stack, Conv1D or bare parameter); --nproc "
                    "prunes nn.Linear layers only: run with one process (nothing was written)"
                )

    def check_model(self, structure: ModelStructure, folder: str) -> None:
        """UsageError when a model built in memory (the Python API's) is not the model of `folder`'s
        config.json this plan was made from: another block count, or other nn.Linear layers or shapes in its
        blocks. The run takes its block count, selection and calibration length from the plan, so a model
        edited after loading (a block dropped, a layer replaced) was pruned against another model's plan
        and written under a config.json that does not describe it."""
        planned = {s.full_name: (s.out_features, s.in_features) for s in self.slots if s.full_name in self.modules}
        held = {s.full_name: (s.out_features, s.in_features) for s in linear_slots(structure) if not s.param}
        if len(structure) != self.blocks:
            what = f"{len(structure)} decoder block(s) in memory, {self.blocks} in the config"
        elif held != planned:
            name = next(n for n in sorted({*held, *planned}) if held.get(n) != planned.get(n))
            here, there = ("×".join(map(str, d[name])) if name in d else "absent" for d in (held, planned))
            what = f"{name}: {here} in memory, {there} in the config"
        else:
            return
        raise UsageError(
            f"the model in memory does not match {folder}/config.json, which the run is planned from ({what}); "
            "save it with save_pretrained and prune the saved folder"
        )


@dataclass(frozen=True)
class Sizing:
    """What the memory estimates are computed from, so the plan can estimate other settings of the same
    model (`advice.fixes`): the candidates to prune, each block's parameter count, the model's, the
    hidden size and the attention heads."""

    candidates: tuple[LinearSlot, ...]
    per_block: tuple[int, ...]
    params: int
    hidden: int
    heads: int
    vocab: int = 0  # the head's outputs, for --loss-aware's logits

    def estimate(
        self, cfg: PruneConfig, seqlen: int, device: torch.device, world_size: int
    ) -> tuple[list[MemoryEstimate], HostEstimate]:
        """(each rank's device estimate, one process's host estimate) of `cfg` at `seqlen` (capped)."""
        from tsenor_cli.models.loading import default_dtype, parse_dtype

        dtype = parse_dtype(cfg.dtype) or default_dtype(device)
        width = torch.finfo(dtype).bits // 8
        spec = get_pruner(cfg.method)
        nsamples = cfg.nsamples
        if not reads_data(cfg):  # a stand-in sample of a few tokens per process (`PrunePlan.calibration_samples`)
            nsamples, seqlen = world_size, min(seqlen, STAND_IN_SEQLEN)
        work = Workload(
            block_params=self.per_block,
            candidates=self.candidates,
            cost=MethodCost.of(spec, cfg.pattern, cfg.matrix.solver, device=device, width=width),
            nsamples=nsamples,
            seqlen=seqlen,
            hidden_size=self.hidden,
            width=width,
            heads=self.heads,
            world_size=world_size,
            device=device,
            model_params=self.params,
            offload_activations=cfg.offload_activations,
            sequential=cfg.sequential,
            refine=cfg.refine.streams,
            gathers=spec.needs_data,
            streamed=cfg.stream,
            resume=cfg.resume,
        )
        memory = estimate_device_memory(work)
        host = host_estimate(work, memory[0])  # shard_bounds gives rank 0 the most samples
        if cfg.loss_aware:
            samples = cfg.curvature_samples  # a loss-aware run reads calibration text (`reads_data`)
            rows = -(-samples // len(memory))
            outputs = sum(slot.out_features for slot in self.candidates if not slot.experts)
            pass_bytes = curvature_bytes(rows * seqlen * self.hidden * width, len(self.per_block),
                                         seqlen * self.vocab * 4, samples * outputs * 4)  # fmt: skip
            host = replace(host, curvature=pass_bytes)
        return memory, host


@dataclass(frozen=True)
class _Matrices:
    """The plan's weight matrices (`_account`); weights: the probe's `ProbedWeights`, None without it;
    modules: the full names of the blocks' nn.Linear layers."""

    slots: tuple[LinearSlot, ...]
    ignored: dict[str, str]
    unused: tuple[LayerRecord, ...] = ()
    idle: dict[str, str] = field(default_factory=dict)
    pending: dict[str, str] = field(default_factory=dict)
    observed: frozenset[str] = frozenset()
    probe_bytes: int = 0
    weights: ProbedWeights | None = None
    modules: frozenset[str] = frozenset()

    def plan_fields(self) -> dict[str, Any]:
        """These fields by name, as `PrunePlan` holds them (the same names)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _account(structure: ModelStructure, hidden: int, selection: Selection, observe: bool) -> _Matrices:
    """The weight matrices of the blocks and their fate under `selection`.

    With `observe`, one block of each kind is watched on random values (`pruning/plan/probe.py`), so the
    plan accounts for every weight matrix as the run's report does: expert stacks, Conv1D and bare
    parameters with their orientation, routers and gates left dense, parameters that are not matmul
    weights, blocks that never run on text; what the probe could not watch is "decided at prune time".
    `prune_model` plans without it (it watches the real blocks).
    """
    slots = tuple(linear_slots(structure))
    names = [s.full_name for s in slots]
    modules = frozenset(s.full_name for s in slots if not s.param)
    # The patterns first: a typo is found before the probe runs a forward.
    excluded = selection.excluded(names)
    if not observe:
        return _Matrices(slots, excluded, modules=modules)
    probe = probe_blocks(structure, hidden)
    accounted = probed_weights(structure, slots, probe.observed, selection)
    say_ruled(accounted)
    slots, ignored = tuple(accounted.slots), accounted.ignored
    unused = tuple(record for index in sorted(accounted.unused) for record in accounted.unused[index])
    idle: dict[str, str] = {}
    pending: dict[str, str] = {}
    for slot in slots:
        if slot.block in probe.idle:
            idle[slot.full_name] = UNKNOWN_ORIENTATION if slot.param else _idle_reason(structure, slot.block)
        elif slot.block in probe.pending and slot.param:
            pending[slot.full_name] = probe.pending[slot.block]
    observed = frozenset(s.full_name for s in slots if s.block in probe.observed)
    return _Matrices(slots, ignored, unused, idle, pending, observed, probe.peak_bytes, accounted, modules)


def _meta_structure(
    cfg: PruneConfig, ctx: RunContext, progress: Progress | None, *, conform: bool
) -> tuple[str, Any, Any, ModelStructure]:
    """(source, config, the model of the config on the meta device, its structure), read as `load_model`
    reads them, so the plan fails with the run's line; with `conform`, a local checkpoint whose weights
    disagree with its config.json is refused (`models/conformance.py`, from the safetensors headers: no
    weight read)."""
    from tsenor_cli.models.conformance import check_checkpoint
    from tsenor_cli.models.loading import meta_model, read_config, resolve_source
    from tsenor_cli.models.structure import discover_structure

    source, is_local = resolve_source(cfg.model, ctx, progress=progress)
    config = read_config(cfg.model, source, is_local, ctx, trust_remote_code=cfg.trust_remote_code)
    model = meta_model(config, trust_remote_code=cfg.trust_remote_code)
    structure = discover_structure(model)
    if is_local and conform:
        check_checkpoint(Path(source), model, name=cfg.model)
    return source, config, model, structure


def _sizing(model: Any, structure: Any, candidates: tuple[Any, ...], hidden: int, heads: int) -> Sizing:
    """What the estimates read of the model: its candidates, each block's and the model's parameters."""
    per_block = tuple(sum(p.numel() for p in b.parameters()) for b in structure.blocks)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = int(head.weight.shape[0]) if head is not None else 0
    return Sizing(candidates, per_block, sum(p.numel() for p in model.parameters()), hidden, heads, vocab)


def _resume_bytes(cfg: PruneConfig, params: int, seqlen: int, hidden: int, width: int, ranks: int) -> int:
    """The most the resume state holds: every block's `params` and two hidden-state files while one
    replaces the other (with --refine block the dense stream's too), of the calibration's samples or the
    stand-in's one per process (`reads_data`)."""
    rows, tokens = (cfg.nsamples, seqlen) if reads_data(cfg) else (ranks, min(seqlen, STAND_IN_SEQLEN))
    return params * width + (4 if cfg.refine.on else 2) * rows * tokens * hidden * width


def plan_model(
    cfg: PruneConfig,
    ctx: RunContext,
    progress: Progress | None = None,
    *,
    world_size: int | None = None,
    observe: bool = True,
    conform: bool = True,
) -> PrunePlan:
    """The dry-run plan, from the model built on the meta device (no weights read, nothing written).

    The structure and the linears come from the same discovery as a run; with `observe` the probe watches
    one block of each kind (`_account`). world_size: the processes the device memory is estimated for
    (default: this run's, `ctx.distributed`). The device need not be present: the plan is arithmetic
    (`planned_device`). conform: refuse a checkpoint whose weights disagree with its config.json, as its
    load would (`_meta_structure`); False for a model built in memory (`PrunePlan.check_model` checks it).
    """
    from tsenor_cli.models.loading import config_value

    dtype, device = dtype_and_device(cfg, ctx, present=False)
    say_slow_products(cfg, dtype, device)
    source, config, model, structure = _meta_structure(cfg, ctx, progress, conform=conform)
    hidden = int(config_value(config, "hidden_size"))
    selection, outside_targets = _selection(cfg, model, structure)
    found = _account(structure, hidden, selection, observe)
    idle = _idle_dense(found.idle, found.modules)
    bad = incompatible_slots(_checkable(found.slots, (found.ignored, idle, found.pending), found.observed), cfg.pattern)
    candidates = tuple(s for s in found.slots if s.full_name not in found.ignored and s.full_name not in idle)
    max_pos = config_value(config, "max_position_embeddings")
    seqlen = min(cfg.seqlen, int(max_pos)) if max_pos else cfg.seqlen
    sizing = _sizing(model, structure, candidates, hidden, int(config_value(config, "num_attention_heads") or 0))
    ranks = world_size if world_size is not None else ctx.distributed.world_size
    memory, host = sizing.estimate(cfg, seqlen, device, ranks)
    _load_solver(cfg, device)
    host = replace(host, runtime=resident_bytes())  # measured here: the model is on the meta device
    return PrunePlan(
        model=cfg.model,
        method=cfg.method,
        pattern=cfg.pattern.label,
        source=source,
        model_type=structure.model_type,
        incompatible=bad,
        seqlen=seqlen,
        nsamples=cfg.nsamples,
        device_memory=tuple(memory),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        blocks=len(structure),
        outside_targets=outside_targets,
        resume_bytes=_resume_bytes(cfg, sum(sizing.per_block), seqlen, hidden, torch.finfo(dtype).bits // 8, ranks),
        host_memory=host,
        selection=selection,
        stream=cfg.stream,
        sizing=sizing,
        world_size=ranks,
        calibrate=reads_data(cfg),
        packed_savings=_packed_savings(cfg, [s for s in candidates if s.full_name not in bad], dtype.itemsize),
        **found.plan_fields(),
    )


def _packed_savings(cfg: PruneConfig, slots: Sequence[LinearSlot], width: int) -> int:
    """Bytes a packed checkpoint (`--save-format packed`) saves on the matrices of `slots` against their
    dense bytes at `width` bytes a weight, from the format's size function (`MatrixPattern.stored_nbytes`;
    an unstructured matrix keeps its pattern's share of weights); 0 for a dense checkpoint."""
    if cfg.save_format != "packed":
        return 0
    pattern = cfg.pattern
    saved = 0
    for slot in slots:
        shape = (slot.out_features, slot.in_features)
        stored = MatrixPattern.of(pattern.kind, pattern.n, pattern.m, shape, experts=slot.experts)
        weights = slot.matrices * slot.out_features * slot.in_features
        kept = weights - slot.matrices * round(pattern.sparsity * slot.out_features * slot.in_features)
        saved += weights * width - stored.stored_nbytes(width, kept)
    return saved


def _load_solver(cfg: PruneConfig, device: torch.device) -> None:
    """Load what the run's mask solvers load at their first solve (`MethodInfo.prepare`: the exact solver's
    compiled kernels), so the runtime measured after it counts them: the fifteenth session's 16:32 recipe
    held 0.2 GB more file pages than its dry run measured, numba's and llvmlite's among them
    (docs/results.md, "Where the peak memory is"). A choosing solver (`auto`) may run one method on whole
    matrices and another on a few tiles (on CUDA: tsenor, and flow for SparseGPT's slabs and small
    experts), so both are loaded. Their compile (7 s cold on 2 cores) is then the plan's, paid once, not
    the first block's: on the H200 it sat in a one-block SparseGPT run's solver phase (12.7 s), which the
    whole-model projection counted once per block (docs/measurements/gpu.md, Runs). The methods solve
    float32 scores."""
    if cfg.pattern.kind != "transposable":
        return
    methods = [resolve_method(cfg.matrix.solver, device, cfg.pattern.m, scores) for scores in (None, 1)]
    for info in {info.name: info for info in methods}.values():
        if info.prepare is not None:
            info.prepare(torch.float32)

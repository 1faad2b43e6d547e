"""The dry run: `plan_model(cfg, ctx) -> PrunePlan`, what a run would do without reading any weight.

The plan lists the linears and their compatibility with the pattern, and estimates the memory (host and
each rank's device, `MemoryEstimate`) and the disk (checkpoint, resume state) a run needs. `prune_model`
makes the same plan first and refuses what cannot fit; `tsenor prune --dry-run` prints it (`PrunePlan.lines`)
and ends as the run would (`PrunePlan.check`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tsenor_cli.progress import Progress
from tsenor_cli.pruning.config import PruneConfig
from tsenor_cli.pruning.engine import LinearSlot, check_compatibility, incompatible_slots, linear_slots
from tsenor_cli.pruning.memory import HostEstimate, check_fits, host_estimate
from tsenor_cli.pruning.output import human_bytes
from tsenor_cli.pruning.registry import get_pruner
from tsenor_cli.pruning.selection import excluded_layers
from tsenor_cli.settings import RunContext


def dtype_and_device(cfg: PruneConfig, ctx: RunContext | None = None) -> tuple[torch.dtype, torch.device]:
    """The run's dtype and this rank's device: in a distributed run `--device cuda` means the GPU of the
    rank's LOCAL_RANK (one GPU per process)."""
    from tsenor_cli.models.loading import default_dtype, parse_dtype, resolve_device

    device = resolve_device(cfg.device)
    if ctx is not None and ctx.distributed.distributed and device.type == "cuda" and device.index is None:
        device = resolve_device(f"cuda:{ctx.distributed.local_rank}")
    dtype = parse_dtype(cfg.dtype)
    return (dtype if dtype is not None else default_dtype(device)), device


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak device memory of one rank (bytes), by what holds it.

    block: the largest decoder block's parameters; activations: this rank's calibration hidden states
    entering and leaving the block, (S_r, T, H) twice, or one sample's with --offload-activations, plus
    in a distributed run the group's linear inputs kept for the ordered sums (S_r, T, in) (on the CPU
    with --offload-activations); statistics: the input statistics (XᵀX and column norms) of a block's
    linears taken as one group, in a distributed run twice (the sums in flight to the next rank) plus one
    linear's being added; workspace: the method's buffers for the largest linear (weights, mask,
    ADMM/OBS state, damped H and its factorization).
    """

    rank: int
    block: int
    activations: int
    statistics: int
    workspace: int

    @property
    def total(self) -> int:
        return self.block + self.activations + self.statistics + self.workspace

    def to_dict(self) -> dict[str, int]:
        return {
            "rank": self.rank,
            "block": self.block,
            "activations": self.activations,
            "statistics": self.statistics,
            "workspace": self.workspace,
            "total": self.total,
        }


def estimate_device_memory(
    block_params: Sequence[int],
    candidates: Sequence[LinearSlot],
    *,
    nsamples: int,
    seqlen: int,
    hidden_size: int,
    width: int,
    needs_gram: bool,
    iterative: bool,
    world_size: int = 1,
    offload_activations: bool = False,
    sequential: bool = True,
) -> list[MemoryEstimate]:
    """One `MemoryEstimate` per rank. block_params: parameter count of each block; candidates: the linears
    to prune (at least one); width: bytes per element of the model's dtype (statistics are float32)."""
    from tsenor_cli.pruning.distributed import shard_bounds

    blocks = len(block_params)
    stats_size = [sum(s.in_features**2 + s.in_features for s in candidates if s.block == i) for i in range(blocks)]
    statistics = 4 * max(stats_size)
    kept_features = 0  # per token, the linear inputs a distributed rank keeps for one group
    if world_size > 1:
        statistics = 2 * statistics + 4 * max(s.in_features**2 + s.in_features for s in candidates)
        per_block = [sum(s.in_features for s in candidates if s.block == i) for i in range(blocks)]
        # One group's linears read one input (LLaMA's q,k,v; gate,up); without --sequential the block is
        # one group and every linear's input counts (an upper bound: shared inputs are kept once).
        kept_features = max(s.in_features for s in candidates) if sequential else max(per_block)
    biggest = max(candidates, key=lambda s: s.out_features * s.in_features)
    workspace = 4 * biggest.out_features * biggest.in_features * (8 if iterative else 3)
    if needs_gram:
        workspace += 3 * 8 * biggest.in_features**2  # damped/normalized H, its inverse or eigenvectors
    estimates = []
    for rank, (start, stop) in enumerate(shard_bounds(nsamples, world_size)):
        rows = 1 if offload_activations else stop - start
        activations = 2 * rows * seqlen * hidden_size * width  # block inputs and outputs
        if not offload_activations:
            activations += (stop - start) * seqlen * kept_features * width
        estimates.append(MemoryEstimate(rank, max(block_params) * width, activations, statistics, workspace))
    return estimates


@dataclass(frozen=True)
class PrunePlan:
    """What a run would do, without loading weights: layers, compatibility, memory and disk estimates (bytes).

    checkpoint_bytes: the pruned checkpoint's weights; resume_bytes: the most the resume state holds at
    once (every block's parameters and two (S, T, H) hidden-state files while one replaces the other).
    device_memory: the peak device memory of each rank (one for a single process); device_bytes: the
    largest of them; host_memory: the peak host memory of one process (`memory.HostEstimate`).
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
    params: int
    cpu_bytes: int
    device_memory: tuple[MemoryEstimate, ...]
    device: str
    dtype: str
    blocks: int
    checkpoint_bytes: int
    resume_bytes: int
    host_memory: HostEstimate

    @property
    def device_bytes(self) -> int:
        return max(estimate.total for estimate in self.device_memory)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "method": self.method,
            "pattern": self.pattern,
            "source": self.source,
            "model_type": self.model_type,
            "layers": [
                {
                    "name": s.full_name,
                    "shape": [s.out_features, s.in_features],
                    "compatible": s.full_name not in self.incompatible,
                    "reason": self.incompatible.get(s.full_name),
                    "ignored": self.ignored.get(s.full_name),
                }
                for s in self.slots
            ],
            "incompatible": len(self.incompatible),
            "ignored": len(self.ignored),
            "seqlen": self.seqlen,
            "nsamples": self.nsamples,
            "params": self.params,
            "estimated_cpu_bytes": self.cpu_bytes,
            "estimated_host_bytes_per_process": self.host_memory.to_dict(),
            "estimated_device_bytes": self.device_bytes,
            "estimated_device_bytes_per_rank": [estimate.to_dict() for estimate in self.device_memory],
            "estimated_checkpoint_bytes": self.checkpoint_bytes,
            "estimated_resume_state_bytes": self.resume_bytes,
            "blocks": self.blocks,
            "device": self.device,
            "dtype": self.dtype,
        }

    def lines(self, cfg: PruneConfig) -> Iterator[str]:
        """The dry run's text: the run in one line, a row per linear (shape, compatible or why not, ignored),
        the memory estimate and each rank's share of the device memory."""
        yield (
            f"plan: {cfg.method} {cfg.pattern.label} ({cfg.pattern.kind}) on {self.model} "
            f"({self.model_type}, {self.params / 1e6:.1f}M params, {self.dtype}), "
            f"calibration {cfg.calib_data} {self.nsamples}×{self.seqlen}"
        )
        yield f"{'layer':<44} {'shape':>13}  compatible"
        for slot in self.slots:
            why = self.incompatible.get(slot.full_name)
            shape = f"{slot.out_features}×{slot.in_features}"
            verdict = "yes" if why is None else "NO: " + why
            if slot.full_name in self.ignored:
                verdict = "ignored: " + self.ignored[slot.full_name]
            yield f"{slot.full_name:<44} {shape:>13}  {verdict}"
        host = self.host_memory
        several = len(self.device_memory) > 1
        yield (
            f"estimated memory: host {human_bytes(host.total)} ({host.describe()}"
            + (", in each process)" if several else ")")
            + f", {self.device} {human_bytes(self.device_bytes)} peak"
            + (" per process" if several else "")
            + (", activations offloaded" if cfg.offload_activations else "")
        )
        for estimate in self.device_memory:
            yield (
                f"  rank {estimate.rank}: {human_bytes(estimate.total)} = block {human_bytes(estimate.block)} "
                f"+ activations {human_bytes(estimate.activations)} + statistics {human_bytes(estimate.statistics)} "
                f"+ workspace {human_bytes(estimate.workspace)}"
            )

    def check(self, cfg: PruneConfig, processes: int) -> None:
        """The run's own error (its exit code too) when the run would not fit in memory (`processes` of it
        on this machine), stop on an incompatible layer or have nothing to prune, so a dry run fails where
        the run would."""
        from tsenor_cli.models.loading import resolve_device

        check_fits(
            self.host_memory,
            self.device_bytes,
            resolve_device(self.device),
            nsamples=cfg.nsamples,
            seqlen=self.seqlen,
            offload_activations=cfg.offload_activations,
            processes=processes,
        )
        candidates = [s for s in self.slots if s.full_name not in self.ignored and not s.param and s.out_features > 1]
        check_compatibility(candidates, cfg.pattern, skip=cfg.skip_incompatible)


def plan_model(
    cfg: PruneConfig, ctx: RunContext, progress: Progress | None = None, *, world_size: int | None = None
) -> PrunePlan:
    """The dry-run plan, from the model built on the meta device (no weights read, nothing written).

    The structure and the linears come from the same discovery as a run. The sequential groups need a
    real forward (`engine.linear_groups`), so the Gram-matrix estimate takes all of a block's pruned
    linears at once: exact without --sequential, an upper bound with it. world_size: the processes
    the device memory is estimated for (default: this run's, `ctx.distributed`).
    """
    from tsenor_cli.models.loading import config_value, meta_model, read_config, resolve_source
    from tsenor_cli.models.structure import discover_structure

    dtype, device = dtype_and_device(cfg, ctx)
    source, is_local = resolve_source(cfg.model, ctx, progress=progress)
    # load_model's own reading, so the plan fails with the run's line
    config = read_config(cfg.model, source, is_local, ctx, trust_remote_code=cfg.trust_remote_code)
    model = meta_model(config, trust_remote_code=cfg.trust_remote_code)
    structure = discover_structure(model)
    slots = linear_slots(structure)
    ignored = excluded_layers([s.full_name for s in slots], cfg.ignore, cfg.targets)
    candidates = [s for s in slots if s.full_name not in ignored]
    # Only nn.Linear layers can be checked before the forward is watched: the orientation and role (router,
    # gate: left dense whatever their shape) of other matrices are found at run time (engine.observed_slots).
    bad = incompatible_slots([c for c in candidates if not c.param and c.out_features > 1], cfg.pattern)
    max_pos = config_value(config, "max_position_embeddings")
    seqlen = min(cfg.seqlen, int(max_pos)) if max_pos else cfg.seqlen
    width = torch.finfo(dtype).bits // 8
    params = sum(p.numel() for p in model.parameters())
    per_block = [sum(p.numel() for p in b.parameters()) for b in structure.blocks]
    hidden = int(config_value(config, "hidden_size"))
    spec = get_pruner(cfg.method)
    memory = estimate_device_memory(
        per_block,
        candidates,
        nsamples=cfg.nsamples,
        seqlen=seqlen,
        hidden_size=hidden,
        width=width,
        needs_gram=spec.needs_gram,
        iterative=spec.iterative,
        world_size=world_size if world_size is not None else ctx.distributed.world_size,
        offload_activations=cfg.offload_activations,
        sequential=cfg.sequential,
    )
    host = host_estimate(
        memory[0],  # shard_bounds gives rank 0 the most samples
        device=device,
        params=params,
        nsamples=cfg.nsamples,
        seqlen=seqlen,
        hidden_size=hidden,
        width=width,
        rows=-(-cfg.nsamples // len(memory)),
        offload_activations=cfg.offload_activations,
    )
    return PrunePlan(
        model=cfg.model,
        method=cfg.method,
        pattern=cfg.pattern.label,
        source=source,
        model_type=structure.model_type,
        slots=tuple(slots),
        incompatible=bad,
        ignored=ignored,
        seqlen=seqlen,
        nsamples=cfg.nsamples,
        params=params,
        cpu_bytes=params * width,
        device_memory=tuple(memory),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        blocks=len(structure),
        checkpoint_bytes=params * width,
        resume_bytes=sum(per_block) * width + 2 * cfg.nsamples * seqlen * hidden * width,
        host_memory=host,
    )

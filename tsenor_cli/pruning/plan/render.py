"""The plan for people and programs: `tsenor prune --dry-run`'s table and text (`plan_lines`) and its
`--json` (`plan_dict`), each a function of a `PrunePlan`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from tsenor_cli.namefold import index_ranges
from tsenor_cli.outputs import free_bytes, human_bytes, output_path
from tsenor_cli.pruning.block.memory import KNOWN_GPUS, device_present
from tsenor_cli.pruning.block.outside import OUTSIDE_BLOCK, OutsideWeight
from tsenor_cli.pruning.block.outside import REASON as OUTSIDE_REASON

if TYPE_CHECKING:
    from tsenor_cli.pruning.block.slots import LinearSlot
    from tsenor_cli.pruning.methods.types import LayerRecord
    from tsenor_cli.pruning.plan.plan import PrunePlan
    from tsenor_cli.pruning.settings.config import PruneConfig

# How the dry run's table words each status of `PrunePlan.verdict`.
_VERDICTS: dict[str, Callable[[str | None], str]] = {
    "prune": lambda reason: "yes" if reason is None else f"yes, {reason}",
    "incompatible": lambda reason: f"NO: {reason}",
    "ignored": lambda reason: f"ignored: {reason}",
    "idle": lambda reason: f"idle: {reason}",
    "decided at prune time": lambda reason: f"decided at prune time: {reason}",
    "not a matmul weight": lambda reason: f"left dense: {reason}",
}


def plan_rows(plan: PrunePlan) -> list[tuple[str, str, str]]:
    """The dry run's table: (name, shape, verdict) for every weight matrix of the decoder blocks, the
    report's accounting before any weight is read (a stack of E experts is one row, "E×out×in")."""
    return [(name, shape, verdict) for _block, name, shape, verdict in _block_rows(plan)]


def grouped_rows(plan: PrunePlan) -> list[tuple[str, str, str]]:
    """`plan_rows` with the rows that differ only in their block folded into one, its blocks as ranges:
    "model.layers.{0-29}.mlp.up_proj" (a 70B model's 560 rows are 7; an MoE's thousands, a few dozen).
    A block whose weight has another shape or verdict keeps a row of its own, so nothing said per block is
    lost; `--json` lists every layer."""
    groups: dict[tuple[str, str | None, str, str], list[int]] = {}
    for block, name, shape, verdict in _block_rows(plan):
        # The block's index as `ModelStructure.full_name` writes it: "<blocks>.<index>.<local>".
        head, infix, tail = name.partition(f".{block}.")
        key = (head, tail, shape, verdict) if infix and block != OUTSIDE_BLOCK else (name, None, shape, verdict)
        groups.setdefault(key, []).append(block)
    return [
        (head if tail is None else f"{head}.{_blocks(blocks)}.{tail}", shape, verdict)
        for (head, tail, shape, verdict), blocks in groups.items()
    ]


def _blocks(blocks: list[int]) -> str:
    """The blocks of a folded row: "{0-2,5}"; one block: "5"."""
    return str(blocks[0]) if len(set(blocks)) == 1 else "{" + index_ranges(blocks) + "}"


def _block_rows(plan: PrunePlan) -> list[tuple[int, str, str, str]]:
    """(block, name, shape, verdict) of `plan_rows`, block by block."""
    found: list[tuple[int, str, str, str]] = []
    for slot in plan.slots:
        shape = f"{slot.out_features}×{slot.in_features}"
        if slot.experts:
            shape = f"{slot.experts}×{shape}"
        status, reason = plan.verdict(slot.full_name)
        found.append((slot.block, slot.full_name, shape, _VERDICTS[status](reason)))
    for record in plan.unused:
        shape = f"{record.out_features}×{record.in_features}"
        found.append((record.block, record.name, shape, _VERDICTS["not a matmul weight"](record.reason)))
    found.sort(key=lambda row: row[0])  # stable: block by block, each in the order found
    for weight in plan.outside_targets:
        verdict = f"NO: {weight.incompatible}" if weight.incompatible else f"yes, {OUTSIDE_REASON}"
        found.append((OUTSIDE_BLOCK, weight.name, f"{weight.out_features}×{weight.in_features}", verdict))
    return found


def _slot_layer(plan: PrunePlan, slot: LinearSlot) -> dict[str, Any]:
    """The JSON of one weight matrix of the decoder blocks."""
    return {
        "name": slot.full_name,
        "shape": [slot.out_features, slot.in_features],
        "experts": slot.experts,
        "transposed": slot.transposed,
        "role": slot.role,
        "status": plan.verdict(slot.full_name)[0],
        "compatible": slot.full_name not in plan.incompatible,
        "reason": plan.incompatible.get(slot.full_name),
        "ignored": plan.ignored.get(slot.full_name),
    }


def _unused_layer(record: LayerRecord) -> dict[str, Any]:
    """The JSON of a block parameter that is no matmul weight."""
    return {
        "name": record.name,
        "shape": [record.out_features, record.in_features],
        "experts": 0,
        "transposed": False,
        "role": None,
        "status": "not a matmul weight",
        "compatible": True,
        "reason": None,
        "ignored": record.reason,
    }


def _outside_layer(weight: OutsideWeight) -> dict[str, Any]:
    """The JSON of a linear outside the language model that --targets selects."""
    return {
        "name": weight.name,
        "shape": [weight.out_features, weight.in_features],
        "experts": 0,
        "transposed": False,
        "role": None,
        "status": "incompatible" if weight.incompatible else "prune",
        "compatible": weight.incompatible is None,
        "reason": weight.incompatible,
        "ignored": None,
        "outside": OUTSIDE_REASON,
    }


def plan_dict(plan: PrunePlan) -> dict[str, Any]:
    """`tsenor prune --dry-run --json`: the plan's layers (as `plan_rows`), counts and estimates."""
    layers = [_slot_layer(plan, s) for s in plan.slots] + [_unused_layer(r) for r in plan.unused]
    return {
        "model": plan.model,
        "method": plan.method,
        "pattern": plan.pattern,
        "source": plan.source,
        "model_type": plan.model_type,
        "layers": layers + [_outside_layer(w) for w in plan.outside_targets],
        "idle": len(plan.idle_dense),
        "decided_at_prune_time": len(plan.pending),
        "probe_bytes": plan.probe_bytes,
        "incompatible": len(plan.incompatible),
        "ignored": len(plan.ignored),
        "seqlen": plan.seqlen,
        "nsamples": plan.nsamples,
        "calibration": plan.calibrate,
        "params": plan.params,
        "estimated_cpu_bytes": plan.cpu_bytes,
        "estimated_host_bytes_per_process": plan.host_memory.to_dict(),
        "estimated_device_bytes": plan.device_bytes,
        "estimated_device_bytes_per_rank": [estimate.to_dict() for estimate in plan.device_memory],
        "estimated_checkpoint_bytes": plan.checkpoint_bytes,
        "estimated_resume_state_bytes": plan.resume_bytes,
        "estimated_blocks_bytes": plan.blocks_bytes,
        "stream": plan.stream,
        "blocks": plan.blocks,
        "device": plan.device,
        "device_present": device_present(torch.device(plan.device)),
        "fits_gpus": [name for name, size in KNOWN_GPUS if size >= plan.device_bytes],
        "dtype": plan.dtype,
    }


def _memory_lines(plan: PrunePlan, cfg: PruneConfig) -> Iterator[str]:
    """The host and device estimates, and for a device this machine lacks, the GPUs the run fits."""
    host = plan.host_memory
    several = len(plan.device_memory) > 1
    yield (
        f"estimated memory: host {human_bytes(host.total)} ({host.describe()}"
        + (", in each process)" if several else ")")
        + f" over this process's {human_bytes(host.runtime)} (measured), {human_bytes(host.peak)} at the peak"
        + f"; {plan.device} {human_bytes(plan.device_bytes)} peak"
        + (" per process" if several else "")
        + (", activations offloaded" if cfg.offload_activations else "")
    )
    if cfg.refine.mask_every:
        # Measured, not yet modelled: the re-solves' refinements peaked 0.2-0.35 GB above the fixed mask's
        # (the 16:32 recipe on SmolLM2-135M: 1.72 GB against its 1.51 GB estimate; docs/results.md,
        # "Seventeenth session"). Said, so that a batch job's memory request is not taken from the line above.
        yield (
            "not counted above: --refine-mask-every's re-solves, which raised the refinement's peak by up to "
            "0.35 GB on SmolLM2-135M (docs/results.md); request more host memory"
        )
    if not device_present(torch.device(plan.device)):
        fitting = [name for name, size in KNOWN_GPUS if size >= plan.device_bytes]
        yield (
            f"{plan.device} is not on this machine: the run needs a GPU with {human_bytes(plan.device_bytes)} "
            f"per process and {human_bytes(host.total)} of host memory on its machine; "
            + (f"fits GPUs of {', '.join(fitting)}" if fitting else "fits no GPU of up to 141 GB")
        )


def _disk_line(plan: PrunePlan, cfg: PruneConfig) -> str:
    """The checkpoint, the resume state or the pruned blocks kept until the write, and the free space."""
    kept = f", pruned blocks until the write {human_bytes(plan.blocks_bytes)}" if cfg.stream and not cfg.resume else ""
    resume = f"resume state up to {human_bytes(plan.resume_bytes)}" if cfg.resume else "no resume state"
    free = "" if cfg.output is None else f"; {human_bytes(free_bytes(cfg.output))} free at {output_path(cfg.output)}"
    return f"disk: checkpoint {human_bytes(plan.checkpoint_bytes)}, {resume}{kept}{free}"


def plan_lines(plan: PrunePlan, cfg: PruneConfig) -> Iterator[str]:
    """The dry run's text: the run in one line, a row per weight matrix and the blocks that share it
    (`grouped_rows`), the memory and disk estimates and each rank's share of the device memory."""
    calibration = (
        f"calibration {cfg.calib_data} {plan.nsamples}×{plan.seqlen}"
        if plan.calibrate
        else f"no calibration ({cfg.method} reads no data)"
    )
    yield (
        f"plan: {cfg.method} {cfg.pattern.label} ({cfg.pattern.kind}) on {plan.model} "
        f"({plan.model_type}, {plan.params / 1e6:.1f}M params, {plan.dtype}), {calibration}"
    )
    yield f"{'layer (blocks)':<44} {'shape':>13}  compatible"
    for name, shape, verdict in grouped_rows(plan):
        yield f"{name:<44} {shape:>13}  {verdict}"
    yield from _memory_lines(plan, cfg)
    yield _disk_line(plan, cfg)
    for estimate in plan.device_memory:
        yield (
            f"  rank {estimate.rank}: {human_bytes(estimate.total)} = block {human_bytes(estimate.block)} "
            f"+ activations {human_bytes(estimate.activations)} + statistics {human_bytes(estimate.statistics)} "
            f"+ workspace {human_bytes(estimate.workspace)}"
            + (f" + refine {human_bytes(estimate.refine)}" if estimate.refine else "")
        )

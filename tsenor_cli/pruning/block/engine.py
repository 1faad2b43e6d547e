"""Pruning one decoder block: the layer-wise reconstruction shared by every method (paper Section 4).

For each block (on the compute device, its calibration activations beside it): its weight matrices and
their sequential groups come from one watched forward of the dense block (`observe.observe_block`);
per group the block is replayed on the calibration inputs (`replay/`) while the group's input
statistics are gathered (`pruning/block/gather.py`), and each matrix is pruned by the method from the
registry, the results written back into the parameter in its own layout. The block loop around it,
the capture of the calls and the blocks' residency are the run's (`pruning/run/run.py`, `replay/`).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import nn

from tsenor_cli.errors import BadInputError, IncompatibleModelError
from tsenor_cli.models.structure import ModelStructure
from tsenor_cli.phases import phase
from tsenor_cli.progress import Progress
from tsenor_cli.pruning.block.distributed import Team, shared_input_classes
from tsenor_cli.pruning.block.gather import (
    MoeOptions,
    StackInputs,
    group_input_stats,
    group_inputs,
    unit_input_stats,
)
from tsenor_cli.pruning.block.idle import idle_line, prune_idle_by_magnitude, text_record, watch_idle
from tsenor_cli.pruning.block.memory import (
    MethodCost,
    expert_chunk,
    matrix_workspace,
    return_free_memory,
    slot_workspace,
)
from tsenor_cli.pruning.block.observe import BlockObservation, Unit, matrices, observe_block
from tsenor_cli.pruning.block.slots import LinearSlot, dense_records
from tsenor_cli.pruning.methods.loss_aware import prune_weighted
from tsenor_cli.pruning.methods.registry import PrunerSpec
from tsenor_cli.pruning.methods.stats import InputStats, reconstruction_error
from tsenor_cli.pruning.methods.types import LayerRecord, MaskSolveInfo, MatrixPruneConfig, PruneOutcome
from tsenor_cli.replay import BlockCall, block_output, input_key


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_runs_once(slot: LinearSlot, calls: int) -> None:
    """A matrix to prune must run exactly once per block forward: its statistics are its inputs. A
    stack of experts runs once per expert it routes to (or once for all of them), so only "never" counts."""
    if calls == 1 or (slot.experts and calls > 1):
        return
    why = "never runs in its block's forward, so it has no calibration inputs"
    if calls > 1:
        why = f"runs {calls} times per forward of its block (shared weights)"
    raise IncompatibleModelError(f"{slot.full_name} {why}; pass --ignore {slot.full_name} to leave it dense")


def record_line(record: LayerRecord, spec: PrunerSpec) -> str:
    """The progress line of one pruned linear (a method that reads no data has no error to show)."""
    error = f"rel. error {record.recon_error:.4f}" if record.recon_error is not None else f"by {spec.name}"
    gap = f", gap {record.gap:.2e}" if record.gap is not None else ""
    its = f", {record.iterations} ADMM iters" if spec.iterative else ""
    return f"  {record.name}: {error}{gap}{its}, {record.seconds:.1f}s"


def _non_finite_inputs(slot: LinearSlot, weight: torch.Tensor) -> BadInputError:
    # The weights were checked at load, so what is not finite are the inputs the block computed for it.
    return BadInputError(
        f"the calibration inputs of {slot.full_name} hold NaN/Inf (e.g. activations that overflow in "
        f"{weight.dtype}); try --dtype fp32 (nothing was written)"
    )


def _prune_linear(linear: nn.Linear, slot: LinearSlot, stats: InputStats, pruner: BlockPruner) -> LayerRecord:
    return _prune_matrix(linear.weight.data, slot, stats, pruner)


def _prune_stacked(
    linears: Sequence[nn.Linear], slots: Sequence[LinearSlot], stats: InputStats, pruner: BlockPruner
) -> list[LayerRecord]:
    """Prune linears that share `stats` (q/k/v, gate/up) in place as one matrix stacked along their outputs
    (`PrunerSpec.prune_rows`): for SparseGPT one factorization of the shared H and one solver call per
    M-column slab for all of them, instead of one per linear (3× fewer, 3× larger solves for q/k/v;
    docs/measurements/benchmarks-e2e.md, "SparseGPT's stacked linears"). The masks are those each would
    get alone (`PrunerSpec.fuses_rows`). Each record's seconds are its share of rows of the whole: every
    column step and every slab's tiles scale with the rows."""
    if len(linears) == 1:
        return [_prune_linear(linears[0], slots[0], stats, pruner)]
    weights = [linear.weight.data for linear in linears]
    parts = [slot.out_features for slot in slots]
    stacked = torch.cat([weight.to(torch.float32) for weight in weights])  # (Σ out, in): the dense copy
    if not bool(torch.isfinite(stats.sq_norms).all()):  # (in,): any NaN/Inf input reaches its column's sum
        raise _non_finite_inputs(slots[0], weights[0])
    _sync(pruner.device)
    start = time.perf_counter()
    with phase("method", layer="+".join(slot.record_name(None) for slot in slots)):
        outcomes = prune_weighted(pruner.spec, stacked, stats, pruner.matrix_cfg, stacked_rows(pruner, slots), parts)
    _sync(pruner.device)
    seconds = time.perf_counter() - start
    gram = stats.require_gram()
    return [
        _record_outcome(
            weight, dense, outcome, gram, _Entry(slot, None, seconds * slot.out_features / sum(parts)), pruner
        )
        for weight, dense, outcome, slot in zip(weights, stacked.split(parts), outcomes, slots, strict=True)
    ]


def shared_stats_classes(names: Sequence[str], stats: Mapping[str, InputStats]) -> list[list[str]]:
    """The names in classes of linears holding the very same statistics object (q/k/v, gate/up:
    `gather.group_input_stats`), in the order of `names`."""
    classes: dict[int, list[str]] = {}
    for name in names:
        classes.setdefault(id(stats[name]), []).append(name)
    return list(classes.values())


class _Entry(NamedTuple):
    """What a matrix's record says beside the method's outcome: its slot and expert (None: not a stack's),
    the seconds its pruning took, the routed tokens of an expert and a note on its statistics."""

    slot: LinearSlot
    expert: int | None
    seconds: float
    tokens: int | None = None
    note: str | None = None


def _record_outcome(
    weight: torch.Tensor,
    dense: torch.Tensor,
    outcome: PruneOutcome,
    gram: torch.Tensor | None,
    entry: _Entry,
    pruner: BlockPruner,
) -> LayerRecord:
    """Write `outcome` into `weight` (the stored view, cast to its dtype) and record it. dense: (out, in)
    float32 copy of the weight before pruning; gram: (in, in) XᵀX of its inputs for the error (None for a
    method that reads no data: no statistics were gathered, the record has no error)."""
    slot, expert = entry.slot, entry.expert
    weight.copy_(outcome.weight.to(weight.dtype))
    error: float | None = None
    if gram is not None:
        stored = weight.to(torch.float32)  # the error of what is saved, after the dtype cast
        error = reconstruction_error(dense, stored, gram)
        if not math.isfinite(error):
            raise _non_finite_inputs(slot, weight)
    record = LayerRecord(
        block=slot.block,
        name=slot.record_name(expert),
        out_features=slot.out_features,
        in_features=slot.in_features,
        status="pruned",
        reason=entry.note,
        recon_error=error,
        density=float(outcome.mask.float().mean()),
        **MaskSolveInfo.record_fields(outcome.solve),
        seconds=entry.seconds,
        iterations=outcome.iterations,
        safeguard_tiles=outcome.safeguard_tiles,
        param=slot.full_param,
        expert=expert,
        tokens=entry.tokens,
        transposed=slot.transposed,
    )
    pruner.progress(record_line(record, pruner.spec))
    return record


def _prune_matrix(weight: torch.Tensor, slot: LinearSlot, stats: InputStats, pruner: BlockPruner) -> LayerRecord:
    """Prune one (out, in) matrix in place. weight: a view in the stored dtype that writes through to the
    parameter (an nn.Linear's weight, or the one matrix of a 2D parameter, transposed for (in, out))."""
    dense = weight.to(torch.float32).clone()  # (out, in)
    if not bool(torch.isfinite(stats.sq_norms).all()):  # (in,): any NaN/Inf input reaches its column's sum
        raise _non_finite_inputs(slot, weight)
    _sync(pruner.device)
    start = time.perf_counter()
    with phase("method", layer=slot.record_name(None)):
        outcome = prune_weighted(pruner.spec, dense, stats, pruner.matrix_cfg, stacked_rows(pruner, [slot]))[0]
    _sync(pruner.device)
    seconds = time.perf_counter() - start
    return _record_outcome(weight, dense, outcome, stats.require_gram(), _Entry(slot, None, seconds), pruner)


def _expert_note(expert: int, stats: StackInputs, unit: Unit, moe: MoeOptions, threshold: int) -> str | None:
    """Why expert `expert`'s statistics are not simply its routed tokens, or None when they are."""
    if expert in stats.fallback and moe.calibration == "routed":
        return f"{int(stats.routed.tokens[expert])} routed tokens < {threshold}: statistics from every token"
    if expert in stats.fallback:
        return "statistics from every token (--moe-calibration all)"
    if unit.routing is None:
        return "the forward sends every token to every expert, scaled by its routing score"
    return None


def _prune_unit(
    block: nn.Module, slot: LinearSlot, unit: Unit, stats: InputStats | StackInputs, pruner: BlockPruner
) -> list[LayerRecord]:
    """Prune every matrix of a parameter used as matmul weights (one, or each expert of a stack with its
    own statistics); the results go back into the parameter in its own layout.

    A stack's experts go to the method together (`PrunerSpec.prune_batch`), in chunks of `expert_chunk`:
    one solver call per chunk and projection instead of one per expert. Each record's seconds are its
    share of its chunk's.
    """
    param = block.get_parameter(unit.param)
    views = matrices(param.data, unit.geometry)  # (count, out, in), writes go to the parameter
    if isinstance(stats, InputStats):
        return [_prune_matrix(views[0], slot, stats, pruner)]
    records = []
    spec, moe, device = pruner.spec, pruner.moe, pruner.device
    g = unit.geometry
    threshold = moe.threshold(g.in_features)
    fallback = torch.zeros(g.experts, dtype=torch.bool, device=stats.routed.tokens.device)  # (E,)
    fallback[list(stats.fallback)] = True
    chunk = expert_chunk(g.out_features, g.in_features, spec)
    for first in range(0, g.experts, chunk):  # chunks bound the memory; the experts within run batched
        ids = torch.arange(first, min(first + chunk, g.experts), device=fallback.device)  # (L,)
        batch = stats.routed.select(ids, stats.every, fallback[ids])
        if not bool(torch.isfinite(batch.sq_norms).all()):  # (L, in)
            raise _non_finite_inputs(slot, views[first])
        dense = views[first : first + ids.numel()].to(torch.float32).clone()  # (L, out, in)
        _sync(device)
        start = time.perf_counter()
        with phase("method", layer=f"{slot.full_param}[{first}:{first + ids.numel()}]"):
            outcomes = spec.prune_batch(dense, batch, pruner.matrix_cfg)
        _sync(device)
        seconds = (time.perf_counter() - start) / ids.numel()
        gram = batch.require_gram()  # (L, in, in)
        for i, expert in enumerate(ids.tolist()):
            records.append(
                _record_outcome(
                    views[expert],
                    dense[i],
                    outcomes[i],
                    gram[i],
                    _Entry(
                        slot,
                        expert,
                        seconds,
                        tokens=int(stats.routed.tokens[expert]),
                        note=_expert_note(expert, stats, unit, moe, threshold),
                    ),
                    pruner,
                )
            )
    return records


def stacked_rows(pruner: BlockPruner, slots: Sequence[LinearSlot]) -> torch.Tensor | None:
    """The loss-aware row weights (`methods/loss_aware.py`) of `pruner`'s linears `slots` stacked in order: (Σ out,)
    on the device, 1 for a linear without any; None when the run has none (`--loss-aware 0`)."""
    if not pruner.row_weights:
        return None
    ones = torch.ones(sum(slot.out_features for slot in slots), device=pruner.device)
    found = [pruner.row_weights.get(slot.full_name) for slot in slots]
    return torch.cat([ones[: s.out_features] if w is None else w.to(ones) for s, w in zip(slots, found, strict=True)])


class _Work(NamedTuple):
    """One block's pruning as its steps share it: the block (on the device), its index, its calibration
    inputs (S, T, H), the call the model passes it and the team of ranks."""

    block: nn.Module
    block_index: int
    inputs: torch.Tensor
    call: BlockCall
    team: Team


@dataclass(frozen=True)
class BlockPruner:
    """How a run prunes each block: its weight matrices (`slots`, those left dense because their shape
    cannot take the pattern (`skipped`) or because the user or a rule (routers) excluded them
    (`ignored`): {full name: reason}), the method and its settings, where it computes, and its policies:
    `sequential` groups (else one group per block), `moe` (how expert statistics are gathered),
    `team` (the ranks of a distributed run: per group every rank runs its shard, the statistics are
    summed rank after rank in sample order (`Team.ordered_statistics`, what one process computes, bit
    for bit) to each linear's owner, which prunes it and broadcasts the weight; a team of one is this
    process alone), `stop_early` (cut each statistics pass at the group's matrices, see
    `gather.group_input_stats`; False runs the whole block per group, same results).
    progress: the per-matrix lines (the run sends them to DEBUG: `tsenor -v prune`)."""

    structure: ModelStructure
    slots: Sequence[LinearSlot]
    spec: PrunerSpec
    matrix_cfg: MatrixPruneConfig
    device: torch.device
    progress: Progress
    skipped: Mapping[str, str] = field(default_factory=dict)
    ignored: Mapping[str, str] = field(default_factory=dict)
    sequential: bool = True
    moe: MoeOptions = field(default_factory=MoeOptions)
    team: Team | None = None
    stop_early: bool = True
    row_weights: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def prune(
        self,
        block: nn.Module,
        index: int,
        inputs: torch.Tensor,
        call: BlockCall,
        observation: BlockObservation | None = None,
    ) -> list[LayerRecord]:
        """Prune the weight matrices of block `index` (already on the device, `call` too) in place; one
        record per matrix (per expert for a stack), in pruning order, then any matrix that never runs.

        inputs: (S, T, H) the block's calibration inputs (this rank's shard in a distributed run; on the
        CPU with --offload-activations, else on the device). The matrices and their groups come from one
        watched forward of the dense block on the first sample (`observe.observe_block`): `observation`
        when already made (`gather.observe_blocks`, before pruning), else made here. Groups of nn.Linear
        layers take their statistics through module hooks (`group_input_stats`), groups with other
        matrices (expert stacks, Conv1D, bare parameters) through the watch (`unit_input_stats`).
        """
        team = self.team if self.team is not None else Team.solo(self.device)
        if call.idle:
            return self._prune_idle(_Work(block, index, inputs, call, team))
        by_param = {slot.param_name: slot for slot in self.slots if slot.block == index}
        records: dict[str, list[LayerRecord]] = {}
        with team.agreed():
            observed = observation if observation is not None else self._observe(block, inputs, call)
            for name, slot in by_param.items():
                left = self.left_dense(slot)
                if left is not None:
                    records[name] = left
                else:
                    unit = observed.units.get(name)
                    _check_runs_once(slot, unit.calls if unit is not None else 0)
        order = self._prune_groups(_Work(block, index, inputs, call, team), by_param, observed, records)
        never_ran = [name for name in by_param if name not in order]
        return [record for name in (*order, *never_ran) for record in records[name]]

    def _prune_groups(
        self,
        work: _Work,
        by_param: Mapping[str, LinearSlot],
        observed: BlockObservation,
        records: dict[str, list[LayerRecord]],
    ) -> tuple[str, ...]:
        """Prune the matrices of `by_param` that `observed` saw run and `records` does not hold yet, group by
        group, their records added to `records` → the observed order of `by_param`'s matrices."""
        order = tuple(name for name in observed.order if name in by_param)
        groups = tuple(tuple(n for n in g if n in by_param) for g in observed.groups) if self.sequential else (order,)
        block = work.block
        linears = self.structure.block_linears(work.block_index, block)
        for group in groups:
            active = [name for name in group if name not in records]
            if not active:
                continue
            if not self.spec.needs_data:  # magnitude: the weights alone decide, no statistics pass
                records.update(self._prune_without_data(block, {n: by_param[n] for n in active}, observed))
                continue
            # An nn.Linear whose weight the forward multiplies without calling it (Unit.left) has no hook inputs.
            hooked = [n for n in active if by_param[n].local_name in linears and not observed.units[n].left]
            if len(hooked) < len(active):
                units = {n: observed.units[n] for n in active}
                records.update(self._prune_units(work, {n: by_param[n] for n in active}, units))
            else:
                local = {by_param[n].local_name: by_param[n] for n in active}
                records.update(_prune_linears(self, work, local, linears))
            # The group's statistics and method work are freed: their pages go back before the next
            # group's are made (`memory.return_free_memory`). Without it the 16:32 recipe's block 2 climbed
            # from 1.29 to 1.66 GB RSS over its four groups; with it the block peaked at 1.38 GB.
            return_free_memory()
        return order

    def _prune_idle(self, work: _Work) -> list[LayerRecord]:
        """Block `index`, which the model's text-only forward skips (`pruning/block/idle.py`): its own forward on
        `inputs`, the text hidden states that reach it, with the arguments the model passes its running
        blocks (`BlockCall.running`); the matrices the text reaches are pruned by the method on their
        statistics, the others by magnitude → its records, those the text reached first."""
        block, index, inputs, call, team = work
        by_param = {slot.param_name: slot for slot in self.slots if slot.block == index}
        running = call.as_running()
        with phase("statistics"), team.agreed():
            seen = watch_idle(block, running, inputs[:1].to(self.device), input_key=input_key)
        self.progress(idle_line(self.structure, index, seen))
        records: dict[str, list[LayerRecord]] = {}
        for name, slot in by_param.items():
            left = self.left_dense(slot)
            if left is not None:
                records[name] = left
            elif name in seen.observation.units:
                _check_runs_once(slot, seen.observation.units[name].calls)
        # The forward cannot run past where it stopped: each statistics pass ends once its group has run.
        reached = replace(self, stop_early=True)._prune_groups(
            work._replace(call=running), by_param, seen.observation, records
        )
        for name in reached:
            records[name] = [text_record(record) for record in records[name]]
        with phase("method"), team.agreed():
            for name, slot in by_param.items():
                if name not in records:
                    records[name] = prune_idle_by_magnitude(block, slot, self.matrix_cfg, seen, self.progress)
        others = [name for name in by_param if name not in reached]
        return [record for name in (*reached, *others) for record in records[name]]

    def _prune_without_data(
        self, block: nn.Module, slots: Mapping[str, LinearSlot], observed: BlockObservation
    ) -> dict[str, list[LayerRecord]]:
        """A group pruned by a method that reads no data (`PrunerSpec.needs_data` False: magnitude): each
        matrix from its weights alone, in its parameter's own layout as the watch saw it (a stack of experts
        in chunks, as `_prune_unit` takes them), with no statistics pass over the calibration inputs (a
        magnitude prune of SmolLM2 spent 300 s per block gathering statistics it never read). Every
        rank prunes every matrix alike (the result depends on the weights only) → records by parameter
        name, without a reconstruction error (there are no inputs to measure it on)."""
        records: dict[str, list[LayerRecord]] = {}
        with phase("updates"):
            for name, slot in slots.items():
                unit = observed.units[name]
                views = matrices(block.get_parameter(unit.param).data, unit.geometry)  # (count, out, in)
                chunk = expert_chunk(unit.geometry.out_features, unit.geometry.in_features, self.spec)
                records[name] = [
                    record
                    for first in range(0, unit.geometry.count, chunk)
                    for record in self._prune_chunk(views, first, chunk, slot, bool(unit.geometry.experts))
                ]
        return records

    def _prune_chunk(
        self, views: torch.Tensor, first: int, chunk: int, slot: LinearSlot, experts: bool
    ) -> list[LayerRecord]:
        """views[first : first + chunk] (L, out, in) pruned by the method from their weights, in place → their
        records, each with its share of the chunk's seconds (the copy, the method and the write back). Its
        own function, so the chunk's dense copy and outcomes are freed before the next chunk's are made."""
        start = time.perf_counter()
        dense = views[first : first + chunk].to(torch.float32).clone()  # (L, out, in)
        rows = None if experts else stacked_rows(self, [slot])
        outcomes = (
            prune_weighted(self.spec, dense[0], None, self.matrix_cfg, rows)
            if rows is not None
            else (self.spec.prune_batch(dense, None, self.matrix_cfg))
        )
        made = [
            _record_outcome(
                views[first + i], dense[i], outcome, None, _Entry(slot, first + i if experts else None, 0.0), self
            )
            for i, outcome in enumerate(outcomes)
        ]
        _sync(self.device)
        seconds = (time.perf_counter() - start) / len(made)
        return [replace(record, seconds=seconds) for record in made]

    def _observe(self, block: nn.Module, inputs: torch.Tensor, call: BlockCall) -> BlockObservation:
        with phase("statistics"):
            sample = inputs[:1].to(self.device)
            return observe_block(block, functools.partial(block_output, block, call, sample), input_key=input_key)

    def left_dense(self, slot: LinearSlot) -> list[LayerRecord] | None:
        """The records of `slot` when it is ignored or skipped, else None."""
        for status, reasons in (("ignored", self.ignored), ("skipped", self.skipped)):
            if slot.full_name in reasons:
                return dense_records(slot, status, reasons[slot.full_name])
        return None

    def _prune_units(
        self, work: _Work, slots: Mapping[str, LinearSlot], units: Mapping[str, Unit]
    ) -> dict[str, list[LayerRecord]]:
        """A group with matrices other than nn.Linear layers: statistics through the watch, by parameter name."""
        block = work.block
        if work.team.distributed:
            raise IncompatibleModelError(
                f"{next(iter(slots.values())).full_name} is not an nn.Linear (an expert stack, Conv1D or bare "
                "parameter); --nproc prunes nn.Linear layers only: run with one process"
            )
        with phase("statistics"):
            stats = unit_input_stats(block, units, work.inputs, work.call, self.moe, stop_early=self.stop_early)
        return {name: _prune_unit(block, slots[name], units[name], stats.pop(name), self) for name in units}


def _prune_linears(
    pruner: BlockPruner, work: _Work, local: Mapping[str, LinearSlot], linears: Mapping[str, nn.Linear]
) -> dict[str, list[LayerRecord]]:
    """A group of nn.Linear layers (by local name): statistics through module hooks, each linear pruned
    by its owner rank and broadcast → records by parameter name. With a method whose rows are
    independent (`PrunerSpec.fuses_rows`) the linears that share one statistics object are pruned
    together (`_prune_stacked`) by one owner, with the results of pruning them apart."""
    block, inputs, call, team = work.block, work.inputs, work.call, work.team
    group_linears = {name: linears[name] for name in local}
    width = next(iter(group_linears.values())).weight.element_size()
    with phase("statistics"):
        with team.agreed():
            if team.distributed:
                kept = group_inputs(block, group_linears, inputs, call, pruner.device, keep=inputs.device)
            else:
                stats = group_input_stats(
                    block, group_linears, inputs, call, pruner.device, stop_early=pruner.stop_early
                )
        if team.distributed:
            classes = _classes(pruner, local, shared_input_classes(kept), width)
            owners = _owners(local, classes, team)
            in_features = {name: local[name].in_features for name in local}
            stats = team.ordered_statistics(kept, in_features, owners)
            del kept
        else:
            classes = _classes(pruner, local, shared_stats_classes(list(local), stats), width)
            owners = _owners(local, classes, team)
    mine: dict[str, LayerRecord] = {}
    with team.agreed():
        for names in classes:
            if owners[names[0]] == team.rank:
                pruned_here = _prune_stacked(
                    [linears[n] for n in names], [local[n] for n in names], stats.pop(names[0]), pruner
                )
                mine.update(zip(names, pruned_here, strict=True))
    team.broadcast_weights(group_linears, owners)
    pruned = team.gather_objects(mine)
    records = {}
    for name in local:
        records[local[name].param_name] = [pruned[name]]
        if owners[name] != team.rank:
            pruner.progress(record_line(pruned[name], pruner.spec) + f" (rank {owners[name]})")
    return records


def _classes(
    pruner: BlockPruner, local: Mapping[str, LinearSlot], shared: list[list[str]], width: int
) -> list[list[str]]:
    """The linears pruned together, in the order of `local`: each class sharing statistics (`shared`)
    when the method fuses rows and the stacked matrix's working set stays within the largest of the
    block's matrices (`memory.slot_workspace`: what the plan's device estimate holds, so stacking
    never raises the peak it promised; e.g. magnitude's gate/up, whose working set is 2F + the
    solver's, go apart), else each linear alone. width: bytes per element of the weights."""
    if not pruner.spec.fuses_rows:
        return [[name] for name in local]
    cfg = pruner.matrix_cfg
    cost = MethodCost.of(pruner.spec, cfg.pattern, cfg.solver, device=pruner.device, width=width)
    block = next(iter(local.values())).block
    pruned = [s for s in pruner.slots if s.block == block and pruner.left_dense(s) is None]
    bound = max(slot_workspace(s, cost) for s in pruned)
    classes: list[list[str]] = []
    for names in shared:
        rows = sum(local[n].out_features for n in names)
        if matrix_workspace(rows, local[names[0]].in_features, cost) <= bound:
            classes.append(names)
        else:
            classes.extend([n] for n in names)
    return classes


def _owners(local: Mapping[str, LinearSlot], classes: list[list[str]], team: Team) -> dict[str, int]:
    """{name: rank} with one owner per class of linears pruned together (a class costs what one
    linear of its stacked outputs costs; `assign_owners`)."""
    if all(len(names) == 1 for names in classes):
        return team.owners([[(n, local[n].out_features, local[n].in_features) for n in local]])
    units = [(names[0], sum(local[n].out_features for n in names), local[names[0]].in_features) for names in classes]
    first = team.owners([units])
    return {name: first[names[0]] for names in classes for name in names}

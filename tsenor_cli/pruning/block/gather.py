"""The input statistics of a block's weight matrices, gathered by replaying the block under observation.

nn.Linear groups through module hooks (`group_input_stats`; `group_inputs` keeps the inputs themselves for a
distributed run's ordered sums); other matrices (expert stacks, Conv1D, bare parameters) through the
forward watch (`unit_input_stats`, `pruning/block/observe.py`); the groups themselves from one watched forward
(`linear_groups`, `observe_blocks`). A statistics pass stops each sample's forward as soon as the group's
matrices have seen their input, so [q,k,v] costs the input norm and three matmuls, not the whole block.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from tsenor_cli.pruning.block.observe import BlockObservation, Unit, Use, every_token, observe_block, watching
from tsenor_cli.pruning.methods.stats import ExpertStats, InputStats, RowBuffer
from tsenor_cli.replay import BlockCall, BlockSource, block_output, input_key
from tsenor_cli.replay.watch import Seen, each_module_input, watch_blocks


@dataclass(frozen=True)
class LinearGroups:
    """What one forward of a block showed about its linears.

    groups: the linears that read the same input tensor, groups in the order their inputs appeared;
    calls: how many times each linear ran (0: never, so it has no calibration inputs).
    """

    groups: tuple[tuple[str, ...], ...]
    calls: dict[str, int]

    @property
    def order(self) -> tuple[str, ...]:
        """The linears that ran, in the order they first ran."""
        return tuple(name for group in self.groups for name in group)


@torch.no_grad()
def linear_groups(
    block: nn.Module, linears: Mapping[str, nn.Linear], call: BlockCall, sample: torch.Tensor
) -> LinearGroups:
    """sample: (1, T, H) → the sequential groups of `linears`, observed in one forward of `block`
    (`observe.observe_block`, which `BlockPruner.prune` uses for every weight matrix, seen from the linears).

    Linears whose input is the same view of the same memory (the same tensor, or a view or no-op cast of
    it) form a group; groups come in the order their input first appears. Sameness of memory rather than
    equality of values: two inputs computed apart (each expert's own token subset, a norm applied twice)
    are kept apart, which costs an extra statistics pass but is always correct, whereas equal values
    could merge a linear with one that feeds it.
    """
    seen = observe_block(block, functools.partial(block_output, block, call, sample), input_key=input_key)
    local = {f"{name}.weight": name for name in linears}
    calls = {name: seen.units[f"{name}.weight"].calls if f"{name}.weight" in seen.units else 0 for name in linears}
    groups = (tuple(local[n] for n in group if n in local) for group in seen.groups)
    return LinearGroups(tuple(group for group in groups if group), calls)


@torch.no_grad()
def group_input_stats(
    block: nn.Module,
    linears: dict[str, nn.Linear],
    inputs: torch.Tensor,
    call: BlockCall,
    device: torch.device,
    *,
    stop_early: bool = True,
) -> dict[str, InputStats]:
    """inputs: (S, T, H) → {name: statistics (with XᵀX) of the inputs (S·T, in) of linears[name]}.

    `linears` are the group's linears to prune, all inside `block`, each called once per block forward.
    The block and the statistics are on `device`; `inputs` may be on the CPU (--offload-activations),
    one sample at a time is moved to `device`.
    With `stop_early` a sample's forward is abandoned once each of them has been called: the rest of the
    block cannot change what they saw, so the statistics are bit-for-bit those of a full pass (the
    computation up to there is the same). stop_early=False runs the whole block.
    Linears that read the same tensor (q/k/v, gate/up) share one `InputStats` object, added to once per
    sample: the same sums as one per linear, bit for bit, for a third of the Gram flops of q/k/v and half
    of gate/up's (pruners only read their statistics: `PrunerSpec`).
    """
    stats: dict[str, InputStats] = {}
    last: list[tuple[torch.Tensor, InputStats]] = []  # (the last input seen, the statistics it went to)

    def sink(name: str, x: torch.Tensor) -> None:
        # A linear reading the input the previous one read, and sharing its statistics: already added.
        if last and last[0][0] is x and stats.setdefault(name, last[0][1]) is last[0][1]:
            return
        if name not in stats:
            stats[name] = InputStats(linears[name].in_features, gram=True, device=device)
        stats[name].add(x)
        last[:] = [(x, stats[name])]

    each_module_input(block, linears, inputs, call, device, stop_early, sink)
    return stats


@torch.no_grad()
def group_inputs(
    block: nn.Module,
    linears: dict[str, nn.Linear],
    inputs: torch.Tensor,
    call: BlockCall,
    device: torch.device,
    *,
    keep: torch.device,
) -> dict[str, list[torch.Tensor]]:
    """inputs: (S, T, H) → {name: the input (1, T, in) of linears[name] for each sample, in sample order}.

    What `group_input_stats` would add up, kept (on `keep`) so that a distributed run can add them in the
    single process's order once the sums of the samples before them arrive (distributed.py). Linears
    that read the same tensor share one copy. Each forward stops once the group's linears have run, so
    nothing later in the block can change a kept input in place.
    """
    kept: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
    last: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the last input seen, its kept copy)

    def sink(name: str, x: torch.Tensor) -> None:
        if not last or last[0][0] is not x:
            last[:] = [(x, x.to(keep))]
        kept[name].append(last[0][1])

    each_module_input(block, linears, inputs, call, device, True, sink)
    return kept


@dataclass(frozen=True)
class MoeOptions:
    """How the statistics of expert matrices are gathered.

    calibration: "routed" (each expert's statistics from the tokens its router sends it in the dense
    block's forward) or "all" (every calibration token through every expert, for the statistics only;
    the block's output stays the routed one); min_tokens: under "routed", an expert that received fewer
    tokens than this (None: its input dimension) takes its statistics from every token instead.
    """

    calibration: str = "routed"
    min_tokens: int | None = None

    def threshold(self, in_features: int) -> int:
        return in_features if self.min_tokens is None else self.min_tokens


@dataclass
class StackInputs:
    """The statistics of the E matrices of one stack. routed: from the tokens routed to each; every:
    from every token, for the experts in `fallback` (all of them under --moe-calibration all), else None."""

    routed: ExpertStats
    every: ExpertStats | None
    fallback: frozenset[int]


class _UnitCollector:
    """The `observe.watching` callback of `unit_input_stats`: each use of a unit's parameter adds its rows
    to the unit's statistics. channel: "routed" (the first pass: singles and routed rows), "every" (a
    routing module's re-call with every token: only the stacks in `every`), "skip" (the routed call
    before each re-call, already counted in the first pass)."""

    def __init__(self, units: Mapping[str, Unit], device: torch.device, stop_early: bool) -> None:
        self.units = units
        self.device = device
        self.singles: dict[str, InputStats] = {}
        self.routed: dict[str, RowBuffer] = {}
        self.every: dict[str, RowBuffer] = {}
        self.channel = ["routed"]
        self.pending: set[str] = set()
        self.stacks = {name for name, unit in units.items() if unit.geometry.experts}
        self.stop_early = stop_early and not self.stacks

    def __call__(self, use: Use) -> None:
        unit = self.units.get(use.param)
        if unit is None or self.channel[0] == "skip":
            return
        if self.channel[0] == "every":
            if use.experts is not None and use.param in self.every:
                self.every[use.param].add(use.rows, use.experts)
            return
        g = unit.geometry
        if use.experts is None:
            if use.param not in self.singles:
                self.singles[use.param] = InputStats(g.in_features, gram=True, device=self.device)
            self.singles[use.param].add(use.rows)
        else:
            if use.param not in self.routed:
                # Without a routing module every token reaches every expert, scaled: not-routed rows are 0.
                stats = ExpertStats(
                    g.experts, g.in_features, gram=True, device=self.device, zero_rows=unit.routing is None
                )
                self.routed[use.param] = RowBuffer(stats)
            self.routed[use.param].add(use.rows, use.experts)  # under "all" too: the token counts of the report
        self.pending.discard(use.param)
        if self.stop_early and not self.pending:
            raise Seen

    def chosen(self, counts: Mapping[str, ExpertStats], moe: MoeOptions) -> dict[str, list[int]]:
        """{stack: the experts that take every-token statistics}."""
        chosen: dict[str, list[int]] = {}
        for name in self.stacks:
            g = self.units[name].geometry
            if self.units[name].routing is None:  # every token reaches every expert already (Llama-4): nothing to add
                chosen[name] = []
            elif moe.calibration == "all":
                chosen[name] = list(range(g.experts))
            else:
                low = (counts[name].tokens < moe.threshold(g.in_features)).nonzero().flatten()
                chosen[name] = low.tolist()
        return chosen

    def every_token_stats(
        self,
        block: nn.Module,
        by_routing: Mapping[str, list[str]],
        chosen: Mapping[str, list[int]],
        inputs: torch.Tensor,
        call: BlockCall,
    ) -> dict[str, ExpertStats]:
        """The every-token statistics of the `chosen` experts of each stack, one pass per routing module
        (`by_routing`: its stacks' names) over `inputs` (`every_token_pass`)."""
        every_stats: dict[str, ExpertStats] = {}
        for routing, names in by_routing.items():
            for name in names:
                g = self.units[name].geometry
                self.every[name] = RowBuffer(
                    ExpertStats(g.experts, g.in_features, gram=True, device=self.device, zero_rows=False)
                )
            wanted = sorted({e for name in names for e in chosen[name]})
            self.channel[0] = "skip"  # the routed call before each re-call was counted in the first pass
            try:
                experts = self.units[names[0]].geometry.experts
                self.every_token_pass(block, routing, experts, wanted, inputs, call)
            finally:
                self.channel[0] = "routed"
            every_stats.update({name: self.every.pop(name).flush() for name in names})
        return every_stats

    def every_token_pass(
        self, block: nn.Module, routing: str, total: int, experts: list[int], inputs: torch.Tensor, call: BlockCall
    ) -> None:
        """Run each sample of `inputs` (S, T, H) up to the routing module `routing` (of `total` experts),
        re-call it with every token sent to `experts` (this collector adds those inputs while the channel is
        "every") and stop the forward there."""
        channel = self.channel

        def stop() -> None:
            raise Seen

        @contextlib.contextmanager
        def recording() -> Iterator[None]:
            previous, channel[0] = channel[0], "every"
            try:
                yield
            finally:
                channel[0] = previous

        chosen = torch.tensor(experts, device=self.device)
        with every_token(block, routing, total, chosen, after=stop, around=recording):
            for j in range(inputs.shape[0]):
                with contextlib.suppress(Seen):
                    block_output(block, call, inputs[j : j + 1].to(self.device))


@torch.no_grad()
def unit_input_stats(
    block: nn.Module,
    units: Mapping[str, Unit],
    inputs: torch.Tensor,
    call: BlockCall,
    moe: MoeOptions,
    *,
    stop_early: bool = True,
) -> dict[str, InputStats | StackInputs]:
    """inputs: (S, T, H) → statistics of the inputs of each unit (parameters used as matmul weights, by
    name), gathered by watching the block's forward (`observe.watching`, only inside the units' scopes
    when every unit has one), one sample at a time on the device of the units' weights (where the
    matrices that read those inputs compute).

    Single matrices get `InputStats` (what nn.Linear's hook path adds up, for Conv1D and bare 2D
    parameters); stacks of experts `StackInputs`, each row added to the expert it was routed to, in
    batched adds over several samples (`RowBuffer`). Experts below `moe.threshold` tokens (or all, under
    "all") then get every-token statistics from a second pass per routing module that re-calls it with
    every token sent to the experts any of its stacks needs (`observe.every_token`), stopped as soon as
    that call is done.
    """
    if not units:
        return {}
    device = block.get_parameter(next(iter(units.values())).param).device
    seen = _UnitCollector(units, device, stop_early)
    scopes = {unit.scope for unit in units.values()}
    result: dict[str, InputStats | StackInputs] = {}
    with watching(block, seen, scopes=None if None in scopes else cast(set[str], scopes)):
        for j in range(inputs.shape[0]):
            seen.pending.update(units)
            with contextlib.suppress(Seen):
                block_output(block, call, inputs[j : j + 1].to(device))
        for name in units:
            if name not in seen.singles and name not in seen.routed:
                raise RuntimeError(f"{name} never ran in the block's forward")
        result.update(seen.singles)
        counts = {name: seen.routed[name].flush() for name in seen.stacks}
        chosen = seen.chosen(counts, moe)
        by_routing: dict[str, list[str]] = {}
        for name in seen.stacks:
            if chosen[name]:
                by_routing.setdefault(cast(str, units[name].routing), []).append(name)
        every_stats = seen.every_token_stats(block, by_routing, chosen, inputs, call)
        for name in units:
            if name in seen.stacks:
                result[name] = StackInputs(counts[name], every_stats.get(name), frozenset(chosen[name]))
    return result


def observe_blocks(
    source: BlockSource, sample: torch.Tensor, calls: Sequence[BlockCall], first: int
) -> dict[int, BlockObservation]:
    """sample: (1, T, H) the input of block `first` → {block: what its dense forward showed} for blocks
    `first`.., each run on the dense output of the one before (`observe.observe_block`), each read from
    `source` for it and released after (`replay.watch.watch_blocks`). An idle block (`pruning/block/idle.py`)
    passes its input on unchanged."""
    return watch_blocks(source, sample, calls, first, functools.partial(observe_block, input_key=input_key))

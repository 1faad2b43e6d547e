"""The block-by-block runner shared by every method (layer-wise reconstruction, paper Section 4).

The model stays on the CPU; one decoder block and the calibration activations live on the compute
device. For each block: run the calibration activations through it with forward hooks that accumulate
each linear's input statistics, prune the linears (group by group when sequential: [q,k,v], [o],
[gate,up], [down], re-running the block between groups so later groups see pruned inputs), run it once
more so the next block sees pruned outputs, and move it back. A statistics pass stops each sample's
forward as soon as the group's linears have seen their input, so [q,k,v] costs the input norm and three
matmuls, not the whole block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tsenor_cli.errors import IncompatibleModelError
from tsenor_cli.pruning.registry import PrunerSpec
from tsenor_cli.pruning.stats import InputStats, reconstruction_error
from tsenor_cli.pruning.types import LayerPruneConfig, LayerRecord, SparsityPattern

Progress = Callable[[str], None]


@dataclass(frozen=True)
class LinearSlot:
    """A prunable linear: its block index, dotted name inside the block, full module name and shape."""

    block: int
    local_name: str
    full_name: str
    out_features: int
    in_features: int


class _Captured(Exception):
    """Raised by the pre-hook on block 0 to stop the forward once its input is known."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("captured")
        self.hidden = hidden


class _GroupSeen(Exception):
    """Raised by a statistics hook once every linear of the group has seen the current sample's input."""


def linear_slots(model: nn.Module, adapter: Any) -> list[LinearSlot]:
    """Every prunable linear of the model in block order, with full module names."""
    names = {id(module): name for name, module in model.named_modules()}
    slots: list[LinearSlot] = []
    for index, block in enumerate(adapter.decoder_layers(model)):
        for local, linear in adapter.block_linears(block).items():
            full = f"{names[id(block)]}.{local}"
            slots.append(LinearSlot(index, local, full, int(linear.out_features), int(linear.in_features)))
    return slots


def incompatible_slots(slots: Sequence[LinearSlot], pattern: SparsityPattern) -> dict[str, str]:
    """{full name: reason} for every linear whose shape cannot take `pattern`."""
    found: dict[str, str] = {}
    for slot in slots:
        reason = pattern.incompatibility(slot.out_features, slot.in_features)
        if reason is not None:
            found[slot.full_name] = reason
    return found


def check_compatibility(slots: Sequence[LinearSlot], pattern: SparsityPattern, *, skip: bool) -> dict[str, str]:
    """The incompatible linears (to skip), or IncompatibleModelError listing them when `skip` is False."""
    bad = incompatible_slots(slots, pattern)
    if bad and not skip:
        listed = "; ".join(f"{name}: {why}" for name, why in list(bad.items())[:6])
        more = f" (and {len(bad) - 6} more)" if len(bad) > 6 else ""
        raise IncompatibleModelError(
            f"{len(bad)} linear layer(s) cannot take {pattern.label}: {listed}{more}; "
            "choose an M that divides these dimensions or pass --skip-incompatible to leave them dense"
        )
    return bad


def _to_device(value: Any, device: torch.device) -> Any:
    """Move tensors (also inside tuples/lists/dicts) to `device`; everything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


@torch.no_grad()
def capture_block_inputs(model: nn.Module, adapter: Any, input_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """input_ids: (S, T) long → hidden states (S, T, H) entering decoder block 0, on `device`.

    The model's own forward runs on the CPU up to block 0, whose pre-hook records its input and stops
    the forward, so whatever the architecture does before the blocks (embedding scale etc.) is kept.
    """
    first = adapter.decoder_layers(model)[0]
    base = adapter.base(model)

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        raise _Captured(hidden)

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    captured: list[torch.Tensor] = []
    try:
        for row in input_ids:  # one sample at a time keeps the CPU memory at one sequence
            try:
                base(input_ids=row[None, :], use_cache=False)
            except _Captured as caught:
                captured.append(caught.hidden.to(device))
            else:
                raise RuntimeError("decoder block 0 was never called; the adapter does not match this model")
    finally:
        handle.remove()
    return torch.cat(captured, 0)  # (S, T, H)


def block_kwargs(model: nn.Module, adapter: Any, hidden: torch.Tensor, index: int, device: torch.device) -> Any:
    """Keyword arguments of block `index` for one-sample inputs shaped like hidden[:1], on `device`.

    The rotary embedding lives on the CPU with the model, so they are computed there and moved.
    """
    probe = torch.zeros((1, *hidden.shape[1:]), dtype=hidden.dtype)  # (1, T, H) on CPU
    return _to_device(adapter.block_forward_kwargs(model, probe, layer_index=index), device)


@torch.no_grad()
def run_block(block: nn.Module, inputs: torch.Tensor, kwargs: dict[str, Any], out: torch.Tensor | None) -> None:
    """inputs: (S, T, H) → the block's outputs written into `out` (S, T, H), or discarded when None.

    One sample per call: the kwargs (mask, rotary) are built for batch 1 and peak memory stays small.
    """
    for j in range(inputs.shape[0]):
        result = block(inputs[j : j + 1], **kwargs)
        hidden = result[0] if isinstance(result, tuple) else result
        if out is not None:
            out[j : j + 1] = hidden


@torch.no_grad()
def group_input_stats(
    block: nn.Module,
    linears: dict[str, nn.Linear],
    inputs: torch.Tensor,
    kwargs: dict[str, Any],
    device: torch.device,
    *,
    stop_early: bool = True,
) -> dict[str, InputStats]:
    """inputs: (S, T, H) → {name: statistics (with XᵀX) of the inputs (S·T, in) of linears[name]}.

    `linears` are the group's linears to prune, all inside `block`, each called once per block forward.
    With `stop_early` a sample's forward is abandoned once each of them has been called: the rest of the
    block cannot change what they saw, so the statistics are bit-for-bit those of a full pass (the
    computation up to there is the same). stop_early=False runs the whole block.
    """
    stats = {name: InputStats(linear.in_features, gram=True, device=device) for name, linear in linears.items()}
    pending: set[str] = set()  # the linears not yet called for the current sample

    def make_hook(name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], _output: Any) -> None:
            stats[name].add(args[0])
            pending.discard(name)
            if stop_early and not pending:
                raise _GroupSeen

        return hook

    handles = [linear.register_forward_hook(make_hook(name)) for name, linear in linears.items()]
    try:
        for j in range(inputs.shape[0]):  # one sample per call, as in run_block (the kwargs are for batch 1)
            pending.update(linears)
            try:
                block(inputs[j : j + 1], **kwargs)
            except _GroupSeen:
                pass
            else:
                # A linear the forward never reaches would be pruned from empty statistics.
                if pending:
                    raise RuntimeError(
                        f"{sorted(pending)} never ran in the block's forward; the adapter does not match"
                    )
    finally:
        for handle in handles:
            handle.remove()
    return stats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prune_block(
    block: nn.Module,
    index: int,
    adapter: Any,
    slots: Sequence[LinearSlot],
    skipped: dict[str, str],
    inputs: torch.Tensor,
    kwargs: dict[str, Any],
    spec: PrunerSpec,
    layer_cfg: LayerPruneConfig,
    *,
    sequential: bool,
    device: torch.device,
    progress: Progress,
    stop_early: bool = True,
) -> list[LayerRecord]:
    """Prune the linears of one block (already on `device`) in place; one record per linear.

    inputs: (S, T, H) the block's calibration inputs. stop_early: cut each statistics pass at the
    group's linears (see `group_input_stats`); False runs the whole block per group, same results.
    """
    linears: dict[str, nn.Linear] = adapter.block_linears(block)
    by_local = {slot.local_name: slot for slot in slots if slot.block == index}
    groups: Sequence[Sequence[str]] = adapter.linear_groups if sequential else (adapter.linear_names,)
    records: dict[str, LayerRecord] = {}
    for group in groups:
        active = [name for name in group if by_local[name].full_name not in skipped]
        for name in group:
            slot = by_local[name]
            if slot.full_name in skipped:
                records[name] = LayerRecord(
                    index,
                    slot.full_name,
                    slot.out_features,
                    slot.in_features,
                    "skipped",
                    skipped[slot.full_name],
                )
        if not active:
            continue
        group_linears = {name: linears[name] for name in active}
        stats = group_input_stats(block, group_linears, inputs, kwargs, device, stop_early=stop_early)
        for name in active:
            records[name] = _prune_linear(linears[name], by_local[name], stats[name], spec, layer_cfg, device, progress)
    return [records[name] for name in adapter.linear_names]


def _prune_linear(
    linear: nn.Linear,
    slot: LinearSlot,
    stats: InputStats,
    spec: PrunerSpec,
    layer_cfg: LayerPruneConfig,
    device: torch.device,
    progress: Progress,
) -> LayerRecord:
    dense = linear.weight.data.to(torch.float32).clone()  # (out, in)
    _sync(device)
    start = time.perf_counter()
    if spec.iterative:
        outcome = spec.prune(dense, stats, layer_cfg, lambda msg: progress(f"  {slot.full_name}: {msg}"))
    else:
        outcome = spec.prune(dense, stats, layer_cfg)
    _sync(device)
    seconds = time.perf_counter() - start
    linear.weight.data.copy_(outcome.weight.to(linear.weight.dtype))
    stored = linear.weight.data.to(torch.float32)  # the error of what is saved, after the dtype cast
    error = reconstruction_error(dense, stored, stats.require_gram())
    solve = outcome.solve
    record = LayerRecord(
        block=slot.block,
        name=slot.full_name,
        out_features=slot.out_features,
        in_features=slot.in_features,
        status="pruned",
        recon_error=error,
        density=float(outcome.mask.float().mean()),
        gap=solve.gap if solve else None,
        solver_objective=solve.objective if solve else None,
        solver_upper_bound=solve.upper_bound if solve else None,
        solver_seconds=solve.seconds if solve else None,
        solver_calls=solve.calls if solve else 0,
        seconds=seconds,
        iterations=outcome.iterations,
        safeguard_tiles=outcome.safeguard_tiles,
    )
    gap = f", gap {solve.gap:.2e}" if solve else ""
    its = f", {outcome.iterations} ADMM iters" if spec.iterative else ""
    progress(f"  {slot.full_name}: rel. error {error:.4f}{gap}{its}, {seconds:.1f}s")
    return record

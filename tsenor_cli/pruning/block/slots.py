"""The weight matrices of the decoder blocks (`LinearSlot`): found without running anything
(`linear_slots`), then as the watched forward used them (`observed_slots`); which cannot take the
pattern (`check_compatibility`); and the records of those left dense (`dense_records`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from tsenor_cli.errors import IncompatibleModelError
from tsenor_cli.models.structure import ModelStructure
from tsenor_cli.pruning.block.observe import BlockObservation
from tsenor_cli.pruning.methods.types import LayerRecord, SparsityPattern


@dataclass(frozen=True)
class LinearSlot:
    """A weight matrix of a decoder block, or a stack of expert matrices held in one parameter.

    local_name: the nn.Linear's module name inside the block ("self_attn.q_proj"), or for a parameter
    that is not a module's ``weight`` its dotted name ("mlp.experts.gate_up_proj"); full_name: the same
    in the whole model. out_features/in_features: of one matrix in nn.Linear's (out, in) orientation.
    param: the parameter's name relative to the block ("" means ``local_name + ".weight"``); experts: 0
    for one matrix, else E stacked matrices; transposed: stored (in, out) (GPT-2's Conv1D, gpt-oss and
    Llama-4 experts); role: "weight", or "router"/"gate" (left dense unless --targets names them).
    Everything but the nn.Linear fields is found by watching the forward (`pruning/block/observe.py`).
    """

    block: int
    local_name: str
    full_name: str
    out_features: int
    in_features: int
    param: str = ""
    experts: int = 0
    transposed: bool = False
    role: str = "weight"

    @property
    def param_name(self) -> str:
        """The parameter's dotted name relative to the block."""
        return self.param or f"{self.local_name}.weight"

    @property
    def matrices(self) -> int:
        """How many matrices the slot holds (E for a stack of experts, else 1)."""
        return max(self.experts, 1)

    @property
    def full_param(self) -> str:
        """The parameter's name in the whole model ("model.layers.0.mlp.experts.gate_up_proj")."""
        return self.full_name.removesuffix(self.local_name) + self.param_name

    def record_name(self, expert: int | None) -> str:
        """The report's name of one matrix: the full name, with ``[e]`` for expert e of a stack."""
        return self.full_name if expert is None else f"{self.full_name}[{expert}]"


def local_name_of(param: str) -> str:
    """The slot name of a block parameter: its module's name for a module's ``weight`` (as nn.Linear
    layers are named), else the parameter's own dotted name."""
    return param.removesuffix(".weight") if param.endswith(".weight") else param


# Module types whose 2D+ weights are not matmul weights of the block's computation.
_NOT_MATMUL = (nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def linear_slots(structure: ModelStructure) -> list[LinearSlot]:
    """Every weight matrix of every decoder block, as found without running it: the nn.Linear layers
    (block order, then module order) and every other parameter of two or more dimensions (fused expert
    stacks (E, a, b) as E matrices of a×b, bare 2D parameters, GPT-2's Conv1D) but embeddings' and
    convolutions'. The orientation of those others and their role (router, gate) are only known once the
    forward has been watched (`observed_slots`); until then they read (out, in) = their stored shape.
    """
    slots: list[LinearSlot] = []
    for index in range(len(structure)):
        linears = structure.block_linears(index)
        for local, linear in linears.items():
            full = structure.full_name(index, local)
            slots.append(LinearSlot(index, local, full, int(linear.out_features), int(linear.in_features)))
        skip = {f"{local}.weight" for local in linears}
        for module_name, module in structure.blocks[index].named_modules():
            if isinstance(module, _NOT_MATMUL):
                skip.update(f"{module_name}.{p}" if module_name else p for p, _ in module.named_parameters())
        for name, param in structure.blocks[index].named_parameters():
            if param.dim() < 2 or name in skip:
                continue
            local = local_name_of(name)
            out_features, in_features = (int(param.shape[-2]), int(param.shape[-1]))
            experts = int(param.shape[0]) if param.dim() == 3 else 0
            full = structure.full_name(index, local)
            slots.append(LinearSlot(index, local, full, out_features, in_features, name, experts))
    return slots


def observed_slots(structure: ModelStructure, index: int, observation: BlockObservation) -> list[LinearSlot]:
    """The weight matrices of block `index` as its forward used them (`observe.observe_block`), in order
    of first use: orientation, experts and role from the observation."""
    slots = []
    for unit in observation.units.values():
        local = local_name_of(unit.param)
        g = unit.geometry
        full = structure.full_name(index, local)
        slots.append(
            LinearSlot(
                index, local, full, g.out_features, g.in_features, unit.param, g.experts, g.transposed, unit.role
            )
        )
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
    """The incompatible linears (to skip), or IncompatibleModelError listing them when `skip` is False, or
    when none of `slots` could be pruned."""
    bad = incompatible_slots(slots, pattern)
    if bad and not skip:
        listed = "; ".join(f"{name}: {why}" for name, why in list(bad.items())[:6])
        more = f" (and {len(bad) - 6} more)" if len(bad) > 6 else ""
        raise IncompatibleModelError(
            f"{len(bad)} linear layer(s) cannot take {pattern.label}: {listed}{more}; "
            "choose an M that divides these dimensions or pass --skip-incompatible (or --ignore) to leave them dense"
        )
    if bad and len(bad) == len(slots):
        # Skipping everything would write an unpruned copy labelled with a pattern it does not have.
        name, why = next(iter(bad.items()))
        raise IncompatibleModelError(
            f"none of the {len(bad)} linear layers can take {pattern.label} (e.g. {name}: {why}), "
            "so nothing would be pruned; choose an M that divides the layer dimensions"
        )
    return bad


def dense_records(slot: LinearSlot, status: str, reason: str) -> list[LayerRecord]:
    """The records of a slot left dense: one, or one per expert of a stack."""
    experts: list[int | None] = list(range(slot.experts)) if slot.experts else [None]
    return [
        LayerRecord(
            slot.block,
            slot.record_name(expert),
            slot.out_features,
            slot.in_features,
            status,
            reason,
            param=slot.full_param,
            expert=expert,
            transposed=slot.transposed,
        )
        for expert in experts
    ]

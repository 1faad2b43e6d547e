"""The block-by-block runner shared by every method (layer-wise reconstruction, paper Section 4).

The model stays on the CPU; one decoder block and the calibration activations live on the compute
device. For each block: find its sequential groups by watching which linears read the same input,
run the calibration activations through it with forward hooks that accumulate each linear's input
statistics, prune the linears group by group (re-running the block between groups so later groups see
pruned inputs), run it once more so the next block sees pruned outputs, and move it back. A statistics
pass stops each sample's forward as soon as the group's linears have seen their input, so [q,k,v]
costs the input norm and three matmuls, not the whole block.

What a block is given is never built here: one forward of the model's own ``forward`` records the
arguments it passes each block (`capture_block_calls`), and the engine replays them with the hidden
states swapped. Invariant (checked at capture): for a batch-1 input of length T, every argument of
every block other than the hidden states (attention masks, sliding-window masks, rotary position
embeddings, position ids, cache flags) depends only on T, not on the token values; so one record per
calibration shape serves every sample, and only the hidden states differ between samples.

A block the forward does not run on text (Mllama's cross-attention layers, skipped without image
features) is recorded as such (`BlockCall.runs` False): its replay passes the hidden states on
unchanged, as the model's forward does, and the run leaves its linears dense (`idle_records`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from tsenor_cli.errors import BadInputError, IncompatibleModelError
from tsenor_cli.models.structure import ModelStructure
from tsenor_cli.progress import Progress
from tsenor_cli.pruning.distributed import Team
from tsenor_cli.pruning.memory import expert_chunk
from tsenor_cli.pruning.observe import BlockObservation, Unit, Use, every_token, matrices, observe_block, watching
from tsenor_cli.pruning.phases import phase
from tsenor_cli.pruning.registry import PrunerSpec
from tsenor_cli.pruning.stats import ExpertStats, InputStats, RowBuffer, reconstruction_error
from tsenor_cli.pruning.types import LayerPruneConfig, LayerRecord, PruneOutcome, SparsityPattern

HIDDEN_KEYWORD = "hidden_states"


@dataclass(frozen=True)
class LinearSlot:
    """A weight matrix of a decoder block, or a stack of expert matrices held in one parameter.

    local_name: the nn.Linear's module name inside the block ("self_attn.q_proj"), or for a parameter
    that is not a module's ``weight`` its dotted name ("mlp.experts.gate_up_proj"); full_name: the same
    in the whole model. out_features/in_features: of one matrix in nn.Linear's (out, in) orientation.
    param: the parameter's name relative to the block ("" means ``local_name + ".weight"``); experts: 0
    for one matrix, else E stacked matrices; transposed: stored (in, out) (GPT-2's Conv1D, gpt-oss and
    Llama-4 experts); role: "weight", or "router"/"gate" (left dense unless --targets names them).
    Everything but the nn.Linear fields is found by watching the forward (`pruning/observe.py`).
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


@dataclass(frozen=True, eq=False)
class BlockCall:
    """What the model's forward passes one decoder block, less the hidden states.

    args: the positional arguments after the hidden states; kwargs: the keyword arguments;
    hidden_keyword: None when the hidden states are the first positional argument, else their keyword.
    runs: False for a block the model's forward skips on this input (`BlockCall.idle`): no arguments,
    and replaying it returns the hidden states unchanged.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    hidden_keyword: str | None = None
    runs: bool = True

    @staticmethod
    def idle() -> BlockCall:
        """The record of a block the model's forward did not run."""
        return BlockCall((), {}, None, runs=False)

    @staticmethod
    def split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, BlockCall]:
        """(hidden states, the rest) of one call ``block(*args, **kwargs)``."""
        if args and isinstance(args[0], torch.Tensor):
            return args[0], BlockCall(tuple(args[1:]), dict(kwargs))
        hidden = kwargs.get(HIDDEN_KEYWORD)
        if isinstance(hidden, torch.Tensor):
            rest = {key: value for key, value in kwargs.items() if key != HIDDEN_KEYWORD}
            return hidden, BlockCall(tuple(args), rest, HIDDEN_KEYWORD)
        raise IncompatibleModelError(
            "the model calls its decoder blocks without hidden states (neither a first positional tensor nor "
            f"{HIDDEN_KEYWORD}=); tsenor cannot replay this architecture's blocks"
        )

    def bind(self, hidden: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """hidden: (B, T, H) → the (args, kwargs) of ``block(*args, **kwargs)`` on these hidden states."""
        if self.hidden_keyword is None:
            return (hidden, *self.args), self.kwargs
        return self.args, {**self.kwargs, self.hidden_keyword: hidden}

    def to(self, device: torch.device) -> BlockCall:
        """The same call with its tensors on `device`."""
        return BlockCall(_to_device(self.args, device), _to_device(self.kwargs, device), self.hidden_keyword, self.runs)


@dataclass(frozen=True, eq=False)
class BlockInputs:
    """hidden: (S, T, H) the calibration hidden states entering block 0; calls: per block, on the CPU."""

    hidden: torch.Tensor
    calls: tuple[BlockCall, ...]


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


class _Captured(Exception):
    """Raised by the pre-hook on block 0 to stop the forward once its input is known."""

    def __init__(self, hidden: torch.Tensor, call: BlockCall) -> None:
        super().__init__("captured")
        self.hidden = hidden
        self.call = call


class _AllRecorded(Exception):
    """Raised by the last block's recorder: the rest of the model's forward is not needed."""


class _GroupSeen(Exception):
    """Raised by a statistics hook once every linear of the group has seen the current sample's input."""


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


def _same(a: Any, b: Any) -> bool:
    """Whether two recorded arguments are equal: tensors by shape, dtype and every value; containers item by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    return type(a) is type(b) and bool(a == b)


def call_difference(a: BlockCall, b: BlockCall) -> str | None:
    """The first argument in which two calls of a block differ ("attention_mask", "positional argument 1"), or None."""
    if a.runs != b.runs:
        return "decision to run the block at all"
    if a.hidden_keyword != b.hidden_keyword:
        return "hidden-state argument"
    if len(a.args) != len(b.args):
        return "positional arguments"
    for position, (x, y) in enumerate(zip(a.args, b.args, strict=True)):
        if not _same(x, y):
            return f"positional argument {position + 1}"
    for key in sorted(a.kwargs.keys() | b.kwargs.keys()):
        if key not in a.kwargs or key not in b.kwargs or not _same(a.kwargs[key], b.kwargs[key]):
            return key
    return None


def output_like(template: Any, hidden: torch.Tensor) -> Any:
    """A block output shaped like `template` (a tensor, or a tuple led by the hidden states) carrying `hidden`."""
    if isinstance(template, torch.Tensor):
        return hidden
    if isinstance(template, tuple) and template and isinstance(template[0], torch.Tensor):
        return (hidden, *template[1:])
    raise IncompatibleModelError(
        f"decoder blocks return {type(template).__name__}; tsenor needs a tensor or a tuple led by the hidden states"
    )


@torch.no_grad()
def capture_block_calls(
    structure: ModelStructure, seq_len: int, *, tokens: torch.Tensor | None = None, embeds: torch.Tensor | None = None
) -> tuple[BlockCall, ...]:
    """What the model's own forward passes each decoder block for a batch-1 input of `seq_len` tokens.

    tokens: (1, seq_len) long, the probe input; zeros when None (the recorded arguments depend on the
    length only: see the module docstring). embeds: (1, seq_len, H) input embeddings to pass instead of
    tokens (`pruning/probe.py`: the dry run's model has no token embedding to read). Each block's
    forward is swapped, for this one call, for a recorder that returns its input unchanged, so no block
    computes and the record costs the embedding and mask/rotary set-up; block 0's real output, computed
    once, shows the return type the model's loop expects. Returns one BlockCall per block, on the
    model's device; a block the forward never ran gets `BlockCall.idle()` (IncompatibleModelError when
    no block ran).
    """
    blocks = structure.blocks
    inputs: dict[str, torch.Tensor]
    if embeds is not None:
        inputs = {"inputs_embeds": embeds}
    else:
        if tokens is None:
            device = next(structure.base.parameters()).device
            tokens = torch.zeros((1, seq_len), dtype=torch.long, device=device)
        if tuple(tokens.shape) != (1, seq_len):
            raise ValueError(f"tokens must be (1, {seq_len}), got shape {tuple(tokens.shape)}")
        inputs = {"input_ids": tokens}
    calls: dict[int, BlockCall] = {}
    template: list[Any] = []

    def recorder(index: int, real_forward: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            hidden, call = BlockCall.split(args, kwargs)
            if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (1, seq_len):
                raise IncompatibleModelError(
                    f"block {index} of {structure.blocks_name} got hidden states of shape "
                    f"{tuple(hidden.shape)}, not (1, {seq_len}, hidden); tsenor needs (batch, tokens, hidden) inputs"
                )
            if index in calls:
                raise IncompatibleModelError(
                    f"block {index} of {structure.blocks_name} runs twice in one forward; tsenor needs each "
                    "decoder block to run once"
                )
            calls[index] = call
            if not template:
                template.append(real_forward(*args, **kwargs))
            if len(calls) == len(blocks):
                raise _AllRecorded
            return output_like(template[0], hidden)

        return forward

    # The recorders go into the instance's __dict__, where they shadow the class's forward (hooks and
    # nn.Module.__call__ are unchanged); whatever was there before is put back.
    previous = [vars(block).get("forward") for block in blocks]
    try:
        for index, block in enumerate(blocks):
            vars(block)["forward"] = recorder(index, block.forward)
        with contextlib.suppress(_AllRecorded):
            structure.base(**inputs, use_cache=False)
    finally:
        for block, before in zip(blocks, previous, strict=True):
            if before is None:
                vars(block).pop("forward", None)
            else:
                vars(block)["forward"] = before
    if not calls:
        raise IncompatibleModelError(
            f"the forward of {type(structure.base).__name__} never ran a block of {structure.blocks_name} on "
            "text-only input; tsenor needs the decoder blocks to run on text"
        )
    return tuple(calls.get(index, BlockCall.idle()) for index in range(len(blocks)))


@torch.no_grad()
def capture_block_inputs(structure: ModelStructure, input_ids: torch.Tensor, device: torch.device) -> BlockInputs:
    """input_ids: (S, T) long → hidden states (S, T, H) entering decoder block 0 (on `device`) and every
    block's other arguments (on the model's device).

    The model's own forward runs up to block 0 (the first block that runs: blocks before it pass the
    hidden states on unchanged), whose pre-hook records its input and stops the forward,
    so whatever the architecture does before the blocks (embedding scale etc.) is kept. The block
    arguments are recorded for a zeros probe and compared with those of the first sample: they must not
    depend on the token values (the module docstring's invariant), else IncompatibleModelError.
    """
    seq_len = int(input_ids.shape[1])
    calls = capture_block_calls(structure, seq_len)
    first = capture_block_calls(structure, seq_len, tokens=input_ids[:1])
    for index, (probe, sample) in enumerate(zip(calls, first, strict=True)):
        differs = call_difference(probe, sample)
        if differs is not None:
            raise IncompatibleModelError(
                f"the {differs} that the model passes block {index} depends on the token values, not only on "
                "the sequence length; tsenor replays one record per calibration shape and cannot prune this model"
            )

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        raise _Captured(*BlockCall.split(args, kwargs))

    first_running = next(index for index, call in enumerate(calls) if call.runs)
    handle = structure.blocks[first_running].register_forward_pre_hook(hook, with_kwargs=True)
    captured: list[torch.Tensor] = []
    try:
        for row in input_ids:  # one sample at a time keeps the CPU memory at one sequence
            try:
                structure.base(input_ids=row[None, :], use_cache=False)
            except _Captured as caught:
                captured.append(caught.hidden.to(device))
            else:
                raise RuntimeError(
                    f"decoder block {first_running} was never called; the structure does not match this model"
                )
    finally:
        handle.remove()
    return BlockInputs(torch.cat(captured, 0), calls)  # hidden (S, T, H)


def block_output(block: nn.Module, call: BlockCall, hidden: torch.Tensor) -> torch.Tensor:
    """hidden: (B, T, H) → the block's output hidden states (B, T, H); `hidden` itself for an idle block."""
    if not call.runs:
        return hidden
    args, kwargs = call.bind(hidden)
    result = block(*args, **kwargs)
    return result[0] if isinstance(result, tuple) else result


@torch.no_grad()
def run_block(
    block: nn.Module,
    inputs: torch.Tensor,
    call: BlockCall,
    out: torch.Tensor | None,
    device: torch.device | None = None,
) -> None:
    """inputs: (S, T, H) → the block's outputs written into `out` (S, T, H), or discarded when None.

    One sample per call: the recorded arguments (masks, rotary) are for batch 1, and peak memory stays small.
    device: where the block computes; `inputs` and `out` may live elsewhere (the CPU with
    --offload-activations), each sample then travels to `device` and back (None: where `inputs` are).
    """
    for j in range(inputs.shape[0]):
        sample = inputs[j : j + 1] if device is None else inputs[j : j + 1].to(device)
        hidden = block_output(block, call, sample)
        if out is not None:
            out[j : j + 1] = hidden


def input_key(x: torch.Tensor) -> tuple[Any, ...]:
    """The identity of a tensor's view of memory: the same storage, offset, shape, strides and dtype."""
    return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x.device)


@torch.no_grad()
def linear_groups(
    block: nn.Module, linears: Mapping[str, nn.Linear], call: BlockCall, sample: torch.Tensor
) -> LinearGroups:
    """sample: (1, T, H) → the sequential groups of `linears`, observed in one forward of `block`
    (`observe.observe_block`, which `prune_block` uses for every weight matrix, seen from the linears).

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

    _each_linear_input(block, linears, inputs, call, device, stop_early, sink)
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

    _each_linear_input(block, linears, inputs, call, device, True, sink)
    return kept


def _each_linear_input(
    block: nn.Module,
    linears: dict[str, nn.Linear],
    inputs: torch.Tensor,
    call: BlockCall,
    device: torch.device,
    stop_early: bool,
    sink: Callable[[str, torch.Tensor], None],
) -> None:
    """Call sink(name, input) for each linear of `linears` as it runs, sample after sample (see
    `group_input_stats` for `stop_early`)."""
    pending: set[str] = set()  # the linears not yet called for the current sample

    def make_hook(name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], _output: Any) -> None:
            sink(name, args[0])
            pending.discard(name)
            if stop_early and not pending:
                raise _GroupSeen

        return hook

    handles = [linear.register_forward_hook(make_hook(name)) for name, linear in linears.items()]
    try:
        for j in range(inputs.shape[0]):  # one sample per call, as in run_block (the arguments are for batch 1)
            pending.update(linears)
            try:
                block_output(block, call, inputs[j : j + 1].to(device))
            except _GroupSeen:
                pass
            else:
                # A linear the forward never reaches would be pruned from empty statistics.
                if pending:
                    raise RuntimeError(f"{sorted(pending)} never ran in the block's forward")
    finally:
        for handle in handles:
            handle.remove()


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


@torch.no_grad()
def unit_input_stats(
    block: nn.Module,
    units: Mapping[str, Unit],
    inputs: torch.Tensor,
    call: BlockCall,
    device: torch.device,
    moe: MoeOptions,
    *,
    stop_early: bool = True,
) -> dict[str, InputStats | StackInputs]:
    """inputs: (S, T, H) → statistics of the inputs of each unit (parameters used as matmul weights, by
    name), gathered by watching the block's forward (`observe.watching`, only inside the units' scopes
    when every unit has one), one sample at a time.

    Single matrices get `InputStats` (what nn.Linear's hook path adds up, for Conv1D and bare 2D
    parameters); stacks of experts `StackInputs`, each row added to the expert it was routed to, in
    batched adds over several samples (`RowBuffer`). Experts below `moe.threshold` tokens (or all, under
    "all") then get every-token statistics from a second pass per routing module that re-calls it with
    every token sent to the experts any of its stacks needs (`observe.every_token`), stopped as soon as
    that call is done.
    """
    singles: dict[str, InputStats] = {}
    routed: dict[str, RowBuffer] = {}
    channel: list[str] = ["routed"]
    every: dict[str, RowBuffer] = {}
    pending: set[str] = set()
    stacks = {name for name, unit in units.items() if unit.geometry.experts}

    def on_use(use: Use) -> None:
        unit = units.get(use.param)
        if unit is None:
            return
        if channel[0] == "skip":
            return
        if channel[0] == "every":
            if use.experts is not None and use.param in every:
                every[use.param].add(use.rows, use.experts)
            return
        if use.experts is None:
            if use.param not in singles:
                singles[use.param] = InputStats(unit.geometry.in_features, gram=True, device=device)
            singles[use.param].add(use.rows)
        else:
            if use.param not in routed:
                g = unit.geometry
                # Without a routing module every token reaches every expert, scaled: not-routed rows are 0.
                zero_rows = unit.routing is None
                routed[use.param] = RowBuffer(
                    ExpertStats(g.experts, g.in_features, gram=True, device=device, zero_rows=zero_rows)
                )
            routed[use.param].add(use.rows, use.experts)  # under "all" too: the token counts of the report
        pending.discard(use.param)
        if stop_early and not stacks and not pending:
            raise _GroupSeen

    scopes = {unit.scope for unit in units.values()}
    result: dict[str, InputStats | StackInputs] = {}
    with watching(block, on_use, scopes=None if None in scopes else cast(set[str], scopes)):
        for j in range(inputs.shape[0]):
            pending.update(units)
            with contextlib.suppress(_GroupSeen):
                block_output(block, call, inputs[j : j + 1].to(device))
        for name in units:
            if name not in singles and name not in routed:
                raise RuntimeError(f"{name} never ran in the block's forward")
        result.update(singles)
        counts = {name: routed[name].flush() for name in stacks}
        chosen: dict[str, list[int]] = {}
        for name in stacks:
            g = units[name].geometry
            if units[name].routing is None:  # every token reaches every expert already (Llama-4): nothing to add
                chosen[name] = []
            elif moe.calibration == "all":
                chosen[name] = list(range(g.experts))
            else:
                low = (counts[name].tokens < moe.threshold(g.in_features)).nonzero().flatten()
                chosen[name] = low.tolist()
        by_routing: dict[str, list[str]] = {}
        for name in stacks:
            if chosen[name]:
                by_routing.setdefault(cast(str, units[name].routing), []).append(name)
        every_stats: dict[str, ExpertStats] = {}
        for routing, names in by_routing.items():
            for name in names:
                g = units[name].geometry
                every[name] = RowBuffer(
                    ExpertStats(g.experts, g.in_features, gram=True, device=device, zero_rows=False)
                )
            wanted = sorted({e for name in names for e in chosen[name]})
            channel[0] = "skip"  # the routed call before each re-call was counted in the first pass
            try:
                _every_token_pass(
                    block, routing, units[names[0]].geometry.experts, wanted, inputs, call, device, channel
                )
            finally:
                channel[0] = "routed"
            every_stats.update({name: every.pop(name).flush() for name in names})
        for name in units:
            if name in stacks:
                result[name] = StackInputs(counts[name], every_stats.get(name), frozenset(chosen[name]))
    return result


def _every_token_pass(
    block: nn.Module,
    routing: str,
    total: int,
    experts: list[int],
    inputs: torch.Tensor,
    call: BlockCall,
    device: torch.device,
    channel: list[str],
) -> None:
    """Run each sample up to the routing module `routing` (of `total` experts), re-call it with every token
    sent to `experts` (the caller's watch adds those inputs while channel[0] is "every") and stop the
    forward there."""

    def stop() -> None:
        raise _GroupSeen

    @contextlib.contextmanager
    def recording() -> Iterator[None]:
        previous, channel[0] = channel[0], "every"
        try:
            yield
        finally:
            channel[0] = previous

    chosen = torch.tensor(experts, device=device)
    with every_token(block, routing, total, chosen, after=stop, around=recording):
        for j in range(inputs.shape[0]):
            with contextlib.suppress(_GroupSeen):
                block_output(block, call, inputs[j : j + 1].to(device))


def observe_blocks(
    structure: ModelStructure,
    sample: torch.Tensor,
    calls: Sequence[BlockCall],
    first: int,
    device: torch.device,
    *,
    resident: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
) -> dict[int, BlockObservation]:
    """sample: (1, T, H) the input of block `first` → {block: what its dense forward showed} for blocks
    `first`.., each run on the dense output of the one before (`observe.observe_block`).

    resident(index): a context in which block `index` holds its weights (a streamed run reads it from the
    checkpoint and releases it after; `pruning/streamed.BlockSource.resident`); None: they always do."""
    found: dict[int, BlockObservation] = {}
    hidden = sample.to(device)
    for index in range(first, len(structure)):
        if not calls[index].runs:  # an idle block (idle_records) passes its input on unchanged
            continue
        with resident(index) if resident is not None else contextlib.nullcontext():
            block = structure.blocks[index]
            block.to(device)
            call = calls[index].to(device)
            found[index] = observe_block(
                block, functools.partial(block_output, block, call, hidden), input_key=input_key
            )
            out = torch.empty_like(hidden)
            run_block(block, hidden, call, out)
            hidden = out
            block.to("cpu")
    return found


def record_line(record: LayerRecord, spec: PrunerSpec) -> str:
    """The progress line of one pruned linear."""
    gap = f", gap {record.gap:.2e}" if record.gap is not None else ""
    its = f", {record.iterations} ADMM iters" if spec.iterative else ""
    return f"  {record.name}: rel. error {record.recon_error:.4f}{gap}{its}, {record.seconds:.1f}s"


def _non_finite_inputs(slot: LinearSlot, weight: torch.Tensor) -> BadInputError:
    # The weights were checked at load, so what is not finite are the inputs the block computed for it.
    return BadInputError(
        f"the calibration inputs of {slot.full_name} hold NaN/Inf (e.g. activations that overflow in "
        f"{weight.dtype}); try --dtype fp32 (nothing was written)"
    )


def _prune_linear(
    linear: nn.Linear,
    slot: LinearSlot,
    stats: InputStats,
    spec: PrunerSpec,
    layer_cfg: LayerPruneConfig,
    device: torch.device,
    progress: Progress,
) -> LayerRecord:
    return _prune_matrix(linear.weight.data, slot, stats, spec, layer_cfg, device, progress)


def _record_outcome(
    weight: torch.Tensor,
    dense: torch.Tensor,
    outcome: PruneOutcome,
    gram: torch.Tensor,
    slot: LinearSlot,
    expert: int | None,
    spec: PrunerSpec,
    seconds: float,
    progress: Progress,
    *,
    tokens: int | None = None,
    note: str | None = None,
) -> LayerRecord:
    """Write `outcome` into `weight` (the stored view, cast to its dtype) and record it. dense: (out, in)
    float32 copy of the weight before pruning; gram: (in, in) XᵀX of its inputs for the error."""
    weight.copy_(outcome.weight.to(weight.dtype))
    stored = weight.to(torch.float32)  # the error of what is saved, after the dtype cast
    error = reconstruction_error(dense, stored, gram)
    if not math.isfinite(error):
        raise _non_finite_inputs(slot, weight)
    solve = outcome.solve
    record = LayerRecord(
        block=slot.block,
        name=slot.record_name(expert),
        out_features=slot.out_features,
        in_features=slot.in_features,
        status="pruned",
        reason=note,
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
        param=slot.full_param,
        expert=expert,
        tokens=tokens,
        transposed=slot.transposed,
    )
    progress(record_line(record, spec))
    return record


def _prune_matrix(
    weight: torch.Tensor,
    slot: LinearSlot,
    stats: InputStats,
    spec: PrunerSpec,
    layer_cfg: LayerPruneConfig,
    device: torch.device,
    progress: Progress,
) -> LayerRecord:
    """Prune one (out, in) matrix in place. weight: a view in the stored dtype that writes through to the
    parameter (an nn.Linear's weight, or the one matrix of a 2D parameter, transposed for (in, out))."""
    dense = weight.to(torch.float32).clone()  # (out, in)
    if not bool(torch.isfinite(stats.sq_norms).all()):  # (in,): any NaN/Inf input reaches its column's sum
        raise _non_finite_inputs(slot, weight)
    _sync(device)
    start = time.perf_counter()
    with phase("updates", layer=slot.record_name(None)):
        outcome = spec.prune(dense, stats, layer_cfg)
    _sync(device)
    seconds = time.perf_counter() - start
    return _record_outcome(weight, dense, outcome, stats.require_gram(), slot, None, spec, seconds, progress)


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
    block: nn.Module,
    slot: LinearSlot,
    unit: Unit,
    stats: InputStats | StackInputs,
    spec: PrunerSpec,
    layer_cfg: LayerPruneConfig,
    moe: MoeOptions,
    device: torch.device,
    progress: Progress,
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
        return [_prune_matrix(views[0], slot, stats, spec, layer_cfg, device, progress)]
    records = []
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
        with phase("updates", layer=f"{slot.full_param}[{first}:{first + ids.numel()}]"):
            outcomes = spec.prune_batch(dense, batch, layer_cfg)
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
                    slot,
                    expert,
                    spec,
                    seconds,
                    progress,
                    tokens=int(stats.routed.tokens[expert]),
                    note=_expert_note(expert, stats, unit, moe, threshold),
                )
            )
    return records


def prune_block(
    block: nn.Module,
    index: int,
    structure: ModelStructure,
    slots: Sequence[LinearSlot],
    skipped: Mapping[str, str],
    inputs: torch.Tensor,
    call: BlockCall,
    spec: PrunerSpec,
    layer_cfg: LayerPruneConfig,
    *,
    sequential: bool,
    device: torch.device,
    progress: Progress,
    ignored: Mapping[str, str] | None = None,
    stop_early: bool = True,
    team: Team | None = None,
    moe: MoeOptions | None = None,
    observation: BlockObservation | None = None,
) -> list[LayerRecord]:
    """Prune the weight matrices of one block (already on `device`, `call` too) in place; one record per
    matrix (per expert for a stack).

    inputs: (S, T, H) the block's calibration inputs (this rank's shard in a distributed run; on the CPU
    with --offload-activations, else on `device`). skipped / ignored: {full name: reason} of slots left
    dense because their shape cannot take the pattern / because the user or a rule (routers) excluded
    them. The matrices and their groups come from one watched forward of the dense block on the first
    sample (`observe.observe_block`). Groups of nn.Linear layers only take their statistics through
    module hooks (`group_input_stats`), as before parameters were watched; groups with other matrices
    (expert stacks, Conv1D, bare parameters) through the watch (`unit_input_stats`). stop_early: cut each
    statistics pass at the group's matrices (see `group_input_stats`); False runs the whole block per
    group, same results. team: the ranks of a distributed run (distributed.py): per group every rank
    runs its shard, the statistics are summed rank after rank in sample order (`Team.ordered_statistics`,
    what one process computes, bit for bit) to each linear's owner, which prunes it and broadcasts the
    weight; None or a team of one is this process alone. observation: the block's watched dense forward
    when already made (`observe_blocks`, before pruning), else it is made here. Records come in pruning
    order, then any matrix that never runs.
    """
    team = team if team is not None else Team.solo(device)
    moe = moe if moe is not None else MoeOptions()
    ignored = ignored or {}
    if not call.runs:
        return idle_records(index, structure, slots, ignored, progress)
    linears = structure.block_linears(index, block)
    by_param = {slot.param_name: slot for slot in slots if slot.block == index}
    records: dict[str, list[LayerRecord]] = {}
    with team.agreed():
        observed = observation
        if observed is None:
            with phase("statistics"):
                sample = inputs[:1].to(device)
                observed = observe_block(
                    block, functools.partial(block_output, block, call, sample), input_key=input_key
                )
        for name, slot in by_param.items():
            for status, reasons in (("ignored", ignored), ("skipped", skipped)):
                if slot.full_name in reasons:
                    records[name] = _dense_records(slot, status, reasons[slot.full_name])
                    break
            else:
                unit = observed.units.get(name)
                _check_runs_once(slot, unit.calls if unit is not None else 0)
    order = tuple(name for name in observed.order if name in by_param)
    groups = tuple(tuple(n for n in g if n in by_param) for g in observed.groups) if sequential else (order,)
    for group in groups:
        active = [name for name in group if name not in records]
        if not active:
            continue
        # An nn.Linear whose weight the forward multiplies without calling it (Unit.left) has no hook inputs.
        hooked = [n for n in active if by_param[n].local_name in linears and not observed.units[n].left]
        as_linears = {by_param[n].local_name: n for n in hooked}
        if len(as_linears) < len(active):
            if team.distributed:
                raise IncompatibleModelError(
                    f"{by_param[active[0]].full_name} is not an nn.Linear (an expert stack, Conv1D or bare "
                    "parameter); --nproc prunes nn.Linear layers only: run with one process"
                )
            units = {n: observed.units[n] for n in active}
            with phase("statistics"):
                unit_stats = unit_input_stats(block, units, inputs, call, device, moe, stop_early=stop_early)
            for name in active:
                records[name] = _prune_unit(
                    block, by_param[name], units[name], unit_stats.pop(name), spec, layer_cfg, moe, device, progress
                )
            continue
        local = {by_param[n].local_name: by_param[n] for n in active}
        group_linears = {name: linears[name] for name in local}
        owners = team.owners([[(n, local[n].out_features, local[n].in_features) for n in local]])
        with phase("statistics"):
            with team.agreed():
                if team.distributed:
                    kept = group_inputs(block, group_linears, inputs, call, device, keep=inputs.device)
                else:
                    stats = group_input_stats(block, group_linears, inputs, call, device, stop_early=stop_early)
            if team.distributed:
                in_features = {name: local[name].in_features for name in local}
                stats = team.ordered_statistics(kept, in_features, owners)
                del kept
        mine: dict[str, LayerRecord] = {}
        with team.agreed():
            for name in local:
                if owners[name] == team.rank:
                    mine[name] = _prune_linear(
                        linears[name], local[name], stats.pop(name), spec, layer_cfg, device, progress
                    )
        team.broadcast_weights(group_linears, owners)
        pruned = team.gather_objects(mine)
        for name in local:
            records[local[name].param_name] = [pruned[name]]
            if owners[name] != team.rank:
                progress(record_line(pruned[name], spec) + f" (rank {owners[name]})")
    never_ran = [name for name in by_param if name not in order]
    return [record for name in (*order, *never_ran) for record in records[name]]


def _dense_records(slot: LinearSlot, status: str, reason: str) -> list[LayerRecord]:
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


def idle_records(
    index: int,
    structure: ModelStructure,
    slots: Sequence[LinearSlot],
    ignored: Mapping[str, str],
    progress: Progress,
) -> list[LayerRecord]:
    """The records of block `index`, which the model's forward does not run on text-only input
    (`BlockCall.runs` False; Mllama's cross-attention layers): its linears have no calibration inputs
    and stay dense, each "skipped" with the reason, or "ignored" when the user excluded it."""
    kind = type(structure.blocks[index]).__name__
    reason = f"its block ({kind}) never runs in the text-only forward, so it has no calibration inputs"
    progress(f"  {structure.blocks_name}.{index} ({kind}) never runs on text: left dense")
    return [
        record
        for slot in slots
        if slot.block == index
        for record in _dense_records(
            slot, "ignored" if slot.full_name in ignored else "skipped", ignored.get(slot.full_name, reason)
        )
    ]

"""Which parameters of a decoder block are matrix weights, found by watching the block's forward.

A decoder block of 2026 holds its weights in several forms: `nn.Linear` modules, GPT-2's `Conv1D`
(weight stored (in, out)), routers that are a bare 2D parameter, and the routed experts of a mixture of
experts as one fused 3D parameter (transformers 5: ``experts.gate_up_proj`` (E, 2I, H), used per expert
through `F.linear`, or whole through ``grouped_mm`` / ``bmm``; gpt-oss and Llama-4 store (E, in, out);
DBRX keeps (E·I, H) 2D parameters viewed per expert). None of that is looked up by name here: a
`torch.overrides.TorchFunctionMode` sees every matmul-like call of the forward (`F.linear`, `matmul`,
`mm`, `addmm`, `bmm`, `grouped_mm`) and maps its weight argument back to the block parameter whose
memory it views. From the view's offset and strides and from how the call uses it ((out, in) for
`linear`, (in, out) for the others) follow, per parameter:

- the matrices it holds: one, or E stacked experts (the offset of each used matrix gives its expert);
- their orientation: stored (out, in) like `nn.Linear`, or transposed (in, out);
- which input rows went to which expert: all rows of a call on ``param[e]``, batch b of a `bmm`, the
  segments of a `grouped_mm` (its offsets): the tokens the router actually sent there.

A parameter may also be the *left* operand of a matmul, ``W @ X`` with W (out, in) and X (..., in,
tokens) (transformers' Jamba mixer computes ``self.dt_proj.weight @ time_step.transpose(1, 2)``): its
inputs are then the columns of X, and W X = (Xᵀ Wᵀ)ᵀ is a linear on them, so the same layer-wise
reconstruction (and every method) applies to Xᵀ's rows unchanged. Its module is never called, so
only this watch sees its inputs (`Unit.left`).

Roles, also by observation: a matrix whose output reaches a `topk`/`sort`/`argmax` (through any ops but
another matrix) computes routing logits, a *router*; a matrix with one output per token scales a branch,
a *gate*. Both are left dense by default (llm-compressor's examples ignore routers too: routing
decisions are fragile). A block parameter of two or more dimensions that the forward never uses as a
matmul weight (a depthwise convolution, a weight used only through a gathered copy) is reported as such.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

Role = Literal["weight", "router", "gate"]
Usage = Literal["out_in", "in_out"]

# func → (input position, weight position, how the weight is read, call kind)
_CallKind = Literal["single", "batched", "grouped"]
_MATMULS: dict[Any, tuple[int, int, Usage, _CallKind]] = {
    F.linear: (0, 1, "out_in", "single"),
    torch.matmul: (0, 1, "in_out", "single"),
    torch.Tensor.matmul: (0, 1, "in_out", "single"),
    torch.Tensor.__matmul__: (0, 1, "in_out", "single"),
    torch.mm: (0, 1, "in_out", "single"),
    torch.Tensor.mm: (0, 1, "in_out", "single"),
    torch.addmm: (1, 2, "in_out", "single"),  # Conv1D: addmm(bias, x, weight (in, out))
    torch.bmm: (0, 1, "in_out", "batched"),
    torch.Tensor.bmm: (0, 1, "in_out", "batched"),
}
# grouped_mm is reached as torch.nn.functional.grouped_mm or, in older releases, as the operator
# torch._grouped_mm; both read (S, in) rows against (G, in, out) weights split by cumulative offsets.
_GROUPED_NAMES = frozenset({"grouped_mm", "_grouped_mm"})
# Ops after which a tensor is the same values as a parameter (a dtype cast copy, e.g. DeepSeek-V3's
# router runs F.linear(x.float(), weight.float())).
_CASTS = frozenset({"to", "type", "float", "bfloat16", "half", "double", "contiguous"})
# Ops whose input being routing logits makes the matrix that produced them a router.
_ROUTING = frozenset({"topk", "sort", "argsort", "argmax", "kthvalue"})


class UnsupportedUse(Exception):
    """A parameter used as a matmul weight through a view tsenor cannot map to whole matrices."""


@dataclass(frozen=True)
class Geometry:
    """How one parameter holds its matrices.

    experts: 0 for a single matrix, else the number E of stacked matrices; out_features/in_features: of
    one matrix; transposed: stored (in, out) rather than nn.Linear's (out, in); stored: the shape of
    one stored matrix ((out, in), or (in, out) when transposed).
    """

    experts: int
    out_features: int
    in_features: int
    transposed: bool

    @property
    def stored(self) -> tuple[int, int]:
        return (self.in_features, self.out_features) if self.transposed else (self.out_features, self.in_features)

    @property
    def count(self) -> int:
        """How many matrices the parameter holds (1 for a single matrix)."""
        return max(self.experts, 1)


def matrices(param: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """param → its matrices as a view (count, out, in) in nn.Linear's orientation (writes go through)."""
    stored = param.view(geometry.count, *geometry.stored)  # (count, a, b): the parameter is contiguous
    return stored.transpose(1, 2) if geometry.transposed else stored


@dataclass
class Unit:
    """A block parameter the forward uses as matrix weights.

    param: its dotted name relative to the block; calls: matmul calls that used it in one forward;
    role: "weight" (to prune), "router" or "gate" (left dense by default); routing: the innermost module
    containing it that received the routing indices, for statistics over every token (None when the
    forward sends every token to every matrix of it, or when it holds one matrix); left: the forward
    multiplies it as the left operand W @ X (module docstring), so an nn.Linear holding it is never
    called and its inputs are seen only by the watch; scope: the innermost module containing it whose
    forward was running at every use (None: a use outside every such module, or through a cast copy),
    so that statistics need watch only that module's forward (`watching(..., scopes=...)`).
    """

    param: str
    geometry: Geometry
    calls: int = 0
    role: Role = "weight"
    routing: str | None = None
    left: bool = False
    scope: str | None = None


@dataclass(frozen=True)
class BlockObservation:
    """What one dense forward of a block showed.

    units: {parameter name: Unit} in the order of first use; groups: units reading the same input
    tensor, groups in the order their input appeared; unused: {parameter name: why} for the block's
    parameters of two or more dimensions that are not matmul weights of the forward.
    """

    units: dict[str, Unit]
    groups: tuple[tuple[str, ...], ...]
    unused: dict[str, str]

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(name for group in self.groups for name in group)


@dataclass(frozen=True)
class Use:
    """One matmul call on a unit: rows (n, in) of its input, and the expert of each row (n,) long, or
    None for a single-matrix parameter; source: the input tensor as the call got it; left: the unit was
    the left operand (W @ X, rows are X's columns); cast: the weight operand was a cast copy of the
    parameter, not a view of its memory."""

    param: str
    geometry: Geometry
    rows: torch.Tensor
    experts: torch.Tensor | None
    source: torch.Tensor
    left: bool = False
    cast: bool = False


def _layout(shape: Sequence[int], strides: Sequence[int]) -> bool | None:
    """For a 2D view (r, c): False when row-major, True when it is the transpose of a row-major (c, r)
    matrix, None when neither (a strided slice)."""
    r, c = shape
    s0, s1 = strides
    if (c == 1 or s1 == 1) and (r == 1 or s0 == c):
        return False
    if (r == 1 or s0 == 1) and (c == 1 or s1 == r):
        return True
    return None


@dataclass
class _Params:
    """The block's parameters by the address of their storage, plus cast copies seen during a forward."""

    by_storage: dict[int, tuple[str, torch.Tensor]]
    aliases: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    latest: dict[str, torch.Tensor] = field(default_factory=dict)  # the newest cast copy of each parameter

    @staticmethod
    def of(block: nn.Module) -> _Params:
        found: dict[int, tuple[str, torch.Tensor]] = {}
        for name, param in block.named_parameters():
            if param.dim() >= 2 and param.device.type != "meta":
                found[param.untyped_storage().data_ptr()] = (name, param)
        return _Params(found)

    def alias(self, copy: torch.Tensor, name: str, param: torch.Tensor) -> None:
        """Remember `copy` (a cast of `param`) as the parameter. A cast copy is multiplied by right after it
        is made, so only the newest one per parameter is kept alive (its id cannot be reused meanwhile)."""
        previous = self.latest.get(name)
        if previous is not None:
            self.aliases.pop(id(previous), None)
        self.latest[name] = copy
        self.aliases[id(copy)] = (name, param)

    def resolve(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor, int] | None:
        """(name, parameter, element offset of `tensor` in it) when `tensor` views a block parameter."""
        alias = self.aliases.get(id(tensor))
        if alias is not None:
            return alias[0], alias[1], 0
        if tensor.device.type == "meta":
            return None
        hit = self.by_storage.get(tensor.untyped_storage().data_ptr())
        if hit is None:
            return None
        name, param = hit
        return name, param, int(tensor.storage_offset()) - int(param.storage_offset())

    def is_cast(self, tensor: torch.Tensor) -> bool:
        """`tensor` is a cast copy of a parameter (`alias`), not a view of its memory."""
        return id(tensor) in self.aliases


def _geometry(param: torch.Tensor, weight: torch.Tensor, offset: int, usage: Usage) -> tuple[Geometry, list[int]]:
    """The geometry of `param` implied by using `weight` (2D (r, c) or 3D (B, r, c)) as a weight read as
    `usage`, and the expert of each of weight's matrices (one, or B)."""
    if not param.is_contiguous():
        raise UnsupportedUse("the parameter is not contiguous")
    batched = weight.dim() == 3
    r, c = weight.shape[-2:]
    transposed_view = _layout((r, c), weight.stride()[-2:])
    if transposed_view is None or r * c == 0:
        raise UnsupportedUse(f"a strided view {tuple(weight.shape)} of it")
    numel = r * c
    if param.numel() % numel:
        raise UnsupportedUse(f"matrices of {r}×{c} that do not tile it")
    count = param.numel() // numel
    starts = [offset + b * weight.stride(0) for b in range(weight.shape[0])] if batched else [offset]
    if any(start % numel or not 0 <= start < param.numel() for start in starts):
        raise UnsupportedUse(f"a {r}×{c} view that is not one of its whole matrices")
    # The used matrix U = weight is (out, in) for linear, (in, out) otherwise; stored is U or Uᵀ.
    used_in_out = usage == "in_out"
    out_features, in_features = (c, r) if used_in_out else (r, c)
    transposed = used_in_out != transposed_view
    experts = count if (param.dim() >= 3 or count > 1) else 0
    return Geometry(experts, int(out_features), int(in_features), transposed), [s // numel for s in starts]


# A weight's use as the watch caches it: its geometry, the expert of each matrix a call used, and the
# same as a (G,) long tensor on the input's device.
_View = tuple[Geometry, list[int], torch.Tensor]


class _Watch(TorchFunctionMode):
    """Calls `on_use` for every matmul-like call whose weight is a block parameter; optionally tracks
    which unit's output each tensor derives from, to find routers (`taint`)."""

    def __init__(
        self, params: _Params, on_use: Callable[[Use], None], problems: dict[str, str], *, taint: bool = False
    ) -> None:
        super().__init__()
        self.params = params
        self.on_use = on_use
        self.taint = taint
        self.sources: dict[int, frozenset[str]] = {}  # id(tensor) → units its values come from
        self.routers: set[str] = set()
        self.problems = problems  # parameter → why it is not a matmul weight tsenor can prune
        self.touched: dict[str, set[str]] = {}  # parameter → functions that read it
        self._held: list[Any] = []  # tainted tensors stay alive so that their ids are not reused
        # (parameter, offset, shape, strides, usage, device) → the geometry, the expert of each used matrix
        # and those as a tensor: a forward repeats the same views, and a 64-expert stack's checks were a
        # fifth of the watch's cost per call (docs/measurements/benchmarks-moe.md).
        self._views: dict[tuple[Any, ...], _View] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        used = self._matmul(func, name, args, kwargs)
        result = func(*args, **kwargs)
        if name in _CASTS and args and isinstance(args[0], torch.Tensor) and isinstance(result, torch.Tensor):
            found = self.params.resolve(args[0])
            if found is not None and found[2] == 0 and result.shape == found[1].shape:
                self.params.alias(result, found[0], found[1])
        if self.taint:
            self._propagate(name, used, args, kwargs, result)
        return result

    def _matmul(self, func: Any, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
        """Report the call when it is a matmul on a block parameter; the parameter's name, or None."""
        spec = _MATMULS.get(func)
        kind: _CallKind
        if spec is not None:
            x_pos, w_pos, usage, kind = spec
        elif name in _GROUPED_NAMES:
            x_pos, w_pos, usage, kind = 0, 1, "in_out", "grouped"
        else:
            if self.taint:
                self._note_reads(name, args, kwargs)
            return None
        if len(args) <= max(x_pos, w_pos):
            return None
        x, weight = args[x_pos], args[w_pos]
        if not isinstance(weight, torch.Tensor) or not isinstance(x, torch.Tensor):
            return None
        found = self.params.resolve(weight)
        left = False
        if found is None and kind != "grouped" and usage == "in_out" and x.dim() >= 2 and weight.dim() >= 2:
            # W @ X with the parameter on the left: (W @ X)ᵀ = Xᵀ @ Wᵀ, a linear of W read (out, in)
            # on the columns of X.
            found = self.params.resolve(x)
            if found is not None:
                left, usage = True, "out_in"
                x, weight = weight.transpose(-1, -2), x
        if found is None:
            if self.taint:
                self._note_reads(name, args, kwargs)
            return None
        param_name, param, offset = found
        if (kind == "single") != (weight.dim() == 2) or weight.dim() not in (2, 3):
            self.problems.setdefault(param_name, f"used by {name} with a {weight.dim()}D weight")
            return None
        try:
            key = (param_name, offset, tuple(weight.shape), weight.stride(), usage, x.device)
            view = self._views.get(key)
            if view is None:
                geometry, experts = _geometry(param, weight, offset, usage)
                view = self._views[key] = (geometry, experts, torch.tensor(experts, dtype=torch.long, device=x.device))
            geometry = view[0]
            rows, ids = _rows(kind, x, view, args, kwargs)
        except UnsupportedUse as exc:
            self.problems.setdefault(param_name, f"used by {name} through {exc}")
            return None
        self.on_use(Use(param_name, geometry, rows, ids, x, left, self.params.is_cast(x if left else weight)))
        return param_name

    def _note_reads(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                found = self.params.resolve(value)
                if found is not None:
                    self.touched.setdefault(found[0], set()).add(name or "an op")

    def _propagate(
        self, name: str, used: str | None, args: tuple[Any, ...], kwargs: Mapping[str, Any], result: Any
    ) -> None:
        if used is not None:
            sources = frozenset({used})  # a matrix's output derives from that matrix alone
        else:
            inputs = [self.sources.get(id(t), frozenset()) for t in _tensors((args, kwargs))]
            sources = frozenset().union(*inputs) if inputs else frozenset()
            if name in _ROUTING:
                self.routers |= sources
        if sources:
            for tensor in _tensors(result):
                self.sources[id(tensor)] = sources
                self._held.append(tensor)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _rows(
    kind: _CallKind, x: torch.Tensor, view: _View, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The input rows (n, in) of a call (args, kwargs: a grouped call's offsets) and the expert of each
    row (n,) long (None: a single matrix); view: the weight's geometry, the expert of each matrix the call
    used, and the same (G,) long on x's device."""
    geometry, experts, table = view
    width = geometry.in_features
    rows = x.reshape(-1, width)
    if kind == "single":
        if not geometry.experts:
            return rows, None
        return rows, torch.full((rows.shape[0],), experts[0], dtype=torch.long, device=x.device)
    if kind == "batched":  # x (B, T, in): batch b went to matrix b
        per = x.shape[-2]
        return rows, table.repeat_interleave(per)
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    if not isinstance(offs, torch.Tensor):
        raise UnsupportedUse("grouped_mm without offsets")
    ends = offs.to(device=x.device, dtype=torch.long)  # (G,) cumulative row counts
    used = int(ends[-1]) if ends.numel() else 0
    group = torch.searchsorted(ends, torch.arange(used, device=x.device), right=True)  # (n,) matrix of each row
    return rows[:used], table[group]


def matrix_parameters(block: nn.Module) -> dict[str, tuple[int, ...]]:
    """{parameter name: shape} of the block's parameters of two or more dimensions (the candidates)."""
    return {name: tuple(p.shape) for name, p in block.named_parameters() if p.dim() >= 2}


def _routing_argument(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], experts: int
) -> tuple[int | str, int | str] | None:
    """Where (position or keyword) a module call got its routing: an integer (T, k) tensor of expert
    indices and a float tensor of the same shape (their weights)."""
    named = [(i, v) for i, v in enumerate(args)] + list(kwargs.items())
    indices = [
        (key, v)
        for key, v in named
        if isinstance(v, torch.Tensor) and v.dim() == 2 and not v.is_floating_point() and v.dtype != torch.bool
    ]
    for key, value in indices:
        if value.numel() and int(value.min()) >= 0 and int(value.max()) < experts:
            for wkey, weights in named:
                if isinstance(weights, torch.Tensor) and weights.is_floating_point() and weights.shape == value.shape:
                    return key, wkey
    return None


@torch.no_grad()
def observe_block(
    block: nn.Module, run: Callable[[], Any], *, input_key: Callable[[torch.Tensor], Any]
) -> BlockObservation:
    """Run the block once (`run()`, the dense forward on one sample) under the watch; see the module docstring.

    input_key(x): the identity of an input tensor's memory (`replay.input_key`); units whose inputs share
    it form a group.
    """
    params = _Params.of(block)
    units: dict[str, Unit] = {}
    keys: dict[str, Any] = {}
    held: list[torch.Tensor] = []
    problems: dict[str, str] = {}

    # on_use must not refer to the watch: the cycle would keep the block's weights (held by the watch's
    # `_Params`) alive until Python's cycle collector runs, which a streamed run (BlockSource.release) must
    # not wait for: host memory then grew with depth (1.05 GiB of mapped checkpoint at 32 blocks, against
    # 0.66 at 8, docs/measurements/bench-memory.md).
    active: list[str] = []  # the modules holding parameters whose forward is running, outermost first
    enclosing: dict[str, set[str]] = {}  # parameter → its modules that were running at every use of it

    def on_use(use: Use) -> None:
        unit = units.get(use.param)
        if unit is None:
            unit = units[use.param] = Unit(use.param, use.geometry, left=use.left)
            keys[use.param] = input_key(use.source)
            held.append(use.source)
        elif unit.geometry != use.geometry or unit.left != use.left:
            problems.setdefault(use.param, "used with two different shapes or orientations")
        unit.calls += 1
        # A cast copy may be made outside the module that multiplies it: only views scope the watch.
        around = set() if use.cast else {m for m in active if use.param.startswith(m + ".")}
        enclosing[use.param] = enclosing.get(use.param, around) & around

    watch = _Watch(params, on_use, problems, taint=True)
    calls: dict[str, tuple[Any, ...]] = {}
    handles = _install_hooks(block, calls, active)
    try:
        with watch:
            run()
    finally:
        for handle in handles:
            handle.remove()
    for name in watch.problems:
        units.pop(name, None)
    _settle(units, watch, calls, enclosing)
    groups: dict[Any, list[str]] = {}
    for name in units:
        groups.setdefault(keys[name], []).append(name)
    held.clear()
    return BlockObservation(units, tuple(tuple(g) for g in groups.values()), _unused(block, units, watch))


def _install_hooks(block: nn.Module, calls: dict[str, tuple[Any, ...]], active: list[str]) -> list[Any]:
    """Hooks on the block's modules holding parameters: each records its call's arguments in `calls` and
    keeps `active` (the modules whose forward is running, outermost first); the handles to remove them."""
    holding = [(name, module) for name, module in block.named_modules() if name in _modules_holding(block)]
    handles = [module.register_forward_pre_hook(_recorder(name, calls), with_kwargs=True) for name, module in holding]
    for name, module in holding:
        handles.append(module.register_forward_pre_hook(functools.partial(_enter, active, name)))
        handles.append(module.register_forward_hook(functools.partial(_leave, active), always_call=True))
    return handles


def _settle(
    units: dict[str, Unit], watch: _Watch, calls: dict[str, tuple[Any, ...]], enclosing: dict[str, set[str]]
) -> None:
    """What the whole forward shows of each unit: its role (a router's or a one-output gate's), an expert
    stack's routing (from the recorded `calls`), and its scope (the innermost module running at every
    use, from `enclosing`)."""
    for unit in units.values():
        if unit.param in watch.routers:
            unit.role = "router"
        elif unit.geometry.out_features == 1:
            unit.role = "gate"
        if unit.geometry.experts:
            unit.routing = _find_routing(unit, calls)
        unit.scope = max(enclosing.get(unit.param, ()), key=len, default=None)


def _unused(block: nn.Module, units: dict[str, Unit], watch: _Watch) -> dict[str, str]:
    """{name: why} of the block's parameters of two or more dimensions that are no unit."""
    unused: dict[str, str] = {}
    for name in matrix_parameters(block):
        if name in units:
            continue
        if name in watch.problems:
            unused[name] = watch.problems[name]
        elif name in watch.touched:
            unused[name] = f"not a matmul weight of the forward (read by {', '.join(sorted(watch.touched[name]))})"
        else:
            unused[name] = "never read by the block's forward on this input"
    return unused


def _modules_holding(block: nn.Module) -> set[str]:
    """Names (relative to the block) of the modules that contain a 3D parameter, or a 2D one other than
    an nn.Linear's: where routing indices may be passed to experts."""
    names: set[str] = set()
    for pname, param in block.named_parameters():
        if param.dim() >= 2:
            parts = pname.split(".")[:-1]
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return names


def _enter(active: list[str], name: str, _module: nn.Module, _args: tuple[Any, ...]) -> None:
    active.append(name)


def _leave(active: list[str], _module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
    active.pop()


def _recorder(name: str, calls: dict[str, tuple[Any, ...]]) -> Callable[..., None]:
    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.setdefault(name, (args, kwargs))

    return hook


def _find_routing(unit: Unit, calls: Mapping[str, tuple[Any, ...]]) -> str | None:
    """The innermost module holding `unit` whose call carried routing indices over its experts."""
    parts = unit.param.split(".")[:-1]
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if module in calls:
            args, kwargs = calls[module]
            if _routing_argument(args, kwargs, unit.geometry.experts) is not None:
                return module
    return None


@contextlib.contextmanager
def watching(
    block: nn.Module, on_use: Callable[[Use], None], *, scopes: Collection[str] | None = None
) -> Iterator[None]:
    """Report every matmul on the block's parameters to `on_use` while the block runs inside.

    scopes: watch only while these modules' forwards run (the units' `Unit.scope`), not the whole
    block's. The watch costs a Python call per torch function: on a tiny Qwen3-MoE block the whole-block
    watch added a third to its forward, the experts module's alone a few percent
    (docs/measurements/benchmarks-moe.md)."""
    watch = _Watch(_Params.of(block), on_use, {})
    if scopes is None:
        with watch:
            yield
        return
    depth = [0]  # scopes may nest, and an experts module may be re-called from its own forward hook

    def enter(_module: nn.Module, _args: tuple[Any, ...]) -> None:
        if depth[0] == 0:
            watch.__enter__()
        depth[0] += 1

    def leave(_module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            watch.__exit__(None, None, None)

    handles = []
    for name in scopes:
        module = block.get_submodule(name)
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def every_token(
    block: nn.Module,
    module_name: str,
    total: int,
    experts: torch.Tensor,
    after: Callable[[], None] | None = None,
    around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Iterator[None]:
    """While inside, each call of the routing module `module_name` is followed by a second call, for the
    statistics only, that sends every token to each of `experts` (1D long, of the `total` experts the
    module routes among) with weight 1; the block's output stays the routed one. around(): the context
    the second call runs in (e.g. to tell its matmuls from the routed call's); after(): runs once the
    second call is done (e.g. to stop the forward).

    This is llm-compressor's "calibrate all experts" done without replacing modules: the routing
    arguments are found by their shape and values (`_routing_argument`), not by the module's signature.
    """
    module = block.get_submodule(module_name)
    busy: list[bool] = []

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], _output: Any) -> None:
        if busy:
            return
        where = _routing_argument(args, kwargs, total)
        if where is None:  # this call routed nothing (seen at observation, so not expected here)
            return
        index_key, weight_key = where
        index = _get(args, kwargs, index_key)
        weight = _get(args, kwargs, weight_key)
        tokens = index.shape[0]
        all_index = experts.to(index.device, index.dtype)[None, :].expand(tokens, -1).contiguous()
        all_weight = torch.ones((tokens, experts.numel()), dtype=weight.dtype, device=weight.device)
        new_args, new_kwargs = _put(args, kwargs, index_key, all_index)
        new_args, new_kwargs = _put(new_args, new_kwargs, weight_key, all_weight)
        busy.append(True)
        try:
            with around():
                mod(*new_args, **new_kwargs)
        finally:
            busy.clear()
        if after is not None:
            after()

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _get(args: tuple[Any, ...], kwargs: Mapping[str, Any], key: int | str) -> torch.Tensor:
    value = args[key] if isinstance(key, int) else kwargs[key]
    assert isinstance(value, torch.Tensor)
    return value


def _put(
    args: tuple[Any, ...], kwargs: dict[str, Any], key: int | str, value: torch.Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(key, int):
        return (*args[:key], value, *args[key + 1 :]), kwargs
    return args, {**kwargs, key: value}

"""Several processes pruning one model together (torchrun; design in docs/design/distributed.md).

`Team` is what the runner sees of them. Rank r holds a contiguous shard of the calibration samples
(`shard`) and runs every block on it; each prunable linear has one owner rank (`assign_owners`); a
linear's input statistics are gathered to its owner and added in rank order (`Team.ordered_statistics`), the
owner prunes it and broadcasts the new weight (`broadcast_weights`). Every phase that can fail ends in
`agreed()`, an all-reduce of a status flag, so that a failure on any rank stops every rank with that
rank's error instead of leaving the others waiting in a collective.

A team of one (`Team.solo`) is the single-process run: every method returns at once without touching
torch.distributed, so that path computes exactly what it computed before distribution existed.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tsenor_cli.errors import DEBUG_HINT, PeerError, TsenorError, one_line
from tsenor_cli.pruning.methods.stats import InputStats
from tsenor_cli.settings import DistributedContext

# A rank waits in a collective while an owner prunes a layer (ALPS on a 14336×4096 layer takes minutes
# on a slow device); the default 10-30 minutes would cut a healthy run, failures are reported at once by
# `agreed` anyway, and a rank that dies is seen by torchrun, which stops the others.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)
UNEXPECTED_EXIT = 1


def shard_bounds(nsamples: int, world_size: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank's contiguous shard of `nsamples`: sizes differ by at most one, the first
    nsamples % world_size ranks take the extra sample. Deterministic in (nsamples, world_size) only."""
    base, extra = divmod(nsamples, world_size)
    bounds, start = [], 0
    for rank in range(world_size):
        stop = start + base + (1 if rank < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def linear_cost(out_features: int, in_features: int) -> int:
    """The expected cost of pruning one (out, in) linear: in³ for the Gram work (factorization, eigen-
    decomposition, CG) of SparseGPT and ALPS plus out·in for the per-weight updates and the mask."""
    return in_features**3 + out_features * in_features


def assign_owners(
    groups: Sequence[Sequence[tuple[str, int, int]]], world_size: int, loads: list[int] | None = None
) -> dict[str, int]:
    """{name: owner rank} for the linears of `groups`, each (name, out_features, in_features).

    The linears of one group are pruned at the same time (the next group needs their pruned outputs), so
    each group is balanced on its own: largest `linear_cost` first, each to the rank with the least cost
    in this group, ties to the least cumulative cost (`loads`, updated in place; so one-linear groups
    take turns) and then the lowest rank. Deterministic: the same groups give the same owners.
    """
    total = loads if loads is not None else [0] * world_size
    owners: dict[str, int] = {}
    for group in groups:
        in_group = [0] * world_size
        for name, out_features, in_features in sorted(group, key=lambda g: (-linear_cost(g[1], g[2]), g[0])):
            rank = min(range(world_size), key=lambda r: (in_group[r], total[r], r))
            cost = linear_cost(out_features, in_features)
            in_group[rank] += cost
            total[rank] += cost
            owners[name] = rank
    return owners


@dataclass(frozen=True)
class _Failure:
    """What one rank tells the others about its error (exceptions do not all pickle)."""

    rank: int
    message: str
    exit_code: int


class Team:
    """The processes of one run, seen from one of them; `Team.solo(device)` for a run of one process.

    device: this rank's compute device. comm_device: where collectives take their tensors (the CUDA
    device for NCCL, the CPU for gloo).
    """

    def __init__(self, place: DistributedContext, device: torch.device) -> None:
        self.place = place
        self.rank = place.rank
        self.world_size = place.world_size
        self.device = device
        self.comm_device = device if device.type == "cuda" else torch.device("cpu")
        self._cost: list[int] = [0] * place.world_size

    @classmethod
    def solo(cls, device: torch.device) -> Team:
        return cls(DistributedContext(), device)

    @property
    def distributed(self) -> bool:
        return self.place.distributed

    @property
    def is_root(self) -> bool:
        return self.place.is_root

    def shard(self, nsamples: int) -> slice:
        """This rank's rows of the (nsamples, ...) calibration tensors."""
        start, stop = shard_bounds(nsamples, self.world_size)[self.rank]
        return slice(start, stop)

    def owners(self, groups: Sequence[Sequence[tuple[str, int, int]]]) -> dict[str, int]:
        """`assign_owners` for this block's groups, balancing with the costs of the blocks before."""
        return assign_owners(groups, self.world_size, self._cost)

    # ------------------------------------------------------------------ failures

    @contextlib.contextmanager
    def agreed(self) -> Iterator[None]:
        """Run the block, then learn whether it failed on any rank; if so every rank raises.

        The failing rank with the lowest number wins: it raises its own error when it is rank 0, and
        every other rank raises `PeerError` with its line and exit code (rank 0 prints it; the CLI keeps
        the other ranks quiet). Alone, the error is raised unchanged.
        """
        error: Exception | None = None
        try:
            yield
        except Exception as exc:  # every rank must hear of it before any waits in the next collective
            if not self.distributed:
                raise
            error = exc
        if self.distributed:
            _settle(self, error)

    def first_set(self, value: str | None) -> str | None:
        """The `value` of the lowest rank where it is not None (e.g. the signal that asked some ranks to
        stop), on every rank; None when it is None everywhere."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, value)
        return next((item for item in everyone if item is not None), None)

    # ------------------------------------------------------------------ statistics and weights

    def ordered_statistics(
        self, kept: Mapping[str, Sequence[torch.Tensor]], in_features: Mapping[str, int], owners: Mapping[str, int]
    ) -> dict[str, InputStats]:
        """kept: {name: this rank's inputs of the linear, one per sample in order} → {name: the statistics of
        the whole calibration} for the linears this rank owns.

        The sums run along the ranks in sample order: rank 0 adds its samples from zero and sends the sums
        to rank 1, which adds its own and passes them on; the last rank sends them to the owner. Each
        rank adds its inputs exactly as one process would (`InputStats.add`, sample after sample, from the
        sums of the samples before), so the statistics are bit for bit those of a single-process run,
        whatever the world size and timing. The forwards ran in parallel before; here the linears of a
        group pipeline through the ranks (rank 0 starts the next linear while rank 1 adds the first).
        Linears whose kept inputs are the same tensors (`group_inputs` keeps one copy for q/k/v, and one
        for gate/up) share one chain of sums, sent to each of their owners, as one process shares one
        `InputStats` among them (`gather.group_input_stats`).
        """
        import torch.distributed as dist

        last = self.world_size - 1
        owned: dict[str, InputStats] = {}
        pending: list[Any] = []  # sends in flight and the owners' receives of finished sums
        finals: list[tuple[list[str], torch.Tensor]] = []  # (the names this rank owns, their sums in flight)
        for names in shared_input_classes(kept):  # the same classes in the same order on every rank
            n = in_features[names[0]]
            stats = InputStats(n, gram=True, device=self.device)
            if self.rank > 0:
                received = torch.empty(_packed_size(n), device=self.comm_device)
                dist.recv(received, src=self.rank - 1)
                _unpack(received, stats)
            for x in kept[names[0]]:
                stats.add(x)
            if self.rank < last:
                packed = _pack(stats).to(self.comm_device)
                pending.append((dist.isend(packed, dst=self.rank + 1), packed))
            mine = [name for name in names if owners[name] == self.rank]
            if self.rank == last:
                others = [owner for owner in dict.fromkeys(owners[name] for name in names) if owner != last]
                if others:  # packed only when the sums leave this rank
                    packed = _pack(stats).to(self.comm_device)
                    pending.extend((dist.isend(packed, dst=owner), packed) for owner in others)
                owned.update(dict.fromkeys(mine, stats))
            elif mine:
                buffer = torch.empty(_packed_size(n), device=self.comm_device)
                pending.append((dist.irecv(buffer, src=last), buffer))
                finals.append((mine, buffer))
        for handle, _buffer in pending:
            handle.wait()
        for mine, packed in finals:
            stats = InputStats(in_features[mine[0]], gram=True, device=self.device)
            _unpack(packed, stats)
            owned.update(dict.fromkeys(mine, stats))
        return owned

    def broadcast_weights(self, linears: Mapping[str, nn.Linear], owners: Mapping[str, int]) -> None:
        """Every rank gets each linear's weight as its owner pruned it (in the order of `linears`)."""
        if not self.distributed:
            return
        import torch.distributed as dist

        for name, linear in linears.items():
            weight = linear.weight.data
            buffer = weight if weight.device == self.comm_device else weight.to(self.comm_device)
            dist.broadcast(buffer, src=owners[name])
            if buffer is not weight:
                weight.copy_(buffer)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Rank `src`'s `tensor` on every rank (the others pass a buffer of the same shape and dtype), on
        `tensor`'s device."""
        if not self.distributed:
            return tensor
        import torch.distributed as dist

        buffer = tensor.to(self.comm_device)
        dist.broadcast(buffer, src=src)
        return buffer.to(tensor.device)

    def gather_objects(self, mine: Mapping[str, Any]) -> dict[str, Any]:
        """{name: value} from every rank merged on every rank (names are disjoint across ranks)."""
        if not self.distributed:
            return dict(mine)
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, dict(mine))
        merged: dict[str, Any] = {}
        for part in everyone:
            merged.update(part)
        return merged

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value if self.is_root else None]
        dist.broadcast_object_list(box, src=0, device=self.comm_device)
        return box[0]

    def gather_samples(self, shard: torch.Tensor, nsamples: int) -> torch.Tensor | None:
        """shard: (S_r, T, H) this rank's rows → on rank 0 all (nsamples, T, H) rows in sample order (on
        the CPU, for the resume state), None elsewhere. Sample by sample, so no device holds more than one
        sample per rank."""
        if not self.distributed:
            return shard
        import torch.distributed as dist

        bounds = shard_bounds(nsamples, self.world_size)
        longest = max(stop - start for start, stop in bounds)
        row_shape = tuple(shard.shape[1:])
        whole = torch.empty((nsamples, *row_shape), dtype=shard.dtype) if self.is_root else None
        for j in range(longest):
            row = shard[j] if j < shard.shape[0] else torch.zeros(row_shape, dtype=shard.dtype)
            row = row.to(self.comm_device)
            rows = [torch.empty_like(row) for _ in range(self.world_size)] if self.is_root else None
            dist.gather(row, rows, dst=0)
            if whole is not None and rows is not None:
                for rank, (start, stop) in enumerate(bounds):
                    if start + j < stop:
                        whole[start + j] = rows[rank].cpu()
        return whole


def _settle(team: Team, error: Exception | None) -> None:
    """`Team.agreed`'s end on every rank: the lowest failing rank (if any) is found by one all-reduce and
    tells the others its line and exit code; rank 0 raises its own error, every other rank `PeerError`."""
    import torch.distributed as dist

    flag = torch.tensor([team.rank if error is not None else team.world_size], device=team.comm_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    first = int(flag.item())
    if first == team.world_size:
        return
    box: list[Any] = [None]
    if team.rank == first:
        assert error is not None
        box[0] = _describe(error, team.rank)
    dist.broadcast_object_list(box, src=first, device=team.comm_device)
    failure: _Failure = box[0]
    if team.rank == first and team.is_root:
        assert error is not None
        raise error
    raise PeerError(failure.message, failure.exit_code) from error


def shared_input_classes(kept: Mapping[str, Sequence[torch.Tensor]]) -> list[list[str]]:
    """{name: kept inputs} → the names in classes of linears whose inputs are the very same tensors,
    in the order of `kept` (a linear with no inputs is its own class)."""
    classes: list[list[str]] = []
    for name, inputs in kept.items():
        for names in classes:
            other = kept[names[0]]
            if inputs and len(other) == len(inputs) and all(a is b for a, b in zip(other, inputs, strict=True)):
                names.append(name)
                break
        else:
            classes.append([name])
    return classes


def _packed_size(n: int) -> int:
    """Float32 elements of packed statistics of a linear with n inputs: norms, Gram, the token count."""
    return n + n * n + 2


def _pack(stats: InputStats) -> torch.Tensor:
    """stats → (n + n² + 2,) float32: column sums, Gram, and the int64 token count's bits (exact)."""
    tokens = torch.tensor([stats.tokens], dtype=torch.int64, device=stats.sq_norms.device).view(torch.float32)
    return torch.cat([stats.sq_norms, stats.require_gram().reshape(-1), tokens])


def _unpack(packed: torch.Tensor, stats: InputStats) -> None:
    """The inverse of `_pack`, into `stats` (overwritten)."""
    n = stats.in_features
    packed = packed.to(stats.sq_norms.device)
    stats.sq_norms.copy_(packed[:n])
    stats.require_gram().copy_(packed[n : n + n * n].reshape(n, n))
    stats.tokens = int(packed[n + n * n :].contiguous().view(torch.int64).item())


def _describe(error: Exception, rank: int) -> _Failure:
    """The line and exit code that every rank reports for `error` raised on `rank`."""
    where = f"rank {rank}: " if rank else ""
    if isinstance(error, TsenorError):
        return _Failure(rank, where + one_line(str(error)), error.exit_code)
    message = f"unexpected {type(error).__name__}: {one_line(str(error))}; {DEBUG_HINT}"
    return _Failure(rank, where + message, UNEXPECTED_EXIT)


@contextlib.contextmanager
def joined(place: DistributedContext, device: torch.device) -> Iterator[Team]:
    """This process's `Team`: solo for a world of one; otherwise the default process group (gloo on the
    CPU, NCCL on CUDA), joined through torchrun's rendezvous (env://) and left at the end, or the one
    the caller already joined (tests), which is left as it is."""
    if not place.distributed:
        yield Team.solo(device)
        return
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    owned = not dist.is_initialized()
    if owned:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=place.rank, world_size=place.world_size, timeout=COLLECTIVE_TIMEOUT)
    elif (dist.get_rank(), dist.get_world_size()) != (place.rank, place.world_size):
        raise RuntimeError(
            f"the process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"the run context says {place.rank} of {place.world_size}"
        )
    try:
        yield Team(place, device)
    finally:
        if owned:
            dist.destroy_process_group()

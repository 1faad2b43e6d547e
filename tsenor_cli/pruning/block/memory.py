"""The one memory estimate of a run (device and host), and whether the run fits the machine.

The device estimate (`estimate_device_memory` → `MemoryEstimate` per rank) is built from what the code
allocates, term by term: the block, the calibration activations, the input statistics, and the
method's working set for the largest matrix (`matrix_workspace`: the dense copy, the method's
buffers, its factorization's workspace, the mask solver's, the engine's error check), each the peak of
the phase that holds the most. `tests/test_memory_estimate.py` holds it against a CPU accounting of
every allocation (torch.profiler's memory events, internal LAPACK workspaces included) of real runs.

A prune whose calibration set cannot fit (``--nsamples 1000000000``) would otherwise allocate for
minutes and die inside torch's allocator. `check_fits` compares the plan's host estimate
(`HostEstimate`) with the memory this process may still take (`available_host_bytes`: the kernel's
MemAvailable, or the cgroup's remaining limit under SLURM or a container when that is smaller) and
the device estimate with the device's total memory; an estimate beyond its limit is refused with one
line (`DoesNotFitError`, exit 5) naming the flags that would make it fit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tsenor_cli.background import WRITER_DEPTH
from tsenor_cli.errors import DoesNotFitError
from tsenor_cli.outputs import human_bytes

if TYPE_CHECKING:
    from tsenor_cli.pattern import SparsityPattern
    from tsenor_cli.pruning.block.slots import LinearSlot
    from tsenor_cli.pruning.methods.registry import PrunerSpec

TOKEN_BYTES = 8  # int64 token ids

# The mask solver's peak beyond the scores it is given, in float32 copies of them (4·out·in bytes),
# by the solver that runs (`solver.resolve_method`): torch.profiler's CPU accounting of magnitude
# pruning alone (dense copy + scores + solver), at 2:4 to 16:32 on 64..512-wide matrices; tsenor's is
# its worst there (16-26 copies by shape, so up to 1.5x high; the Triton kernels it runs on CUDA fuse
# some of them: the H100's ADMM phase held about 10). `tests/test_memory_estimate.py` holds each entry.
# Measured again after the solver came to read the device once per sum: bi_nm 2 copies fewer.
SOLVER_COPIES: dict[str, float] = {
    "flow": 7.8,
    "exhaustive": 7.8,
    "exact": 10.4,
    "two_approx": 10.6,
    "bi_nm": 9.5,
    "tsenor-reference": 13.4,
    "tsenor": 24.5,
}
# A row-wise top-n (N:M and unstructured patterns): the top-k's indices and values.
TOPK_COPIES = 1.5
# cuBLAS and cuBLASLt keep their workspaces in torch's caching allocator on CUDA (counted by
# max_memory_allocated: the measured peaks above sit 45-50 MB over the rest of this estimate).
CUDA_LIBRARY_BYTES = 64 << 20


@dataclass(frozen=True)
class MethodCost:
    """What one method's working set is computed from: the method, whose `PrunerSpec.workspace` gives the
    formula, and what its buffers depend on besides the matrix's shape.

    solver_copies: the mask solver's peak in float32 copies of its scores (`SOLVER_COPIES`, `TOPK_COPIES`
    for patterns that are not transposable); cuda: the run's device is a GPU (its factorizations' and
    libraries' workspaces); cast: the model's dtype is not float32 (the error check holds a float32 copy
    of the stored weight); group: the pattern's M, the columns one N:M mask choice spans (None for
    unstructured sparsity). The defaults are the largest: a GPU with the tsenor solver.
    """

    method: PrunerSpec
    solver_copies: float = SOLVER_COPIES["tsenor"]
    cuda: bool = True
    cast: bool = True
    group: int | None = 32

    @staticmethod
    def of(spec: PrunerSpec, pattern: SparsityPattern, solver: str, *, device: torch.device, width: int) -> MethodCost:
        """The cost of `spec` on `pattern` with `--solver solver` on `device` (width: bytes per element of
        the model's dtype)."""
        from tsenor_cli.solver import resolve_method

        copies = TOPK_COPIES
        if pattern.kind == "transposable":
            name = resolve_method(solver, device, pattern.m).name
            copies = SOLVER_COPIES.get(name, max(SOLVER_COPIES.values()))
        group = pattern.m if pattern.kind != "unstructured" else None
        return MethodCost(spec, copies, device.type == "cuda", width != 4, group)

    def worst(self) -> MethodCost:
        """The same method at its largest: on a GPU with the tsenor solver (`expert_chunk`)."""
        return MethodCost(self.method)

    def record(self, out_features: int, in_features: int) -> int:
        """Every method's last phase, the engine's error check (`engine._record_outcome`): the dense copy,
        the pruned weight and mask, the stored weight in float32 when cast, ΔW, ΔW·H and its product:
        (5 + cast)F + B, F = 4·out·in (a float32 matrix), B = out·in (a bool mask)."""
        f, b = 4 * out_features * in_features, out_features * in_features
        return (6 if self.cast else 5) * f + b

    def solver(self, out_features: int, in_features: int) -> int:
        """The mask solver's peak on (out, in) scores: S = `solver_copies`·F."""
        return int(self.solver_copies * (4 * out_features * in_features))


def matrix_workspace(out_features: int, in_features: int, cost: MethodCost) -> int:
    """Peak bytes while one (out, in) matrix is pruned, beyond its statistics (XᵀX and norms, counted
    in `MemoryEstimate.statistics`): the method's own (`PrunerSpec.workspace`, each method's formula in its
    module, read from its code), never less than the engine's error check (`MethodCost.record`)."""
    return max(cost.record(out_features, in_features), cost.method.workspace(out_features, in_features, cost))


# The experts of a stack go to the method together in chunks whose buffers stay under this many bytes
# (`matrix_workspace` per expert): the solver and the method's products then run once per chunk instead
# of once per expert, while a 256-expert stack at DeepSeek-V3's width (7168 × 2048) still needs only a
# few experts' buffers at a time.
EXPERT_BATCH_BYTES = 1 << 30


def expert_chunk(out_features: int, in_features: int, spec: PrunerSpec) -> int:
    """How many experts of an (out, in) stack one batched call takes (`EXPERT_BATCH_BYTES`, each expert's
    workspace as on a GPU with the tsenor solver: the largest)."""
    each = matrix_workspace(out_features, in_features, MethodCost(spec))
    return max(1, EXPERT_BATCH_BYTES // each)


def slot_workspace(slot: LinearSlot, cost: MethodCost) -> int:
    """Bytes of method buffers while `slot` is pruned: one matrix's, or for a stack one chunk of experts'
    (`expert_chunk`) with the chunk's copy of their statistics (`ExpertStats.select`)."""
    each = matrix_workspace(slot.out_features, slot.in_features, cost)
    if not slot.experts:
        return each
    chunk = matrix_workspace(slot.out_features, slot.in_features, cost.worst())
    batch = min(slot.experts, max(1, EXPERT_BATCH_BYTES // chunk))
    return batch * (each + 4 * (slot.in_features**2 + slot.in_features))


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak device memory of one rank (bytes), by what holds it.

    block: the largest decoder block's parameters; activations: this rank's calibration hidden states
    entering and leaving the block, (S_r, T, H) twice, or one sample's with --offload-activations, plus
    in a distributed run the group's linear inputs kept for the ordered sums (S_r, T, in) (on the CPU
    with --offload-activations); statistics: the input statistics (XᵀX and column norms) of a block's
    linears taken as one group, in a distributed run twice (the sums in flight to the next rank) plus one
    linear's being added; workspace: the method's working set for the largest matrix
    (`matrix_workspace`), for a stack of experts that of one batched chunk (`slot_workspace`), or one
    sample's block forward when larger (`forward_bytes`), on CUDA with the libraries' workspaces, and the
    block's call arguments (mask, rotary embeddings). With
    --refine block, activations also hold the dense stream (S_r, T, H) (one sample with
    --offload-activations), and refine: the largest block in float32 with its gradients and Adam's two
    moments, its weights before refinement in the run's dtype, and one sample's forward kept for
    backward (each of the block's matrices' input and output, float32).
    """

    rank: int
    block: int
    activations: int
    statistics: int
    workspace: int
    refine: int = 0

    @property
    def total(self) -> int:
        return self.block + self.activations + self.statistics + self.workspace + self.refine

    def to_dict(self) -> dict[str, int]:
        return {
            "rank": self.rank,
            "block": self.block,
            "activations": self.activations,
            "statistics": self.statistics,
            "workspace": self.workspace,
            "refine": self.refine,
            "total": self.total,
        }


def forward_bytes(candidates: Sequence[LinearSlot], *, seqlen: int, width: int, heads: int) -> int:
    """Bytes one sample's block forward holds at its peak (the statistics passes and the rerun run one
    sample at a time): every linear's output (T, out) of the largest block, the (T, T) attention weights
    of each head in float32 (an eager or math attention; fused kernels hold less), and the statistics'
    float32 copy of a linear's input and its square (T, in) twice."""
    blocks = {s.block for s in candidates}
    outputs = max((sum(s.matrices * s.out_features for s in candidates if s.block == b) for b in blocks), default=0)
    widest = max((s.in_features for s in candidates), default=0)
    return seqlen * outputs * width + heads * seqlen * seqlen * 4 + 2 * seqlen * widest * 4


def estimate_device_memory(
    block_params: Sequence[int],
    candidates: Sequence[LinearSlot],
    cost: MethodCost,
    *,
    nsamples: int,
    seqlen: int,
    hidden_size: int,
    width: int,
    heads: int = 0,
    world_size: int = 1,
    offload_activations: bool = False,
    sequential: bool = True,
    refine: int = 0,
    gathers: bool = True,
) -> list[MemoryEstimate]:
    """One `MemoryEstimate` per rank. block_params: parameter count of each block; candidates: the linears
    to prune (none when --targets selects only linears outside the language model); cost: the method's
    (`MethodCost.of`); width: bytes per element of the model's dtype (statistics are float32); heads:
    the attention heads (`forward_bytes`); refine: the dense streams --refine block holds (`RefineConfig.streams`:
    0 off, 2 with sub-blocks' boundary values; `MemoryEstimate.refine`); gathers:
    the method reads input statistics (`PrunerSpec.needs_data`; magnitude gathers none: no statistics,
    and no linear inputs kept by a distributed rank).

    The workspace is the larger of the method's working set for the largest matrix (`slot_workspace`)
    and one sample's forward (`forward_bytes`), which never run at once. These are torch's allocated
    bytes (`torch.cuda.max_memory_allocated`, the H100 run's measure); what the caching allocator
    reserves beyond them (its fragmentation: the H100 run did not record it) is not estimated, so a
    GPU filled to the estimate's last percent may still run out.
    """
    from tsenor_cli.pruning.block.distributed import shard_bounds

    blocks = len(block_params)
    # The engine holds one sequential group's statistics at a time (its linears share their input's);
    # the plan does not know the groups before a watch, so every linear of the block counts: exact
    # without --sequential, at most one block's other Gram matrices high with it (LLaMA-3.2-1B: 101 MB
    # over down_proj's 268 MB). A stack of E experts holds E Gram matrices at once (`stats.ExpertStats`).
    stats_size = [
        sum(s.matrices * (s.in_features**2 + s.in_features) for s in candidates if s.block == i) for i in range(blocks)
    ]
    statistics = 4 * max(stats_size) if gathers else 0
    kept_features = 0  # per token, the linear inputs a distributed rank keeps for one group
    if world_size > 1 and gathers:
        statistics = 2 * statistics + 4 * max((s.in_features**2 + s.in_features for s in candidates), default=0)
        per_block = [sum(s.in_features for s in candidates if s.block == i) for i in range(blocks)]
        # One group's linears read one input (LLaMA's q,k,v; gate,up); without --sequential the block is
        # one group and every linear's input counts (an upper bound: shared inputs are kept once).
        kept_features = max((s.in_features for s in candidates), default=0) if sequential else max(per_block)
    # No candidate when --targets selects only linears outside the language model (pruning/block/outside.py).
    method = max((slot_workspace(s, cost) for s in candidates), default=0)
    workspace = max(method, forward_bytes(candidates, seqlen=seqlen, width=width, heads=heads))
    workspace += CUDA_LIBRARY_BYTES if cost.cuda else 0
    # What the model passes each block beside its hidden states (`engine.BlockCall`), held on the device
    # through the block: a (T, T) mask and the rotary cos and sin (T, head_dim), float32 (an upper bound).
    workspace += 4 * seqlen * seqlen + 2 * 4 * seqlen * hidden_size
    estimates = []
    for rank, (start, stop) in enumerate(shard_bounds(nsamples, world_size)):
        rows = 1 if offload_activations else stop - start
        activations = 2 * rows * seqlen * hidden_size * width  # block inputs and outputs
        if not offload_activations:
            activations += (stop - start) * seqlen * kept_features * width
        training = 0
        if refine:
            activations += refine * rows * seqlen * hidden_size * width  # the dense stream (and boundaries)
            features = max(
                sum(s.matrices * (s.in_features + s.out_features) for s in candidates if s.block == i)
                for i in range(blocks)
            )
            training = max(block_params) * (4 * 4 + width) + 4 * seqlen * (features + 4 * hidden_size)
        estimates.append(MemoryEstimate(rank, max(block_params) * width, activations, statistics, workspace, training))
    return estimates


@dataclass(frozen=True)
class HostEstimate:
    """Peak host (CPU) memory of one process of a run (its largest rank's), in bytes.

    model: the model's parameters every process holds (the whole model, or with --stream what lies
    outside the decoder blocks and the largest block: `streamed`); tokens: the calibration token
    ids (S, T) and the (S, T) index that cuts them out of the text (every process reads all samples);
    activations: the calibration activations when they live on the CPU: on a CPU run the device
    estimate's (`MemoryEstimate.activations`; every sample's even with --offload-activations, which
    moves nothing there), with --offload-activations on a GPU the rank's hidden states
    entering and leaving a block, (S_r, T, H) twice (a distributed group's kept inputs not counted: an
    estimate that errs low refuses no run that fits), and with --refine the dense stream (S_r, T, H) too;
    work: on a CPU run, the rank's statistics, method buffers and refinement
    (`MemoryEstimate.statistics` + `workspace` + `refine`); writer: what the background writer holds
    (`background.py`, `WRITER_DEPTH` payloads): with a resume state, rank 0's copy of the next
    block's inputs (S, T, H) (and the dense stream's with --refine), plus a streamed run's pruned block;
    streamed without one, the pruned block it keeps on disk.
    """

    model: int
    tokens: int
    activations: int
    work: int
    streamed: bool = False
    writer: int = 0

    @property
    def total(self) -> int:
        return self.model + self.tokens + self.activations + self.work + self.writer

    def describe(self) -> str:
        """The parts for a person: "model 12.3 MiB, calibration tokens 1.0 MiB, ..."."""
        weights = "weights outside the blocks + one block" if self.streamed else "model"
        return (
            f"{weights} {human_bytes(self.model)}, calibration tokens {human_bytes(self.tokens)}, "
            f"activations {human_bytes(self.activations)}, work {human_bytes(self.work)}"
            + (f", background writes {human_bytes(self.writer)}" if self.writer else "")
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "model": self.model,
            "tokens": self.tokens,
            "activations": self.activations,
            "work": self.work,
            "writer": self.writer,
            "total": self.total,
            "streamed": int(self.streamed),
        }


def host_estimate(
    device_estimate: MemoryEstimate,
    *,
    device: torch.device,
    params: int,
    nsamples: int,
    seqlen: int,
    hidden_size: int,
    width: int,
    rows: int,
    offload_activations: bool,
    streamed: bool = False,
    refine: int = 0,
    resume: bool = False,
    block_params: int = 0,
) -> HostEstimate:
    """The `HostEstimate` of the process whose device estimate is `device_estimate` (the largest rank's).
    width: bytes per element of the model's dtype; rows: that rank's calibration samples (S_r); params:
    the parameters the process holds (streamed: outside the blocks and the largest block); resume: the
    run saves a resume state; block_params: the largest block's parameters."""
    on_cpu = device.type == "cpu"
    if on_cpu:  # --offload-activations moves nothing on a CPU run: every sample stays in host memory
        activations = max(device_estimate.activations, (2 + refine) * rows * seqlen * hidden_size * width)
    elif offload_activations:
        activations = (2 + refine) * rows * seqlen * hidden_size * width
    else:
        activations = 0
    # Rank 0 saves every sample's inputs to the next block; a run without a resume state saves none.
    inputs = (2 if refine else 1) * nsamples * seqlen * hidden_size * width if resume else 0
    return HostEstimate(
        model=params * width,
        tokens=2 * nsamples * seqlen * TOKEN_BYTES,
        activations=activations,
        work=device_estimate.statistics + device_estimate.workspace + device_estimate.refine if on_cpu else 0,
        streamed=streamed,
        writer=WRITER_DEPTH * (inputs + (block_params * width if streamed else 0)) if resume or streamed else 0,
    )


def _cgroup_remaining() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), None without a limit."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    folder = Path("/sys/fs/cgroup") / line.partition("::")[2].lstrip("/")
    try:
        limit = (folder / "memory.max").read_text().strip()
        current = int((folder / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - current)


def available_host_bytes() -> int:
    """What this process may still allocate without swapping or being killed: /proc/meminfo's
    MemAvailable (free memory plus reclaimable caches), capped by the cgroup's remaining limit; where
    neither exists, the free physical pages."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # reported in KiB
    except OSError:
        available = None
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup = _cgroup_remaining()
    return available if cgroup is None else min(available, cgroup)


# Planning for a GPU from a machine without one (a login node): the usual cards' memory, in their
# nominal decimal gigabytes (below what torch reports for each, so a plan that fits one fits it).
KNOWN_GPUS: tuple[tuple[str, int], ...] = (
    ("24 GB (RTX 4090, A10G, L4)", 24 * 10**9),
    ("40 GB (A100 40GB)", 40 * 10**9),
    ("48 GB (L40S, RTX 6000 Ada)", 48 * 10**9),
    ("80 GB (A100 80GB, H100)", 80 * 10**9),
    ("141 GB (H200)", 141 * 10**9),
)


def device_present(device: torch.device) -> bool:
    """Whether this machine has `device` (the CPU always; a CUDA device when torch sees one)."""
    if device.type != "cuda":
        return True
    return torch.cuda.is_available() and (device.index is None or device.index < torch.cuda.device_count())


def device_total_bytes(device: torch.device) -> int | None:
    """The total memory of a CUDA device, None for the CPU (its memory is the host's)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def fit_problem(
    host: HostEstimate,
    device_bytes: int,
    device: torch.device,
    *,
    nsamples: int,
    seqlen: int,
    processes: int = 1,
    host_limit: int | None,
    device_limit: int | None,
) -> str | None:
    """Why the run cannot fit, in one clause ("--nsamples S × --seqlen T needs about X of host memory
    (...), but Y are available"), or None when it fits. host_limit / device_limit: the bytes available
    (None: not checked; a CPU run's device is the host)."""
    sizes = f"--nsamples {nsamples} × --seqlen {seqlen}"
    if host_limit is not None and host.total * processes > host_limit:
        each = f" in each of {processes} processes" if processes > 1 else ""
        return (
            f"{sizes} needs about {human_bytes(host.total * processes)} of host memory ({host.describe()}{each}), "
            f"but {human_bytes(host_limit)} are available"
        )
    if device_limit is not None and device_bytes > device_limit:
        return (
            f"{sizes} needs about {human_bytes(device_bytes)} of {device} memory per process, but the device "
            f"has {human_bytes(device_limit)}"
        )
    return None


def check_fits(
    host: HostEstimate,
    device_bytes: int,
    device: torch.device,
    *,
    nsamples: int,
    seqlen: int,
    offload_activations: bool,
    processes: int = 1,
    host_available: int | None = None,
    device_total: int | None = None,
    fix: str | None = None,
) -> None:
    """DoesNotFitError (one line: the estimate, the limit, the fix) when the run cannot fit.

    host: one process's estimate; processes: how many of them run on this machine at once (a dry run of
    --nproc K: K; each process of a run checks its own share); device_bytes: the largest rank's device
    peak (`PrunePlan.device_bytes`). host_available and device_total default to this machine's
    (`available_host_bytes`, `device_total_bytes`); tests pass their own. fix: what to pass instead
    (`PrunePlan.fixes` computes it from the plan); by default smaller sizes, or --offload-activations.
    """
    limit = available_host_bytes() if host_available is None else host_available
    total = device_total_bytes(device) if device_total is None else device_total
    problem = fit_problem(
        host,
        device_bytes,
        device,
        nsamples=nsamples,
        seqlen=seqlen,
        processes=processes,
        host_limit=limit,
        device_limit=total,
    )
    if problem is None:
        return
    if fix is None:
        on_device = host.total * processes <= limit
        fix = "pass a smaller --nsamples or --seqlen" + (
            ", or --offload-activations" if on_device and not offload_activations else ""
        )
    raise DoesNotFitError(f"{problem}; {fix} (nothing was written)")

"""The one memory estimate of a run (device and host), and whether the run fits the machine.

The device estimate (`estimate_device_memory` → `MemoryEstimate` per rank) is built from what the code
allocates, term by term: the block, the calibration activations, the input statistics, and the
method's working set for the largest matrix (`matrix_workspace`: the dense copy, the method's
buffers, its factorization's workspace, the mask solver's, the engine's error check), each the peak of
the phase that holds the most. `tests/test_memory_estimate.py` holds it against a CPU accounting of
every allocation (torch.profiler's memory events, internal LAPACK workspaces included) of real runs.

A prune whose calibration set cannot fit (``--nsamples 1000000000``) would otherwise allocate for
minutes and die inside torch's allocator. `check_fits` compares the plan's host estimate
(`HostEstimate`, like the device's a function of a `Workload`: the estimates' inputs) with the memory
this process may still take (`available_host_bytes`: the kernel's MemAvailable, or the cgroup's
remaining limit under SLURM or a container when that is smaller) and the device estimate with the
device's total memory (`fit_problem` of a `Demand` against `Limits`); an estimate beyond its limit is
refused with one line (`DoesNotFitError`, exit 5) naming the flags that would make it fit.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from collections.abc import Callable, Sequence
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
# Freed memory the C allocator keeps while one matrix is pruned on the CPU, as a multiple of the method's
# working set (`HostEstimate.allocator`): glibc serves the method's loop from per-thread arenas and keeps
# what it frees there until the group's `return_free_memory`. ALPS transposable 16:32, one matrix in a
# fresh process after a trim (`scripts/method_memory.py`, seventeenth session, docs/results.md "The memory
# target in the steady state"): the RSS rose 1.33-1.81x its working set on 576 x 1536 (9 runs), 1.59-1.91x
# on 1536 x 576 (6), 1.08-2.05x on 576 x 576 (6); with glibc's mmap threshold held at 1 MiB, which hands
# large blocks straight back, 1.04-1.10x: the formula holds the tensors, the rest is the allocator's.
# Counted as 1.25 working sets more, above the highest 1.05 measured.
ALLOCATOR_SLACK = 1.25


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


@dataclass(frozen=True)
class Workload:
    """What a run's memory estimates are computed from (a plain record; `plan.Sizing.estimate` fills it).

    block_params: the parameter count of each block; candidates: the linears to prune (none when --targets
    selects only linears outside the language model); cost: the method's (`MethodCost.of`); nsamples and
    seqlen: the samples and tokens the blocks run on; hidden_size; width: bytes per element of the model's
    dtype (statistics are float32); heads: the attention heads (`forward_bytes`); world_size: the ranks;
    device: the run's; model_params: the whole model's parameters; offload_activations, sequential,
    streamed and resume: the run's --offload-activations, --sequential, --stream and resume state; refine:
    the dense streams --refine block holds (`RefineConfig.streams`: 0 off, 1, 2 with the sub-blocks'
    boundary values; `MemoryEstimate.refine`); gathers: the method reads input statistics
    (`PrunerSpec.needs_data`; magnitude gathers none: no statistics, and no linear inputs kept by a
    distributed rank).
    """

    block_params: tuple[int, ...]
    candidates: tuple[LinearSlot, ...]
    cost: MethodCost
    nsamples: int
    seqlen: int
    hidden_size: int
    width: int
    heads: int
    world_size: int
    device: torch.device
    model_params: int
    offload_activations: bool
    sequential: bool
    refine: int
    gathers: bool
    streamed: bool
    resume: bool

    def per_block(self, size: Callable[[LinearSlot], int]) -> list[int]:
        """`size` summed over each block's candidates, block by block."""
        return [sum(size(s) for s in self.candidates if s.block == i) for i in range(len(self.block_params))]

    @property
    def sample_bytes(self) -> int:
        """One sample's hidden states (T, H) in the model's dtype."""
        return self.seqlen * self.hidden_size * self.width


def _statistics_bytes(work: Workload) -> int:
    """The input statistics (float32 XᵀX and column norms) one rank holds: a block's linears as one group,
    in a distributed run twice (the sums in flight to the next rank) plus one linear's being added."""
    if not work.gathers:
        return 0
    # The engine holds one sequential group's statistics at a time (its linears share their input's);
    # the plan does not know the groups before a watch, so every linear of the block counts: exact
    # without --sequential, at most one block's other Gram matrices high with it (LLaMA-3.2-1B: 101 MB
    # over down_proj's 268 MB). A stack of E experts holds E Gram matrices at once (`stats.ExpertStats`).
    own = 4 * max(work.per_block(lambda s: s.matrices * (s.in_features**2 + s.in_features)))
    if work.world_size <= 1:
        return own
    return 2 * own + 4 * max((s.in_features**2 + s.in_features for s in work.candidates), default=0)


def _kept_features(work: Workload) -> int:
    """Per token, the linear inputs a distributed rank keeps for one group's ordered sums (none alone or
    without statistics). One group's linears read one input (LLaMA's q,k,v; gate,up); without
    --sequential the block is one group and every linear's input counts (an upper bound: shared inputs
    are kept once)."""
    if work.world_size <= 1 or not work.gathers:
        return 0
    if work.sequential:
        return max((s.in_features for s in work.candidates), default=0)
    return max(work.per_block(lambda s: s.in_features))


def _workspace_bytes(work: Workload) -> int:
    """The larger of the method's working set for the largest matrix (`slot_workspace`) and one sample's
    forward (`forward_bytes`), which never run at once; on CUDA the libraries' workspaces; and the block's
    call arguments."""
    # No candidate when --targets selects only linears outside the language model (pruning/block/outside.py).
    method = max((slot_workspace(s, work.cost) for s in work.candidates), default=0)
    forward = forward_bytes(work.candidates, seqlen=work.seqlen, width=work.width, heads=work.heads)
    workspace = max(method, forward) + (CUDA_LIBRARY_BYTES if work.cost.cuda else 0)
    # What the model passes each block beside its hidden states (`engine.BlockCall`), held on the device
    # through the block: a (T, T) mask and the rotary cos and sin (T, head_dim), float32 (an upper bound).
    return workspace + 4 * work.seqlen * work.seqlen + 2 * 4 * work.seqlen * work.hidden_size


def _refine_bytes(work: Workload) -> int:
    """--refine block's training (`MemoryEstimate.refine`): the largest block in float32 with its gradients
    and Adam's two moments, its weights before refinement, one sample's forward kept for backward."""
    if not work.refine:
        return 0
    features = max(work.per_block(lambda s: s.matrices * (s.in_features + s.out_features)))
    return max(work.block_params) * (4 * 4 + work.width) + 4 * work.seqlen * (features + 4 * work.hidden_size)


def estimate_device_memory(work: Workload) -> list[MemoryEstimate]:
    """One `MemoryEstimate` per rank of `work`.

    These are torch's allocated bytes (`torch.cuda.max_memory_allocated`, the H100 run's measure); what
    the caching allocator reserves beyond them (its fragmentation: the H100 run did not record it) is not
    estimated, so a GPU filled to the estimate's last percent may still run out.
    """
    from tsenor_cli.pruning.block.distributed import shard_bounds

    statistics, workspace, kept = _statistics_bytes(work), _workspace_bytes(work), _kept_features(work)
    block, training = max(work.block_params) * work.width, _refine_bytes(work)
    estimates = []
    for rank, (start, stop) in enumerate(shard_bounds(work.nsamples, work.world_size)):
        rows = 1 if work.offload_activations else stop - start
        # Block inputs and outputs, and with --refine block the dense stream (and the sub-blocks' boundary).
        activations = (2 + work.refine) * rows * work.sample_bytes
        if not work.offload_activations:
            activations += (stop - start) * work.seqlen * kept * work.width
        estimates.append(MemoryEstimate(rank, block, activations, statistics, workspace, training))
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
    (`MemoryEstimate.statistics` + `workspace` + `refine`); allocator: on a CPU run, the freed memory the C
    allocator keeps during the method's work (`ALLOCATOR_SLACK` × the method's working set); writer: what
    the background writer holds (`background.py`, `WRITER_DEPTH` payloads): with a resume state, rank 0's
    copy of the next block's inputs (S, T, H) (and the dense stream's with --refine), plus a streamed run's
    pruned block;
    streamed without one, the pruned block it keeps on disk. curvature: `--loss-aware`'s pass before the
    blocks (`curvature_bytes`), which ends before the loop's activations, work and writes are made: the
    peak is the larger of the two. runtime: the planning process's own resident memory when the plan was
    made (`resident_bytes`: the Python runtime with torch, transformers, the tokenizer and the model on the
    meta device), measured, not estimated; it is outside `total`, which is what the run adds to it (the
    memory a machine must still have free, `fit_problem`), and inside `peak`, what the process's resident
    memory reaches (a batch job's memory request).
    """

    model: int
    tokens: int
    activations: int
    work: int
    streamed: bool = False
    writer: int = 0
    curvature: int = 0
    runtime: int = 0
    allocator: int = 0

    @property
    def total(self) -> int:
        loop = self.activations + self.work + self.allocator + self.writer
        return self.model + self.tokens + max(self.curvature, loop)

    @property
    def peak(self) -> int:
        """The process's resident memory at its peak: the runtime measured and the run's tensors estimated."""
        return self.runtime + self.total

    def describe(self) -> str:
        """The parts for a person: "model 12.3 MiB, calibration tokens 1.0 MiB, ..."."""
        weights = "weights outside the blocks + one block" if self.streamed else "model"
        return (
            f"{weights} {human_bytes(self.model)}, calibration tokens {human_bytes(self.tokens)}, "
            f"activations {human_bytes(self.activations)}, work {human_bytes(self.work)}"
            + (f", freed memory the allocator keeps {human_bytes(self.allocator)}" if self.allocator else "")
            + (f", background writes {human_bytes(self.writer)}" if self.writer else "")
            + (f"; before the blocks, the loss curvature pass {human_bytes(self.curvature)}" if self.curvature else "")
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "model": self.model,
            "tokens": self.tokens,
            "activations": self.activations,
            "work": self.work,
            "allocator": self.allocator,
            "writer": self.writer,
            "curvature": self.curvature,
            "total": self.total,
            "runtime": self.runtime,
            "peak": self.peak,
            "streamed": int(self.streamed),
        }


def host_estimate(work: Workload, device_estimate: MemoryEstimate) -> HostEstimate:
    """The `HostEstimate` of one process of `work` whose device estimate is `device_estimate` (the largest
    rank's: `shard_bounds` gives rank 0 the most samples). A streamed run holds the parameters outside the
    blocks and one block (the largest) at a time."""
    rows = -(-work.nsamples // work.world_size)  # that rank's calibration samples (S_r)
    on_cpu = work.device.type == "cpu"
    streams = 2 + work.refine
    if on_cpu:  # --offload-activations moves nothing on a CPU run: every sample stays in host memory
        activations = max(device_estimate.activations, streams * rows * work.sample_bytes)
    elif work.offload_activations:
        activations = streams * rows * work.sample_bytes
    else:
        activations = 0
    # Rank 0 saves every sample's inputs to the next block; a run without a resume state saves none.
    inputs = (2 if work.refine else 1) * work.nsamples * work.sample_bytes if work.resume else 0
    largest = max(work.block_params, default=0)
    held = work.model_params - sum(work.block_params) + largest if work.streamed else work.model_params
    kept = largest * work.width if work.streamed else 0
    return HostEstimate(
        model=held * work.width,
        tokens=2 * work.nsamples * work.seqlen * TOKEN_BYTES,
        activations=activations,
        work=device_estimate.statistics + device_estimate.workspace + device_estimate.refine if on_cpu else 0,
        allocator=round(ALLOCATOR_SLACK * device_estimate.workspace) if on_cpu else 0,
        streamed=work.streamed,
        writer=WRITER_DEPTH * (inputs + kept) if work.resume or work.streamed else 0,
    )


@dataclass(frozen=True)
class TrainingWorkload:
    """What one process of a fine-tuning run (`tsenor finetune`) holds depends on (a plain record, filled by
    `finetune/plan.py` from the checkpoints' configs and one forward on the meta device; nothing read).

    params: the student's parameters (in float32); frozen: those of them kept out of training (no gradient, no
    optimizer state: `--freeze-embeddings`); pruned: its pruned weights (one bool
    each, `fixedmask.FixedMask`); teacher: the teacher's parameters (0: no teacher) at `teacher_width`
    bytes each; saved: the bytes the student's forward keeps for backward on one micro-batch, observed
    (`finetune/plan.saved_bytes`), at float32 width; cast: the parameters bf16 autocast copies for its
    matrix products (0 in float32); tokens: positions per micro-batch (B·T); vocab, hidden: the output
    layer's shape; chunk: the distillation loss's bytes per chunk of logits (`finetune/distill.CHUNK_BYTES`;
    0 without a teacher, whose loss the forward's observation holds); group: under bf16 autocast the loss's
    bf16 gradients kept for one product into the output layer's (`distill.GROUP_BYTES`, at most the
    micro-batch's), 0 in float32."""

    params: int
    pruned: int
    teacher: int
    teacher_width: int
    saved: int
    cast: int
    tokens: int
    vocab: int
    hidden: int
    chunk: int
    group: int = 0
    frozen: int = 0


# What a training process holds beyond its live tensors and its runtime, as a share of the activations:
# the freed memory the C allocator keeps between the forward's and the backward's allocations, and the
# pages of the checkpoints it read that stay mapped. Measured on the CPU (SmolLM2-135M distilled at 4 x 512
# in fp32, `tsenor finetune --teacher`): 7.04 GiB of peak resident memory (6.32 anonymous, 0.72 file)
# against 5.45 GiB of tensors and 0.55 GiB of runtime, 1.04 GiB over, 0.40 of its 2.56 GiB of activations
# (which the meta-device watch counts to the byte). Not measured on a GPU, whose caching allocator also
# keeps freed blocks.
TRAINING_SLACK = 0.4
# The distillation loss's live (r, V) float32 tensors at once, each one chunk's bytes (`distill._Workspace`:
# both models' logits and log-softmaxes, the probabilities and the gradient made in their place; its bf16
# products' buffer, half a chunk; at a temperature other than 1 the student's own log-softmax): at most 5.5.
LOSS_CHUNKS = 6


@dataclass(frozen=True)
class TrainingEstimate:
    """Peak memory of one process of a fine-tuning run on its device (the host on a CPU run), in bytes, by
    term: weights (the student in float32), gradients, optimizer (AdamW's two moments), teacher, masks,
    activations (what the forward keeps for backward, the bf16 copies of the weights under autocast
    included), loss (the distillation loss's chunks and the two gradients it keeps; 0 without a teacher),
    allocator (what the process holds beyond its live tensors, `TRAINING_SLACK` of the activations);
    runtime: the planning process's resident memory (`resident_bytes`), measured; outside `total`."""

    weights: int
    gradients: int
    optimizer: int
    teacher: int
    masks: int
    activations: int
    loss: int
    allocator: int
    runtime: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in TRAINING_TERMS)

    @property
    def peak(self) -> int:
        return self.runtime + self.total

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in (*TRAINING_TERMS, "total", "runtime", "peak")}


TRAINING_TERMS: tuple[str, ...] = (
    "weights",
    "gradients",
    "optimizer",
    "teacher",
    "masks",
    "activations",
    "loss",
    "allocator",
)


def training_estimate(work: TrainingWorkload) -> TrainingEstimate:
    """The `TrainingEstimate` of `work`: float32 weights for every parameter, gradients and AdamW's two moments
    for every one that trains, the teacher at its width, one bool per pruned weight, the forward's saved tensors (under
    bf16 still counted at float32 width, an upper bound) with autocast's bf16 copies, the distillation
    loss's chunks beside the two gradients it keeps (the states' (B·T, H), the output layer's (V, H)), under
    bf16 its gradient group with the bf16 copies of the layer, of a group's product and of the states, and
    the freed memory the allocator keeps (`TrainingEstimate`)."""
    loss = LOSS_CHUNKS * work.chunk + 4 * (work.tokens + work.vocab) * work.hidden if work.chunk else 0
    if work.group:
        loss += work.group + 2 * (2 * work.vocab + work.tokens) * work.hidden
    activations = work.saved + 2 * work.cast
    return TrainingEstimate(
        weights=4 * work.params,
        gradients=4 * (work.params - work.frozen),
        optimizer=8 * (work.params - work.frozen),
        teacher=work.teacher * work.teacher_width,
        masks=work.pruned,
        activations=activations,
        loss=loss,
        allocator=round(TRAINING_SLACK * activations),
    )


def resident_bytes() -> int:
    """This process's resident memory now (psutil's RSS, on every system psutil supports)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """The C library's `malloc_trim` (glibc), or None where the C library has none (macOS, Windows)."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def return_free_memory() -> None:
    """Hand the pages of freed memory that the C allocator still holds back to the system: glibc's
    `malloc_trim(0)`; nothing where the C library has no such call (its allocator then keeps what it keeps).

    Why: glibc serves blocks below its mmap threshold, which rises to 32 MiB as larger blocks are freed,
    from its arenas, and keeps their pages after they are freed. A block's method work (float64
    eigendecompositions, CG, one arena per torch thread) left 0.4-0.5 GB resident that no tensor used
    through the refinement that followed: RSS 1.57 GB with 0.37 GB of live tensors, 1.05 GB after a trim
    (the 16:32 quality recipe's block 1, sixteenth session, docs/results.md "Where the peak memory is").
    The estimates count tensors, so the run's peak RSS stood 0.44 GB above the dry run's without it."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# glibc's mallopt parameters (malloc.h) and what `keep_freed_memory` sets them to: blocks under the mmap
# threshold come from the arenas (32 MiB, glibc's largest; a value set stops the dynamic one), and an arena's
# free top is handed back past the trim threshold.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
KEPT_MMAP_THRESHOLD = 32 << 20
KEPT_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> str | None:
    """Have the C allocator keep freed blocks under 32 MiB for reuse, for the rest of the process (glibc's
    `mallopt`) → None when set, else why not (a C library without `mallopt`: macOS, Windows, musl's does nothing).

    Why: a training step allocates the same few GB (activations, the distillation loss's chunks, gradients) and
    frees them. By default glibc maps a block over its threshold (128 KiB, raised as such blocks are freed) by
    itself and unmaps it when freed, and trims an arena's free top past 128 KiB, so the next step faults the
    same pages in again, which a virtual machine makes dear. Measured with `tsenor finetune` (SmolLM2-135M
    distilled at 4 × 512 under bf16 autocast, 12 steps, two runs each; docs/results.md "Twenty-second
    session"): 6.40 and 6.46 s a step by default, 6.00 and 6.01 s with these thresholds. The peak is still
    the live tensors' and `TRAINING_SLACK`'s. `tsenor finetune` sets it; a prune, which hands freed pages back
    at its boundaries (`return_free_memory`), does not."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return "this C library has no mallopt"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD) != 1:
        return "the C library's mallopt refused the thresholds"
    return None


def segment_length(blocks: int) -> int:
    """The blocks of one segment of `--loss-aware`'s backward (`pruning/block/curvature.py`): ⌈√L⌉, which
    makes the checkpoints and one segment's inputs together about 2√L copies, the least."""
    return math.isqrt(max(blocks - 1, 0)) + 1


def curvature_bytes(activations: int, blocks: int, logits: int, sums: int) -> int:
    """The host memory of `--loss-aware`'s pass (`pruning/block/curvature.py`): activations: one copy of
    the rank's calibration hidden states (S_r, T, H), of which it holds ⌈L/k⌉ checkpoints and, at once,
    the last output and the gradient or one segment's k inputs and the gradient (k = `segment_length`);
    logits: one sample's (T, V) float32 logits, held with their float32 copy and their gradient (3×);
    sums: the per-sample sums, S × Σ out × 4 bytes."""
    k = segment_length(blocks)
    return (-(-blocks // k) + max(k, 2)) * activations + 3 * logits + sums


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


@dataclass(frozen=True)
class Demand:
    """What a run asks of a machine (a plain record): one process's host estimate, the largest rank's
    device peak (`PrunePlan.device_bytes`) on its device, how many processes run on the machine at once (a
    dry run of --nproc K: K; each process of a run checks its own share), and the calibration sizes the
    refusal names."""

    host: HostEstimate
    device_bytes: int
    device: torch.device
    nsamples: int
    seqlen: int
    processes: int = 1


@dataclass(frozen=True)
class Limits:
    """The bytes a run may take: host and device (None: not checked; a CPU run's device is the host)."""

    host: int | None
    device: int | None

    @staticmethod
    def here(device: torch.device) -> Limits:
        """This machine's: the host memory this process may still take, `device`'s total."""
        return Limits(available_host_bytes(), device_total_bytes(device))


def fit_problem(demand: Demand, limits: Limits) -> str | None:
    """Why the run cannot fit, in one clause ("--nsamples S × --seqlen T needs about X of host memory
    (...), but Y are available"), or None when it fits."""
    sizes = f"--nsamples {demand.nsamples} × --seqlen {demand.seqlen}"
    host, processes = demand.host, demand.processes
    if limits.host is not None and host.total * processes > limits.host:
        each = f" in each of {processes} processes" if processes > 1 else ""
        return (
            f"{sizes} needs about {human_bytes(host.total * processes)} of host memory ({host.describe()}{each}), "
            f"but {human_bytes(limits.host)} are available"
        )
    if limits.device is not None and demand.device_bytes > limits.device:
        return (
            f"{sizes} needs about {human_bytes(demand.device_bytes)} of {demand.device} memory per process, but "
            f"the device has {human_bytes(limits.device)}"
        )
    return None


def fit_refusal(demand: Demand, limits: Limits, *, offload_activations: bool) -> str | None:
    """The line a run that cannot fit `limits` is refused with (the estimate, the limit, the fix: smaller
    sizes, or --offload-activations when the host has room for it), None when it fits."""
    problem = fit_problem(demand, limits)
    if problem is None:
        return None
    on_device = limits.host is None or demand.host.total * demand.processes <= limits.host
    fix = "pass a smaller --nsamples or --seqlen" + (
        ", or --offload-activations" if on_device and not offload_activations else ""
    )
    return f"{problem}; {fix} (nothing was written)"


def check_fits(
    host: HostEstimate,
    device_bytes: int,
    device: torch.device,
    *,
    nsamples: int,
    seqlen: int,
    offload_activations: bool,
) -> None:
    """DoesNotFitError (`fit_refusal`'s line) when one process of the run cannot fit this machine (`Limits.here`).
    host: its estimate; device_bytes: the largest rank's device peak (`PrunePlan.device_bytes`)."""
    refusal = fit_refusal(
        Demand(host, device_bytes, device, nsamples, seqlen),
        Limits.here(device),
        offload_activations=offload_activations,
    )
    if refusal is not None:
        raise DoesNotFitError(refusal)

"""Block-wise reconstruction with the mask fixed (`tsenor prune --refine block`).

The layer-wise methods make each linear's output match the dense linear's on the inputs it saw; the
errors still compound through the block's nonlinearities and from block to block. Once a block's
linears are pruned, `refine_block` trains the block's remaining weights with Adam so that the pruned
block's output on its calibration inputs (the pruned stream: what the pruned blocks before it
computed) matches the dense block's output on the dense inputs (the dense stream), the target that also
lets a block correct what the blocks before it got wrong. The pruned weights are held at exactly 0 by
`tsenor finetune`'s mechanism (`fixedmask.FixedMask`: the gradient is zeroed at pruned positions
as it is produced, and the mask is written into the weights after every step).

Objective: the relative squared error of the block output, Σ_j ‖f(x_j) − y_j‖² / Σ_j ‖y_j‖² over the
calibration samples j (the same over a step's samples, with the whole set's mean ‖y_j‖² as the
denominator, so a step's gradient is a plain sum of per-sample gradients). Every floating-point
parameter of the block trains (norm scales, biases, and linears left dense too); the pruned matrices
only at their kept positions. Training runs in float32 whatever the model's dtype (bf16 Adam updates
below the weights' resolution would be lost), and the result is cast back; with `--refine-dtype bf16` the
forwards and backwards run under bf16 autocast over those float32 weights (the objective, the gradients'
sums and Adam stay float32), which bf16 matrix units run several times faster. The error is measured
before and after on what the run keeps (the stored dtype), and the refined weights are kept only when
they lower it: refinement never makes a block worse on its calibration data.

Steps: each epoch visits the samples in an order drawn from (seed, block) alone, `--refine-samples-per-step`
per Adam step (4 by default), the learning rate constant or, with `--refine-schedule cosine`, along a half
cosine from `--refine-lr` towards 0 over each stage's steps; the engine replays a block one sample per forward
(its recorded arguments are for batch 1), so a step is a sum of per-sample backward passes, batched over
tokens, never a loop over them. In a distributed run (`--nproc`) each rank computes the per-sample gradients
of the step's samples in its shard, and every rank adds all of them in the step's order (`_ordered_gradients`)
before taking the same Adam step: one process's sums, bit for bit, so the checkpoint is one process's too. The
order and the steps depend on (seed, block, samples) only, so a run killed inside a block's refinement and
resumed redoes that block from its saved input and ends identical.

Regions (`--refine-regions sub-blocks`, `regions.py`): the training runs in stages, one per region of the
block in call order (attention, then MLP), each with `epochs` epochs of its own, towards the dense model's
residual stream after the region (captured while the dense block runs on the dense stream,
`regions.run_dense_block`), with only that region's weights training; the last stage matches the block's
output. The errors before and after, and whether the result is kept, are the whole block's as without
regions.

Memory (in the plan, `memory.estimate_device_memory`): the dense stream (S_r, T, H) beside the pruned one
(with sub-blocks one more per region boundary), a float32 copy of the block with its gradients and Adam's
two moments plus a copy of the weights before refinement, and one sample's forward kept for backward.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from tsenor_cli.fixedmask import FixedMask
from tsenor_cli.progress import Progress
from tsenor_cli.pruning.block.distributed import Team, shard_bounds
from tsenor_cli.pruning.block.joint import ColumnNorms, JointMasks
from tsenor_cli.pruning.block.regions import Regions, find_regions, run_dense_block, stage_outputs
from tsenor_cli.pruning.settings.config import RefineConfig
from tsenor_cli.replay import BlockCall, run_block
from tsenor_cli.runfiles import BlockRefinement, LayerRecord


def block_masks(block: nn.Module, prefix: str, params: Iterable[str]) -> dict[str, torch.Tensor]:
    """{parameter name in `block`: bool mask of its shape, True where pruned} for the parameters named
    `params` (full names starting with `prefix`, the block's own full name and a dot), from their zeros
    as `tsenor finetune` reads a pruned checkpoint (a weight that was zero before pruning stays zero)."""
    masks = {}
    for full in dict.fromkeys(params):
        local = full.removeprefix(prefix)
        masks[local] = block.get_parameter(local).detach() == 0
    return masks


@dataclass(frozen=True)
class RefineJob:
    """What one block's refinement takes (a plain record).

    block: the pruned block, on `device`, trained in place; index: its index (the sample order's seed with
    `seed`); inputs: (S_r, T, H) its calibration inputs in the pruned stream; targets: (S_r, T, H) the dense
    block's outputs on the dense stream; both this rank's shard of `nsamples` samples (None: all of them,
    one process) and possibly on the CPU (--offload-activations: one sample at a time moves to `device`).
    masks: {parameter name: (shape) bool, True where pruned} (`block_masks`). outputs: (S_r, T, H) or None;
    the error pass after training writes the refined block's outputs there: when the record says kept, bit
    for bit what `replay.run_block` would compute (the same forwards), so the engine need not run the block
    again (one forward pass over the samples: 43 s of a 745 s SparseGPT O16:32 prune, docs/results.md);
    otherwise they are not. dense: {parameter name: its weight before pruning}, where the mask re-solves'
    shadows start at pruned positions (`joint.JointMasks`; None: at zero). regions, region_targets: the
    block's regions and the dense values (S_r, T, H) at each boundary (`regions.run_dense_block`; None: one
    stage, the whole block). weights: how the objective and the errors measure the block output's error e
    of each token (`_squares`): (H,) float32 > 0, each feature's weight, Σ_h w_h e_h² (e.g. 1 + λ·g_h/mean g,
    g the loss's curvature at the block output), or (H, H) a metric M, eᵀMe; the denominator Σ yᵀMy alike
    (None: the plain squares, scripts/loss_aware_refine_study.py screens the others). The stages towards a
    region boundary are not weighted (the curvature is the block output's).
    """

    block: nn.Module
    index: int
    inputs: torch.Tensor
    call: BlockCall
    targets: torch.Tensor
    cfg: RefineConfig
    seed: int
    device: torch.device
    masks: Mapping[str, torch.Tensor] = field(default_factory=dict)
    team: Team | None = None
    nsamples: int | None = None
    progress: Progress | None = None
    outputs: torch.Tensor | None = None
    dense: Mapping[str, torch.Tensor] | None = None
    regions: Regions | None = None
    region_targets: tuple[torch.Tensor, ...] = ()
    weights: torch.Tensor | None = None

    @property
    def crew(self) -> Team:
        """The team (one process when none was given)."""
        return self.team if self.team is not None else Team.solo(self.device)

    @property
    def total(self) -> int:
        return int(self.inputs.shape[0]) if self.nsamples is None else self.nsamples

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """Every rank's [start, stop) of the samples (`distributed.shard_bounds`)."""
        return shard_bounds(self.total, self.crew.world_size)

    @property
    def first(self) -> int:
        """This rank's first sample (global index)."""
        return self.bounds[self.crew.rank][0]


@dataclass(frozen=True)
class _Stage:
    """One training stage: what the block computes from a sample that it matches (`output`), the dense
    values (S_r, T, H), the parameters that train, the objective's scale (mean ‖y_j‖², weighted as the
    errors are) and the features' weights (H,) (None: all 1)."""

    output: Callable[[torch.Tensor], torch.Tensor]
    values: torch.Tensor
    params: list[nn.Parameter]
    scale: float
    weights: torch.Tensor | None = None


def refine_block(job: RefineJob) -> BlockRefinement:
    """Train `job.block` in place towards `job.targets`; keep the result only if it lowers the block's
    error. Returns the block's record (errors before and after, seconds, steps)."""
    start = time.perf_counter()
    params = [p for p in job.block.parameters() if p.is_floating_point()]
    before_weights = [p.detach().clone() for p in params]
    norms = ColumnNorms(job.block, list(job.masks)) if job.cfg.mask_every else None
    whole = stage_outputs(job.block, job.call, None)[0]
    num, den = _errors(job, whole, job.targets, weights=job.weights)
    column_sq = norms.close(job.crew, job.first) if norms is not None else {}
    before = num / den if den > 0 else 0.0
    if not (den > 0 and math.isfinite(num) and math.isfinite(den)):
        # A zero target has nothing to match, and non-finite outputs nothing to learn from: left as pruned.
        return BlockRefinement(job.index, before, before, False, 0, time.perf_counter() - start)
    fixed = _mask_keeper(job, column_sq)
    steps = _train_stages(job, params, fixed, den)
    num, den = _errors(job, whole, job.targets, job.outputs, job.weights)
    after = num / den if den > 0 else 0.0
    kept = math.isfinite(after) and after < before
    if not kept:
        with torch.no_grad():
            for p, old in zip(params, before_weights, strict=True):
                p.copy_(old)
    joint = (fixed.resolves, fixed.seconds, fixed.changed) if isinstance(fixed, JointMasks) else (0, 0.0, 0)
    record = BlockRefinement(job.index, before, after, kept, steps, time.perf_counter() - start, *joint)
    _say(record, job.progress)
    return record


def _say(record: BlockRefinement, progress: Progress | None) -> None:
    """The block's progress line (with the mask re-solves when there were any)."""
    if progress is None:
        return
    verdict = "kept" if record.kept else "not kept: the pruned weights stay"
    solves = ""
    if record.mask_solves:
        solves = f", {record.mask_solves} mask solves ({record.mask_seconds:.1f}s, {record.mask_changed} kept moved)"
    progress(
        f"  refined block {record.block}: error {record.error_before:.4g} → {record.error_after:.4g} ({verdict}), "
        f"{record.steps} steps, {record.seconds:.1f}s{solves}"
    )


def _mask_keeper(job: RefineJob, column_sq: Mapping[str, torch.Tensor]) -> FixedMask | JointMasks:
    """The mask fixed (`FixedMask`), or re-solved every `cfg.mask_every` steps (`joint.JointMasks`)."""
    if not job.cfg.mask_every:
        return FixedMask(job.block, dict(job.masks))
    return JointMasks(job.block, job.masks, column_sq, job.cfg, job.dense)


def _train_stages(job: RefineJob, params: list[nn.Parameter], fixed: FixedMask | JointMasks, den: float) -> int:
    """Every stage's Adam steps (`_train`), the block in float32 with dropout off meanwhile → the steps taken.
    den: Σ_j ‖y_j‖² of the block's targets."""
    block = job.block
    stored = [(p.dtype, p.requires_grad) for p in params]
    for p in params:
        p.data = p.data.float()
        p.requires_grad_(True)
    was_training = block.training
    block.train(False)  # dropout off: the target is the deterministic dense output
    fixed.apply()
    fixed.attach()
    try:
        steps = 0
        for stage in _stages(job, params, den):
            chosen = {id(p) for p in stage.params}
            for p in params:  # a region's stage trains its own weights only
                p.requires_grad_(id(p) in chosen)
            steps += _train(job, stage, fixed)
    finally:
        fixed.detach()
        block.train(was_training)
        for p, (dtype, requires_grad) in zip(params, stored, strict=True):
            p.data = p.data.to(dtype)
            p.grad = None
            p.requires_grad_(requires_grad)
    return steps


def _stages(job: RefineJob, params: list[nn.Parameter], den: float) -> list[_Stage]:
    """One stage (the whole block), or one per region (module docstring)."""
    outputs = stage_outputs(job.block, job.call, job.regions)
    if job.regions is None:
        return [_Stage(outputs[0], job.targets, params, den / job.total, job.weights)]  # mean ‖y_j‖², module docstring
    named = dict(job.block.named_parameters())
    stages = []
    for k, output in enumerate(outputs):
        values = job.region_targets[k] if k < len(job.region_targets) else job.targets
        last = values is job.targets
        norm = den if last else _norm(job, values)
        weights = job.weights if last else None
        stages.append(_Stage(output, values, [named[n] for n in job.regions.params[k]], norm / job.total, weights))
    return stages


def _train(job: RefineJob, stage: _Stage, fixed: FixedMask | JointMasks) -> int:
    """The Adam steps of one stage (module docstring: the order of the samples from (seed, block) alone,
    `cfg.samples_per_step` per step, the mask written again after each, the learning rate constant or
    along a half cosine over the stage's steps) → how many were taken."""
    per_step = job.cfg.samples_per_step
    optimizer = torch.optim.Adam(stage.params, lr=job.cfg.lr, foreach=False)
    total_steps = job.cfg.epochs * math.ceil(job.total / per_step)
    schedule = (
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
        if job.cfg.schedule == "cosine"
        else None
    )
    generator = torch.Generator().manual_seed(job.seed * 1_000_003 + job.index)
    steps = 0
    for _ in range(job.cfg.epochs):
        order = torch.randperm(job.total, generator=generator).tolist()
        for first in range(0, job.total, per_step):
            step = order[first : first + per_step]
            if job.crew.distributed:
                _ordered_gradients(job, stage, step, stage.scale * len(step))
            else:
                _accumulate(job, stage, step, stage.scale * len(step))
                for p in stage.params:  # as the distributed sum has them: zeros, not None (Adam steps both alike)
                    p.grad = _grad(p)
            if isinstance(fixed, JointMasks):
                fixed.dense()  # the step updates the dense shadows (pruning/block/joint.py)
            _step(optimizer)
            if schedule is not None:
                schedule.step()
            fixed.apply()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
    return steps


def _accumulate(job: RefineJob, stage: _Stage, rows: list[int], divisor: float) -> None:
    """Add the gradient of Σ_rows ‖f(x_j) − y_j‖² / divisor (weighted by the stage's features' weights) into
    the parameters' .grad (rows: this rank's local indices), one sample per forward (the recorded arguments
    are for batch 1)."""
    weights = None if stage.weights is None else stage.weights.to(device=job.device, dtype=torch.float32)
    bf16 = job.cfg.dtype == "bf16"
    with torch.enable_grad():
        for j in rows:
            x = job.inputs[j : j + 1].to(device=job.device, dtype=torch.float32)
            y = stage.values[j : j + 1].to(device=job.device, dtype=torch.float32)
            with torch.autocast(device_type=job.device.type, dtype=torch.bfloat16, enabled=bf16):
                out = stage.output(x)
            loss = _squares(out.float() - y, weights).sum() / divisor  # the objective in fp32 either way
            loss.backward()


def _squares(diff: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """diff: (..., H) → its weighted squares (..., H): diff² (weights None), w·diff² (weights (H,)), or
    (diff·M)∘diff (weights (H, H) a metric M, so that the sum over H is diffᵀ M diff)."""
    if weights is None:
        return diff.square()
    if weights.ndim == 1:
        return diff.square() * weights
    return (diff @ weights) * diff


def _ordered_gradients(job: RefineJob, stage: _Stage, step: list[int], divisor: float) -> None:
    """A distributed step's gradient into each parameter's .grad, bit for bit what one process adds up.

    step: the step's samples (global indices) in their order. Each rank computes the per-sample gradients
    of its own samples (in parallel), then every gradient goes from its rank to all (`Team.broadcast`) and
    each rank adds them in the step's order, as one process's backward passes add into .grad."""
    team, bounds, params = job.crew, job.bounds, stage.params
    mine: dict[int, torch.Tensor] = {}
    start, stop = bounds[team.rank]
    for j in step:
        if start <= j < stop:
            _accumulate(job, stage, [j - start], divisor)
            mine[j] = torch.cat([_grad(p).reshape(-1) for p in params])
            for p in params:
                p.grad = None
    size = sum(p.numel() for p in params)
    total: torch.Tensor | None = None
    for j in step:
        owner = next(rank for rank, (start, stop) in enumerate(bounds) if start <= j < stop)
        gradient = team.broadcast(mine.get(j, torch.empty(size, device=job.device)), src=owner)
        total = gradient if total is None else total + gradient
    assert total is not None  # a step holds at least one sample
    for p, g in zip(params, torch.split(total, [p.numel() for p in params]), strict=True):
        p.grad = g.reshape(p.shape)


def _grad(p: nn.Parameter) -> torch.Tensor:
    """p's gradient; zeros for a parameter the forward did not reach (e.g. an expert no token chose)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _step(optimizer: torch.optim.Optimizer) -> None:
    """One Adam step (a function of its own so tests can interrupt a refinement between steps)."""
    optimizer.step()


@torch.no_grad()
def _errors(
    job: RefineJob,
    output: Callable[[torch.Tensor], torch.Tensor],
    values: torch.Tensor,
    out: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[float, float]:
    """(Σ_j ‖f(x_j) − y_j‖², Σ_j ‖y_j‖²) over every rank's samples, f = `output`, y = `values`, each square
    times its feature's weight (H,) when `weights` is given, the block run as the pruned model runs it
    (its stored dtype); per sample in float64, added in sample order whatever the number of ranks. out:
    (S_r, T, H) where this rank's outputs go (None: dropped)."""
    w = None if weights is None else weights.to(job.device, torch.float64)
    mine: dict[str, tuple[float, float]] = {}
    for j in range(job.inputs.shape[0]):
        y = values[j : j + 1].to(job.device).double()
        hidden = output(job.inputs[j : j + 1].to(job.device))
        if out is not None:
            out[j : j + 1] = hidden
        mine[str(job.first + j)] = (float(_squares(hidden.double() - y, w).sum()), float(_squares(y, w).sum()))
    return _sum_in_order(job.crew, mine)


def _norm(job: RefineJob, values: torch.Tensor) -> float:
    """Σ_j ‖y_j‖² of `values` over every rank's samples, added in sample order."""
    mine = {str(job.first + j): (0.0, float(values[j : j + 1].double().square().sum())) for j in range(len(values))}
    return _sum_in_order(job.crew, mine)[1]


def _sum_in_order(team: Team, mine: Mapping[str, tuple[float, float]]) -> tuple[float, float]:
    every = team.gather_objects(dict(mine))
    num = den = 0.0
    for key in sorted(every, key=int):
        num += every[key][0]
        den += every[key][1]
    return num, den


def dense_pass(
    block: nn.Module, stream: torch.Tensor, call: BlockCall, device: torch.device, cfg: RefineConfig
) -> tuple[Regions | None, tuple[torch.Tensor, ...], str | None]:
    """The dense block on the dense stream (S_r, T, H), in place: its outputs are the refinement's targets
    and the next block's dense inputs. With `--refine-regions sub-blocks`, also the block's regions and the
    dense values at their boundaries → (regions, values, None), or (None, (), why) when the block shows
    fewer than two regions (`regions.find_regions`); otherwise (None, (), None)."""
    if cfg.regions == "block" or call.idle:
        run_block(block, stream, call, stream, device)
        return None, (), None
    found = find_regions(block, call, stream[:1].to(device))
    if isinstance(found, str):
        run_block(block, stream, call, stream, device)
        return None, (), found
    return found, run_dense_block(block, stream, call, device, found), None


def refine_pruned_block(
    job: RefineJob, prefix: str, records: Iterable[LayerRecord]
) -> tuple[list[BlockRefinement], bool]:
    """`refine_block` for block `job.index` once the engine has pruned it → ([its record], whether
    `job.outputs` now holds the block's outputs on its inputs, see `RefineJob`); ([], False) when its
    forward does not run on text or none of its matrices was pruned (records: the run's layer records;
    prefix: the block's full name and a dot), so blocks left dense stay bit-identical. The masks are read
    from the pruned block (`block_masks`)."""
    pruned = [r.param or f"{r.name}.weight" for r in records if r.block == job.index and r.status == "pruned"]
    if job.call.idle or not pruned:
        return [], False
    record = refine_block(dataclasses.replace(job, masks=block_masks(job.block, prefix, pruned)))
    return [record], job.outputs is not None and record.kept

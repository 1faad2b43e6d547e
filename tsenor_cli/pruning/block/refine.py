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
below the weights' resolution would be lost), and the result is cast back. The error is measured
before and after on what the run keeps (the stored dtype), and the refined weights are kept only when
they lower it: refinement never makes a block worse on its calibration data.

Steps: each epoch visits the samples in an order drawn from (seed, block) alone, `SAMPLES_PER_STEP` per
Adam step; the engine replays a block one sample per forward (its recorded arguments are for batch 1),
so a step is a sum of per-sample backward passes, batched over tokens, never a loop over them. In a
distributed run (`--nproc`) each rank computes the per-sample gradients of the step's samples in its
shard, and every rank adds all of them in the step's order (`_ordered_gradients`) before taking the same
Adam step: one process's sums, bit for bit, so the checkpoint is one process's too. The order and
the steps depend on (seed, block, samples) only, so a run killed inside a block's refinement and
resumed redoes that block from its saved input and ends identical.

Memory (in the plan, `memory.estimate_device_memory`): the dense stream (S_r, T, H) beside the pruned one,
a float32 copy of the block with its gradients and Adam's two moments plus a copy of the weights
before refinement, and one sample's forward kept for backward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from tsenor_cli.fixedmask import FixedMask
from tsenor_cli.progress import Progress
from tsenor_cli.pruning.block.distributed import Team, shard_bounds
from tsenor_cli.pruning.block.joint import ColumnNorms, JointMasks
from tsenor_cli.pruning.settings.config import SAMPLES_PER_STEP, RefineConfig
from tsenor_cli.replay import BlockCall, block_output
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


def refine_block(
    block: nn.Module,
    index: int,
    inputs: torch.Tensor,
    call: BlockCall,
    targets: torch.Tensor,
    masks: Mapping[str, torch.Tensor],
    cfg: RefineConfig,
    *,
    seed: int,
    device: torch.device,
    team: Team | None = None,
    nsamples: int | None = None,
    progress: Progress | None = None,
    outputs: torch.Tensor | None = None,
    dense: Mapping[str, torch.Tensor] | None = None,
) -> BlockRefinement:
    """Train `block` (on `device`, pruned) in place towards `targets`; keep the result only if it lowers
    the block's error. Returns the block's record (errors before and after, seconds, steps).

    inputs: (S_r, T, H) the block's calibration inputs in the pruned stream, targets: (S_r, T, H) the
    dense block's outputs on the dense stream, this rank's shard of `nsamples` samples (None: all of them,
    one process); masks: {parameter name: (shape) bool, True where pruned} (`block_masks`). Both may be on
    the CPU (--offload-activations): one sample at a time moves to `device`.
    outputs: (S_r, T, H) or None; the error pass after training writes the refined block's outputs there.
    When the record says kept, they are the block's outputs as the run keeps it, bit for bit what
    `replay.run_block` would compute (the same forwards), so the engine need not run the block again
    (one forward pass over the samples: 43 s of a 745 s SparseGPT O16:32 prune, docs/results.md);
    otherwise they are not. dense: {parameter name: its weight before pruning}, where the mask re-solves'
    shadows start at pruned positions (`joint.JointMasks`; None: at zero).
    """
    team = team if team is not None else Team.solo(device)
    total = int(inputs.shape[0]) if nsamples is None else nsamples
    bounds = shard_bounds(total, team.world_size)
    start = time.perf_counter()
    params = [p for p in block.parameters() if p.is_floating_point()]
    stored = [(p.dtype, p.requires_grad) for p in params]
    before_weights = [p.detach().clone() for p in params]
    norms = ColumnNorms(block, list(masks)) if cfg.mask_every else None
    num, den = _errors(block, inputs, call, targets, device, team, bounds[team.rank][0])
    column_sq = norms.close(team, bounds[team.rank][0]) if norms is not None else {}
    before = num / den if den > 0 else 0.0
    if not (den > 0 and math.isfinite(num) and math.isfinite(den)):
        # A zero target has nothing to match, and non-finite outputs nothing to learn from: left as pruned.
        return BlockRefinement(index, before, before, False, 0, time.perf_counter() - start)
    fixed = _mask_keeper(block, masks, column_sq, cfg, dense)
    for p in params:
        p.data = p.data.float()
        p.requires_grad_(True)
    scale = den / total  # mean ‖y_j‖²: each sample's term of the objective is ‖f(x_j) − y_j‖² / scale
    was_training = block.training
    block.train(False)  # dropout off: the target is the deterministic dense output
    fixed.apply()
    fixed.attach()
    try:
        steps = _train(
            block, params, fixed, inputs, call, targets, cfg, index, seed, total, scale, bounds, device, team
        )
    finally:
        fixed.detach()
        block.train(was_training)
        for p, (dtype, requires_grad) in zip(params, stored, strict=True):
            p.data = p.data.to(dtype)
            p.grad = None
            p.requires_grad_(requires_grad)
    num, den = _errors(block, inputs, call, targets, device, team, bounds[team.rank][0], outputs)
    after = num / den if den > 0 else 0.0
    kept = math.isfinite(after) and after < before
    if not kept:
        with torch.no_grad():
            for p, old in zip(params, before_weights, strict=True):
                p.copy_(old)
    joint = (fixed.resolves, fixed.seconds, fixed.changed) if isinstance(fixed, JointMasks) else (0, 0.0, 0)
    record = BlockRefinement(index, before, after, kept, steps, time.perf_counter() - start, *joint)
    _say(record, progress)
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


def _mask_keeper(
    block: nn.Module,
    masks: Mapping[str, torch.Tensor],
    column_sq: Mapping[str, torch.Tensor],
    cfg: RefineConfig,
    dense: Mapping[str, torch.Tensor] | None,
) -> FixedMask | JointMasks:
    """The mask fixed (`FixedMask`), or re-solved every `cfg.mask_every` steps (`joint.JointMasks`)."""
    if not cfg.mask_every:
        return FixedMask(block, dict(masks), parameters=True)
    assert cfg.pattern is not None  # RefineConfig refuses a mask period without a pattern
    return JointMasks(block, masks, column_sq, cfg.pattern, cfg.solver, cfg.mask_every, dense)


def _train(
    block: nn.Module,
    params: list[nn.Parameter],
    fixed: FixedMask | JointMasks,
    inputs: torch.Tensor,
    call: BlockCall,
    targets: torch.Tensor,
    cfg: RefineConfig,
    index: int,
    seed: int,
    total: int,
    scale: float,
    bounds: list[tuple[int, int]],
    device: torch.device,
    team: Team,
) -> int:
    """The Adam steps of `refine_block` (module docstring: the order of the samples from (seed, block)
    alone, `SAMPLES_PER_STEP` per step, the mask written again after each) → how many were taken."""
    optimizer = torch.optim.Adam(params, lr=cfg.lr, foreach=False)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    steps = 0
    for _ in range(cfg.epochs):
        order = torch.randperm(total, generator=generator).tolist()
        for first in range(0, total, SAMPLES_PER_STEP):
            step = order[first : first + SAMPLES_PER_STEP]
            if team.distributed:
                args = (block, params, inputs, call, targets, step, bounds, device, team, scale * len(step))
                _ordered_gradients(*args)
            else:
                _accumulate(block, inputs, call, targets, step, device, scale * len(step))
                for p in params:  # as the distributed sum has them: zeros, not None (Adam steps both alike)
                    p.grad = _grad(p)
            if isinstance(fixed, JointMasks):
                fixed.dense()  # the step updates the dense shadows (pruning/block/joint.py)
            _step(optimizer)
            fixed.apply()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
    return steps


def _accumulate(
    block: nn.Module,
    inputs: torch.Tensor,
    call: BlockCall,
    targets: torch.Tensor,
    rows: list[int],
    device: torch.device,
    scale: float,
) -> None:
    """Add the gradient of Σ_rows ‖f(x_j) − y_j‖² / scale into the parameters' .grad, one sample per
    forward (the recorded arguments are for batch 1)."""
    with torch.enable_grad():
        for j in rows:
            x = inputs[j : j + 1].to(device=device, dtype=torch.float32)
            y = targets[j : j + 1].to(device=device, dtype=torch.float32)
            out = block_output(block, call, x)
            loss = (out - y).square().sum() / scale
            loss.backward()


def _ordered_gradients(
    block: nn.Module,
    params: list[nn.Parameter],
    inputs: torch.Tensor,
    call: BlockCall,
    targets: torch.Tensor,
    step: list[int],
    bounds: list[tuple[int, int]],
    device: torch.device,
    team: Team,
    scale: float,
) -> None:
    """A distributed step's gradient into each parameter's .grad, bit for bit what one process adds up.

    step: the step's samples (global indices) in their order; bounds: every rank's [start, stop) of them
    (`distributed.shard_bounds`). Each rank computes the per-sample gradients
    of its own samples (in parallel), then every gradient goes from its rank to all (`Team.broadcast`) and
    each rank adds them in the step's order, as one process's backward passes add into .grad."""
    mine: dict[int, torch.Tensor] = {}
    start, stop = bounds[team.rank]
    for j in step:
        if start <= j < stop:
            _accumulate(block, inputs, call, targets, [j - start], device, scale)
            mine[j] = torch.cat([_grad(p).reshape(-1) for p in params])
            for p in params:
                p.grad = None
    size = sum(p.numel() for p in params)
    total: torch.Tensor | None = None
    for j in step:
        owner = next(rank for rank, (start, stop) in enumerate(bounds) if start <= j < stop)
        gradient = team.broadcast(mine.get(j, torch.empty(size, device=device)), src=owner)
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
    block: nn.Module,
    inputs: torch.Tensor,
    call: BlockCall,
    targets: torch.Tensor,
    device: torch.device,
    team: Team,
    first: int,
    out: torch.Tensor | None = None,
) -> tuple[float, float]:
    """(Σ_j ‖f(x_j) − y_j‖², Σ_j ‖y_j‖²) over every rank's samples (this rank's start at sample `first`),
    the block run as the pruned model runs it (its stored dtype); per sample in float64, added in sample
    order whatever the number of ranks. out: (S_r, T, H) where this rank's block outputs go (None: dropped)."""
    mine: dict[str, tuple[float, float]] = {}
    for j in range(inputs.shape[0]):
        y = targets[j : j + 1].to(device).double()
        hidden = block_output(block, call, inputs[j : j + 1].to(device))
        if out is not None:
            out[j : j + 1] = hidden
        mine[str(first + j)] = (float((hidden.double() - y).square().sum()), float(y.square().sum()))
    every = team.gather_objects(mine)
    num = den = 0.0
    for key in sorted(every, key=int):
        num += every[key][0]
        den += every[key][1]
    return num, den


def refine_pruned_block(
    block: nn.Module,
    index: int,
    prefix: str,
    records: Iterable[LayerRecord],
    inputs: torch.Tensor,
    call: BlockCall,
    targets: torch.Tensor,
    cfg: RefineConfig,
    *,
    seed: int,
    device: torch.device,
    team: Team,
    nsamples: int,
    progress: Progress,
    outputs: torch.Tensor | None = None,
) -> tuple[list[BlockRefinement], bool]:
    """`refine_block` for block `index` once the engine has pruned it → ([its record], whether `outputs`
    now holds the block's outputs on `inputs`, see `refine_block`); ([], False) when its forward does not
    run on text or none of its matrices was pruned (records: the run's layer records; prefix: the block's
    full name and a dot), so blocks left dense stay bit-identical."""
    pruned = [r.param or f"{r.name}.weight" for r in records if r.block == index and r.status == "pruned"]
    if call.idle or not pruned:
        return [], False
    masks = block_masks(block, prefix, pruned)
    record = refine_block(
        block, index, inputs, call, targets, masks, cfg, seed=seed, device=device, team=team,
        nsamples=nsamples, progress=progress, outputs=outputs,
    )  # fmt: skip
    return [record], outputs is not None and record.kept

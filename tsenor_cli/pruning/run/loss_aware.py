"""`--loss-aware λ` in a run: the dense model's loss curvature at every linear's outputs
(`pruning/block/curvature.py`), made into each linear's row weights (`methods/loss_aware.py`) for the
block pruner.

It runs after the load and before the first block's start, on the dense weights: a fresh run and a
resumed one alike (a resumed run reads the calibration text again for it, and its whole-model blocks are
restored only after it), so a resumed run prunes its remaining blocks with the same row weights, bit for
bit, and the resume state holds nothing more.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from tsenor_cli.phases import phase
from tsenor_cli.pruning.block.curvature import CalibrationBatch, curvature_rows, loss_curvature
from tsenor_cli.pruning.block.slots import linear_slots
from tsenor_cli.pruning.run.steps import capture_start
from tsenor_cli.replay import BlockSource
from tsenor_cli.replay.source import CPU

if TYPE_CHECKING:
    from tsenor_cli.data.calibration import CalibrationData
    from tsenor_cli.models.loading import LoadedModel
    from tsenor_cli.pruning.run.run import RunSetup


def loss_rows(
    run: RunSetup, loaded: LoadedModel, source: BlockSource, calib: CalibrationData | None
) -> dict[str, torch.Tensor]:
    """{linear's full name: (out,) row weights} for `--loss-aware λ > 0`, {} otherwise (module docstring)."""
    weight = run.cfg.loss_aware
    if not weight:
        return {}
    assert calib is not None  # `run.load` reads the calibration text for a loss-aware run, resumed or not
    shard = run.team.shard(run.cfg.curvature_samples)  # the first --loss-aware-samples, or all
    started = time.perf_counter()
    # The dense forward and backward over the blocks is the dense stream's kind of pass (phases.py).
    with phase("dense stream"), run.team.agreed():
        begin = capture_start(source, calib, shard, CPU, refine=False)
        assert begin.hidden is not None  # a fresh capture always has block 0's inputs
        ids = calib.input_ids[shard]
        batch = CalibrationBatch(begin.calls, begin.hidden, ids)
        curvature = loss_curvature(loaded.model, source, batch, linear_slots(loaded.structure), run.team)
    run.say(
        f"loss curvature at {len(curvature)} linears' outputs (--loss-aware {weight:g}, "
        f"{run.cfg.curvature_samples} samples): "
        f"{time.perf_counter() - started:.1f}s"
    )
    return curvature_rows(curvature, weight)

"""The steps of a prune run before and after its block loop, each a function of what it is given:
loading the model (`load_for_pruning`) with its finite checks (`check_loaded`, `finite_block_check`) and
the calibration text read before the weights (`read_calibration`); the check of the nn.Linear layers
against the pattern (`check_linears`); the input of the first block to prune (`capture_start` for a
fresh run, `restore_start` from the resume state); the watch that settles the weight matrices
(`watch_blocks`); the linears outside the language model (`outside_linears`); the report
(`build_report`). `pruning/run/run.py` composes them.

The run decides no selection itself: the calibration length, the `--ignore`/`--targets` selection and
the linears `--targets` selects outside the language model are the plan's (`pruning/plan/plan.py`). Only the
watch is the run's own: it sees the real blocks' forwards, which the plan cannot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from tsenor_cli.errors import UsageError
from tsenor_cli.phases import phase
from tsenor_cli.progress import Progress, logger
from tsenor_cli.pruning.block.distributed import Team
from tsenor_cli.pruning.block.finite import check_finite
from tsenor_cli.pruning.block.gather import observe_blocks
from tsenor_cli.pruning.block.observe import BlockObservation
from tsenor_cli.pruning.block.outside import REASON as OUTSIDE_REASON
from tsenor_cli.pruning.block.slots import LinearSlot, check_compatibility
from tsenor_cli.pruning.methods.types import LayerRecord
from tsenor_cli.pruning.plan.plan import PrunePlan, probed_weights, say_ruled
from tsenor_cli.pruning.run.report import versions
from tsenor_cli.pruning.run.writer import WeightCounts
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.replay import BlockCall, BlockSource, capture_block_calls, capture_block_inputs
from tsenor_cli.replay.source import CPU
from tsenor_cli.runfiles import BlockRefinement, ContextRecord, DataSource, PruneReport, ResumeState
from tsenor_cli.runfiles.resume import ResumeStore
from tsenor_cli.settings import RunContext

if TYPE_CHECKING:
    from tsenor_cli.data.calibration import CalibrationData
    from tsenor_cli.models.loading import LoadedModel
    from tsenor_cli.models.structure import ModelStructure

CORRUPT = "the checkpoint is corrupt; re-download or re-convert it (nothing was written)"


def read_calibration(cfg: PruneConfig, ctx: RunContext, plan: PrunePlan, tokenizer: Any) -> CalibrationData:
    """The calibration text, `cfg.nsamples` windows of the plan's `seqlen` tokens; for a method that reads
    no data (`plan.calibrate` off: magnitude without --refine block) a few stand-in tokens, no text read."""
    from tsenor_cli.data.calibration import calibration_batches, stand_in_batches

    with phase("calibration"):
        if not plan.calibrate:
            return stand_in_batches(
                tokenizer, nsamples=plan.calibration_samples, seqlen=plan.calibration_seqlen, method=cfg.method
            )
        return calibration_batches(
            cfg.calib_data, tokenizer, ctx, nsamples=cfg.nsamples, seqlen=plan.seqlen, seed=cfg.seed
        )


def load_for_pruning(
    cfg: PruneConfig,
    ctx: RunContext,
    dtype: torch.dtype,
    say: Progress,
    *,
    before_weights: Callable[[Any, Any], None] | None,
    built: LoadedModel | None,
) -> LoadedModel:
    """The model on the CPU (`built` when given: a model in memory, held whole), its weights checked finite.

    With `cfg.stream` and a safetensors checkpoint (a folder, or a hub id's snapshot in the HF cache) only
    what lies outside the decoder blocks is read (`models/streaming.py`); anything else (pickle weights, a
    model built in memory) is loaded whole. before_weights(config, tokenizer): runs before any weight is
    read (a fresh run reads its calibration text there: text too short for --nsamples × --seqlen is found
    in seconds, not after minutes of reading a large checkpoint)."""
    from tsenor_cli.models.loading import LoadOptions, load_model

    if built is not None:
        if cfg.stream:
            say("the model is built in memory, not read from a checkpoint: it is held whole")
        if before_weights is not None:
            before_weights(built.model.config, built.tokenizer)
        loaded = built
    else:
        how = LoadOptions(cfg.trust_remote_code, progress=say, check_tokenizer=True, before_weights=before_weights)
        loaded = load_model(cfg.model, ctx, dtype=dtype, device="cpu", stream=cfg.stream, options=how)
    check_loaded(cfg, loaded)
    return loaded


def check_loaded(cfg: PruneConfig, loaded: LoadedModel) -> None:
    """All weights at once, before calibration: a NaN in the last block should not cost a run to find. A
    streamed run's blocks are still on the meta device: each is checked when it is read (`BlockSource.load`
    with `finite_block_check`), the first time by the watch pass, before any block is pruned."""
    params = ((name, p) for name, p in loaded.model.named_parameters() if not p.is_meta)
    check_finite(params, where=f"model {cfg.model}", fix=CORRUPT)


def finite_block_check(cfg: PruneConfig, blocks_name: str) -> Callable[[nn.Module, int], None]:
    """The check of each block a streamed run reads from the checkpoint: its weights finite."""

    def check(block: nn.Module, index: int) -> None:
        check_finite(block.named_parameters(prefix=f"{blocks_name}.{index}"), where=f"model {cfg.model}", fix=CORRUPT)

    return check


def check_linears(cfg: PruneConfig, slots: Sequence[LinearSlot], ignored: dict[str, str]) -> None:
    """The nn.Linear layers against the pattern, before calibration (the other matrices once the forward
    has shown their orientation and role, `watch_blocks`). A one-output layer is a gate (observe.py), left
    dense then whatever its shape; `ignored` is the plan's selection."""
    linear_only = [s for s in slots if not s.param and s.full_name not in ignored and s.out_features > 1]
    if linear_only:
        check_compatibility(linear_only, cfg.pattern, skip=cfg.skip_incompatible)


@dataclass
class Start:
    """Where the block loop starts: the first block to prune (0, or the resume state's next block), the
    records of the blocks before it, this rank's shard of that block's input `hidden` (S_r, T, H; None
    once every block is done), what the model passes each block (`calls`), and the calibration text's
    description and source. With --refine block: `dense`, the same shard of that block's input in the
    dense model (the dense stream, pruning/block/refine.py), and the records of the blocks refined before it."""

    first: int
    records: list[LayerRecord]
    hidden: torch.Tensor | None
    calls: Sequence[BlockCall]
    calibration: str
    calibration_source: DataSource
    dense: torch.Tensor | None = None
    refinement: tuple[BlockRefinement, ...] = ()


def capture_start(
    source: BlockSource, calib: CalibrationData, rows: slice, storage: torch.device, *, refine: bool
) -> Start:
    """A fresh run's start: the hidden states entering block 0 and what the model's own forward passes each
    block, captured from this rank's `rows` of the calibration tokens (block 0 read for it when streamed),
    kept on `storage` (the device, or the CPU with --offload-activations); with `refine` the dense stream
    starts as a copy."""
    with source.resident(0, to=CPU):
        inputs = capture_block_inputs(source.structure, calib.input_ids[rows], storage)
    dense = inputs.hidden.clone() if refine else None
    return Start(0, [], inputs.hidden, inputs.calls, str(calib.source_description), calib.source, dense)


def restore_start(
    store: ResumeStore,
    state: ResumeState,
    source: BlockSource,
    rows: slice | None,
    storage: torch.device,
    *,
    refine: bool,
) -> Start:
    """A resumed run's start: its blocks restored into the model (unless streamed: the write reads them
    from their files), the next block's inputs (this rank's `rows`; None: all) and with `refine` the dense
    stream saved beside them, read onto `storage`."""
    structure = source.structure
    if not source.streamed:
        store.restore_blocks(structure.blocks, state)
    begin = Start(state.next_block, list(state.records), None, (), state.calibration, state.calibration_source)
    begin.refinement = state.refinement
    if begin.first < len(structure.blocks):
        begin.hidden = store.load_hidden(state, storage, rows=rows)
        if refine:
            begin.dense = store.load_hidden(state, storage, rows=rows, stream="dense")
        with source.resident(0, to=CPU):  # the record runs block 0 once to learn its output type
            begin.calls = capture_block_calls(structure, int(begin.hidden.shape[1]))
    return begin


@dataclass(frozen=True)
class WatchedWeights:
    """The run's weight matrices once the blocks' dense forwards were watched: slots, those left dense
    (`ignored`) or skipped (the pattern does not fit), the records of block parameters that are not
    matmul weights (per block), and each watched block's observation."""

    slots: list[LinearSlot]
    ignored: dict[str, str]
    skipped: dict[str, str]
    unused: dict[int, list[LayerRecord]]
    observed: dict[int, BlockObservation]


def watch_blocks(
    cfg: PruneConfig, plan: PrunePlan, source: BlockSource, slots: list[LinearSlot], begin: Start, team: Team
) -> WatchedWeights:
    """Watch the dense forward of the blocks left to prune (one sample; a streamed run reads each block for
    it and releases it) and settle the run's weight matrices from what they multiply by
    (`plan.probed_weights`), checking them against the pattern as the nn.Linear layers were. A kind of weight
    left dense by a rule is said once on stderr. The selection is the plan's (`PrunePlan.selection`)."""
    observed: dict[int, BlockObservation] = {}
    with team.agreed():
        if begin.hidden is not None:
            observed = observe_blocks(source, begin.hidden[:1], begin.calls, begin.first)
        accounted = probed_weights(source.structure, slots, observed, plan.selection)
        say_ruled(accounted)
        candidates = [s for s in accounted.slots if s.full_name not in accounted.ignored]
        skipped = check_compatibility(candidates, cfg.pattern, skip=cfg.skip_incompatible)
        if cfg.targets and begin.first == 0:
            check_targets_run(candidates, begin.calls, has_outside=bool(plan.outside_targets))
    return WatchedWeights(accounted.slots, accounted.ignored, skipped, accounted.unused, observed)


def say_matrices(structure: ModelStructure, blocks: WatchedWeights, say: Progress) -> None:
    """The run's lines on its weight matrices: how many, and how many are left dense."""
    matrices = sum(s.matrices for s in blocks.slots)
    say(
        f"{structure.model_type}: {len(structure.blocks)} blocks in {structure.blocks_name}, {matrices} weight matrices"
    )
    if blocks.ignored:
        say(f"leaving {len(blocks.ignored)} weight(s) dense (--ignore/--targets, routers and gates)")


def check_targets_run(candidates: Sequence[LinearSlot], calls: Sequence[BlockCall], *, has_outside: bool) -> None:
    """A --targets selection that leaves no matrix to prune (every one it names is left dense: not a
    matmul weight of its block's forward, or no nn.Linear in a block the text-only forward skips, whose
    orientation no forward shows: `idle.prune_idle_by_magnitude`) is refused, as a selection that matches nothing
    is (`selection.excluded_layers`), instead of writing a dense copy with exit 0. Weights of blocks the
    text-only forward skips (Mllama's cross-attention layers) are prunable (`pruning/block/idle.py`)."""
    if has_outside or any(not calls[s.block].idle or not s.param for s in candidates):
        return
    shown = ", ".join(sorted({s.full_name for s in candidates})[:3]) or "no weight matrix of the decoder blocks"
    raise UsageError(
        f"--targets selects nothing tsenor can prune ({shown}: each is left dense), so nothing would be "
        "pruned; target nn.Linear layers or other matmul weights of the decoder blocks, or drop --targets"
    )


def outside_linears(loaded: LoadedModel, plan: PrunePlan, say: Progress, *, root: bool) -> dict[str, nn.Linear]:
    """The linears `--targets` selects outside the language model (`PrunePlan.outside_targets`), by name; says
    which modules outside it stay dense, and (rank 0) warns that the selected ones are pruned by magnitude."""
    structure, targets = loaded.structure, plan.outside_targets
    if structure.outside:
        dense = [name for name in structure.outside if not any(w.name.startswith(f"{name}.") for w in targets)]
        if dense:
            say(f"left dense, outside the language model {structure.base_name}: {', '.join(dense)}")
    if targets and root:
        # The report says it per record too; a user who asked for --method wanda must see it now.
        logger.warning("--targets selects %d linear(s) outside the language model: %s", len(targets), OUTSIDE_REASON)
    return {w.name: cast(nn.Linear, loaded.model.get_submodule(w.name)) for w in targets}


@dataclass(frozen=True)
class RunFacts:
    """What the report says of the run besides its records: settings, context, plan, where it ran, how
    many processes, when it started (`time.perf_counter()`), and its phases so far."""

    cfg: PruneConfig
    ctx: RunContext
    plan: PrunePlan
    device: torch.device
    team: Team
    started: float
    phases: dict[str, float]


def build_report(
    facts: RunFacts,
    counts: WeightCounts,
    records: Sequence[LayerRecord],
    begin: Start,
    refined: Sequence[BlockRefinement],
) -> PruneReport:
    """tsenor_report.json's content: the settings that decided the weights, the layer records, the
    calibration's source, the densities of the pruned model, the refined blocks' records."""
    cfg, device = facts.cfg, facts.device
    settings_dict = {
        **cfg.result_fields(),
        "result_hash": cfg.result_hash(),  # what a rerun of the same command compares (output.finished_prune)
        "device": str(device),
        "seqlen": facts.plan.seqlen,
        "solver": cfg.solver_that_runs(device),
        # Provenance: the result does not depend on it (docs/reliability.md), the timings do.
        "threads": torch.get_num_threads(),
        # How the checkpoint stores the same weights: `tsenor report` reads it where the checkpoint is not
        # beside the report (a sweep's run folder).
        "save_format": cfg.save_format,
    }
    if facts.team.distributed:
        settings_dict["processes"] = facts.team.world_size
    p = cfg.pattern
    return PruneReport(
        method=cfg.method, pattern=None if p.kind == "unstructured" else p, sparsity=float(p.sparsity),
        settings=settings_dict, layers=tuple(records), calibration=begin.calibration,
        seconds=time.perf_counter() - facts.started, output=str(cfg.output), command=cfg.command,
        versions=versions(), resumed_from_block=begin.first if begin.first else None,
        calibration_source=begin.calibration_source, context=ContextRecord.of(facts.ctx),
        model_params=counts.model_params, model_nonzero=counts.model_nonzero, linear_params=counts.linear_params,
        linear_nonzero=counts.linear_nonzero, refinement=tuple(refined), phases=dict(facts.phases),
    )  # fmt: skip

"""`tsenor prune` end to end (`compress`): the prune, then with `--distill-steps N` the whole pruned model
distilled from the dense one with its masks fixed, then `--eval`: the one library call the command makes.

The distillation is `tsenor finetune PRUNED --teacher MODEL --data CALIB --seqlen SEQLEN --max-steps N ...`
(`distill_config`): the quality recipes' last stage (docs/results.md, "Twenty-second session": transposable
16:32 WikiText-2 34.74 → 30.33 on SmolLM2-135M), run by the same command so that a recipe is one command.
Its stages:

1. before any work: the final output's location and contents (an existing run is not replaced without
   --force), the input never written over, the distillation's settings and memory (`distill_plan`: a
   streamed prune of a model larger than memory cannot be distilled whole, and is refused before it starts);
2. the prune into the hidden folder `runfiles.pruned_stage(OUTPUT)`, a prune run folder of its own (its resume
   state after each block, its lock, its report): a rerun after a kill during the distillation finds it
   finished and does not prune again; with --nproc K the K ranks prune it (`launch.stage_arguments`);
3. the distillation into OUTPUT (`finetune.run.finetune`: its own lock and resume state, every
   --distill-save-every steps), then the stage deleted;
4. `--eval` of OUTPUT (`pruning.run.api.evaluate_checkpoint`).

A rerun of a finished run is a no-op, as a prune's is (`runfiles.output.finished_distillation`). The
distillation runs in one process: under torchrun, whose ranks would each train, it is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tsenor_cli.errors import UsageError
from tsenor_cli.finetune.config import FinetuneConfig
from tsenor_cli.outputs import check_output_location, output_lock, output_path
from tsenor_cli.progress import Progress, sink
from tsenor_cli.pruning.settings.config import DistillConfig, PruneConfig
from tsenor_cli.runfiles import EvalReport, FinetuneReport, PruneReport, pruned_stage
from tsenor_cli.runfiles.output import (
    check_not_input,
    check_output_contents,
    finished_distillation,
    remove_stage,
)
from tsenor_cli.settings import RunContext

if TYPE_CHECKING:
    from tsenor_cli.evaluation.runner import EvalConfig
    from tsenor_cli.finetune.plan import FinetunePlan
    from tsenor_cli.interrupt import StopRequest

# What makes the distillation fit, in `tsenor prune`'s flags.
DISTILL_FIT_FLAGS = (
    "pass a smaller --distill-batch-size or --seqlen, or --distill-steps 0 to stop after the prune and "
    "distil elsewhere with tsenor finetune"
)
# The prune of the stage in other processes (`tsenor prune --nproc K`: the CLI starts the ranks on the stage's
# arguments and returns when they succeeded).
Ranks = Callable[[PruneConfig], None]


@dataclass(frozen=True)
class Compressed:
    """What `compress` did: the prune's report, the distillation's (None without --distill-steps) and the
    evaluation (None without --eval, and on the ranks other than 0 of a distributed prune)."""

    prune: PruneReport
    distill: FinetuneReport | None = None
    evaluation: EvalReport | None = None


def distill_config(cfg: PruneConfig, seqlen: int) -> FinetuneConfig:
    """The distillation of `cfg` (`--distill-steps` and the settings beside it) as the `tsenor finetune` run it
    is: from the stage (`pruned_stage`) into `cfg.output`, the teacher the dense model, the training windows
    `seqlen` tokens of the calibration text drawn with the run's seed, nothing evaluated (`--eval` evaluates
    the output after it). A UsageError for a setting finetune refuses (a --device cuda:N)."""
    output = _output(cfg)
    distill = cfg.distill
    return FinetuneConfig(
        run_dir=pruned_stage(output),
        output=output,
        data=cfg.calib_data,
        seqlen=seqlen,
        max_steps=distill.steps,
        lr=distill.lr,
        batch_size=distill.batch_size,
        warmup=distill.warmup,
        seed=cfg.seed,
        dtype=distill.dtype,
        ppl_datasets=(),
        freeze_embeddings=distill.freeze_embeddings,
        save_every=distill.save_every if cfg.resume else 0,
        device=cfg.device,
        trust_remote_code=cfg.trust_remote_code,
        max_shard_size=cfg.max_shard_size,
        teacher=cfg.model,
        force=cfg.force,
        resume=cfg.resume,
        command=cfg.command,
    )


def distill_plan(cfg: PruneConfig, ctx: RunContext) -> FinetunePlan:
    """The distillation's plan before the prune (`finetune.plan.plan_finetune` from the dense model's config):
    what `tsenor prune --dry-run` prints after the prune's plan, and what the run checks before pruning."""
    from tsenor_cli.finetune.plan import plan_finetune

    return plan_finetune(distill_config(cfg, cfg.seqlen), ctx, before=cfg.model)


def compress(
    cfg: PruneConfig,
    ctx: RunContext,
    eval_cfg: EvalConfig | None = None,
    *,
    stop: StopRequest | None = None,
    progress: Progress | None = None,
    ranks: Ranks | None = None,
) -> Compressed:
    """`tsenor prune`: prune `cfg.model` into `cfg.output`; with `cfg.distill.on` prune into the stage and
    distil into `cfg.output` (the module's stages); then evaluate with `eval_cfg` (None: not). ranks: prune
    the stage in other processes instead of this one (`--nproc K`; without a distillation the CLI launches
    the ranks on the command itself). stop: the CLI's signal request, polled by both stages."""
    from tsenor_cli.pruning.run.api import evaluate_checkpoint, prune_and_evaluate

    if not cfg.distill.on:
        report, evaluation = prune_and_evaluate(cfg, ctx, eval_cfg, stop=stop)
        return Compressed(report, None, evaluation)
    say = sink(progress)
    _check_one_process(ctx)
    output = _output(cfg)
    stage = pruned_stage(output)
    # The settings' hash reads the input checkpoint's headers: once for the run (the stage's settings are
    # the run's, `result_fields` holding neither the output nor the distillation).
    key = cfg.result_hash()
    done = None if cfg.force else _finished(cfg, key, output)
    if done is not None:
        say(f"{output} already holds this run, pruned and distilled with the same settings; nothing to do")
    else:
        _check_before(cfg, ctx, output, say)
        report = _prune_stage(replace(cfg, output=stage, distill=DistillConfig()), key, ctx, progress, stop, ranks)
        settings = distill_config(cfg, int(report.settings["seqlen"]))
        say(f"distilling {stage} from {cfg.model} into {output}: {settings.max_steps} steps of {settings.batch_size} "
            f"windows x {settings.seqlen} tokens of {cfg.calib_data}, {settings.dtype}")  # fmt: skip
        done = (report, _distil(settings, ctx, say, stop))
    _remove_stage(stage)
    evaluation = (
        evaluate_checkpoint(output, ctx, eval_cfg, cfg, stop=stop, rerun=done[1].found_finished)
        if eval_cfg is not None
        else None
    )
    return Compressed(done[0], done[1], evaluation)


def _prune_stage(
    stage_cfg: PruneConfig,
    key: str,
    ctx: RunContext,
    progress: Progress | None,
    stop: StopRequest | None,
    ranks: Ranks | None,
) -> PruneReport:
    """The prune into the stage (its settings' hash `key`) → its report: found finished there (a rerun after
    a kill in the distillation), or run here, or by the ranks."""
    from tsenor_cli.pruning.run.api import prune_model
    from tsenor_cli.pruning.run.output import finished_prune

    assert stage_cfg.output is not None
    finished = finished_prune(stage_cfg.output, key, stage_cfg.save_format)
    if finished is not None:
        sink(progress)(f"{stage_cfg.output} holds this run's prune, finished; distilling it")
        return finished
    if ranks is None:
        return prune_model(stage_cfg, ctx, progress, stop=stop)
    ranks(stage_cfg)
    finished = finished_prune(stage_cfg.output, key, stage_cfg.save_format)
    if finished is None:
        raise RuntimeError(f"the ranks succeeded, but {stage_cfg.output} holds no finished prune of these settings")
    return finished


def _output(cfg: PruneConfig) -> Path:
    if cfg.output is None:
        raise UsageError("--output is required to prune; pass --output DIR (or --dry-run to only print the plan)")
    return output_path(cfg.output)


def _check_one_process(ctx: RunContext) -> None:
    if ctx.distributed.distributed:
        raise UsageError(
            f"--distill-steps distils in one process after the prune, and this is rank {ctx.distributed.rank} of "
            f"{ctx.distributed.world_size} under torchrun; start the ranks with --nproc K instead (they prune, the "
            "launching process distils), or prune with --distill-steps 0 and run tsenor finetune after"
        )


def _finished(cfg: PruneConfig, key: str, output: Path) -> tuple[PruneReport, FinetuneReport] | None:
    """(the prune's report, the distillation's) when `output` holds this run (its settings' hash `key`)
    finished, else None."""
    from tsenor_cli.pruning.run.output import finished_prune

    report = finished_prune(output, key, cfg.save_format)
    if report is None:
        return None
    distilled = finished_distillation(output, key, distill_config(cfg, int(report.settings["seqlen"])).result_fields())
    return None if distilled is None else (report, distilled)


def _check_before(cfg: PruneConfig, ctx: RunContext, output: Path, say: Progress) -> None:
    """What the distillation would refuse after the prune, refused before it: the output's location and
    contents, the input as the output, the settings (`distill_config`) and the memory (`distill_plan`)."""
    from tsenor_cli.pruning.plan.plan import dtype_and_device, say_slow_products

    check_output_location(output)
    check_not_input(output, cfg.model)
    # Both stages' half-precision products in one line, before the prune (its own plan sees no distillation).
    say_slow_products(cfg, *dtype_and_device(cfg, ctx, present=False))
    check_output_contents(
        output, force=cfg.force, resume=cfg.resume, continue_hint="drop --no-resume-state to continue it"
    )
    plan = distill_plan(cfg, ctx)
    say(f"distillation after the prune: {plan.summary()[-1]}")
    plan.check(fix=DISTILL_FIT_FLAGS)


def _distil(settings: FinetuneConfig, ctx: RunContext, say: Progress, stop: StopRequest | None) -> FinetuneReport:
    from tsenor_cli.finetune.run import finetune

    return finetune(settings, ctx, say, stop=stop)


def _remove_stage(stage: Path) -> None:
    """The stage deleted under its lock (a prune of it cannot be writing) once the output holds the run."""
    if stage.exists():
        with output_lock(stage):
            remove_stage(stage)

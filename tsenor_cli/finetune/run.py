"""`finetune(cfg, data_dir) -> FinetuneReport`: continue training a pruned checkpoint, its mask fixed.

Built on transformers' `Trainer`, so `torchrun` / `accelerate launch` give data parallelism without
code of ours (evaluation and writing run on the main process only). The model trains in fp32 (with
`bf16`, under bf16 autocast: fp32 master weights) and is saved in the dtype of the input checkpoint.

Output folder (written atomically at the end, like `tsenor prune`'s): the checkpoint (safetensors,
config.json with `tsenor_sparsity` unchanged, tokenizer), the prune's tsenor_report.json/.md
unchanged, finetune.json (`runfiles.FinetuneReport`), eval.json (the evaluation after fine-tuning,
for `tsenor report`), finetune_loss.png and finetune_ppl.png. While the run goes, OUTPUT/.tsenor-resume/
holds finetune_state.json (settings hash, evaluation before fine-tuning) and Trainer's latest
checkpoint-N/ (every `save_every` steps), which `resume` continues from.
"""

from __future__ import annotations

import io
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from tsenor_cli.errors import Interrupted, UsageError
from tsenor_cli.finetune.callback import PPL_LOG_PREFIX, CurveCallback, MaskCallback
from tsenor_cli.finetune.config import CALIBRATION_DATA
from tsenor_cli.finetune.config import FinetuneConfig as FinetuneConfig
from tsenor_cli.finetune.data import TrainingText, WindowDataset, calibration_windows, training_windows
from tsenor_cli.finetune.distill import DistillTrainer, check_teacher
from tsenor_cli.finetune.masks import RunSparsity, pruned_masks, read_run_sparsity
from tsenor_cli.finetune.plan import frozen_parameters, plan_finetune
from tsenor_cli.fixedmask import FixedMask
from tsenor_cli.interrupt import StopRequest
from tsenor_cli.models.identity import identity_digest
from tsenor_cli.models.saving import SavedModel, save_model
from tsenor_cli.progress import Progress, sink
from tsenor_cli.pruning.block.memory import keep_freed_memory
from tsenor_cli.pruning.run.card import card_text
from tsenor_cli.pruning.run.report import versions
from tsenor_cli.runfiles import (
    EVAL_FILE,
    FINETUNE_FILE,
    FINETUNE_LOSS_PLOT_FILE,
    FINETUNE_PPL_PLOT_FILE,
    FINETUNE_STATE_FILE,
    FINETUNE_STATE_VERSION,
    MODEL_CARD,
    PRUNE_FILE,
    PRUNE_MARKDOWN,
    RESUME_DIR,
    ContextRecord,
    EvalReport,
    FinetuneReport,
    FinetuneState,
)
from tsenor_cli.runfiles.output import check_not_input, finished_finetune, interruption, output_run
from tsenor_cli.runfiles.write import write_model_folder
from tsenor_cli.settings import RunContext

if TYPE_CHECKING:
    from tsenor_cli.evaluation.runner import EvalConfig
    from tsenor_cli.kernels.sparse import KernelPlan

# Trainer's defaults, recorded in the report because they decide the result.
SCHEDULER = "linear"
MAX_GRAD_NORM = 1.0


def _load_state(state_dir: Path, cfg: FinetuneConfig) -> FinetuneState | None:
    """The saved finetune state of an interrupted run, None when there is none."""
    state = FinetuneState.read(state_dir)
    if state is None:
        if state_dir.is_dir() and any(state_dir.iterdir()):
            raise UsageError(
                f"{state_dir} holds another command's resume state; pass --force without --resume to start over"
            )
        return None
    if state.schema_version != FINETUNE_STATE_VERSION or state.config_hash != cfg.result_hash():
        raise UsageError(
            f"the resume state in {state_dir} was made with different settings; rerun with the same flags to "
            "continue it, or pass --force without --resume to start over"
        )
    return state


def checkpoint_step(path: Path) -> int | None:
    """N for a Trainer checkpoint folder `checkpoint-N` (transformers' PREFIX_CHECKPOINT_DIR), else None."""
    number = path.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
    return int(number) if number != path.name and number.isdigit() and path.is_dir() else None


def last_complete_checkpoint(state_dir: Path, say: Progress) -> Path | None:
    """The newest Trainer checkpoint (state_dir/checkpoint-N) that was written to the end, or None.

    Trainer writes a checkpoint's files in place, trainer_state.json last (`Trainer._save_checkpoint`), and
    deletes the older one only after that (save_total_limit=1). A kill or a full disk while it writes
    leaves a newer checkpoint-N without a whole trainer_state.json; resuming from it would fail, so it is
    passed over (and written again when the run gets there). Seen: a full disk at step 150 of the study.
    """
    found = [(step, path) for path in state_dir.iterdir() if (step := checkpoint_step(path)) is not None]
    for step, path in sorted(found, reverse=True):
        try:
            written = json.loads((path / TRAINER_STATE_NAME).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            written = None
        if isinstance(written, dict) and written.get("global_step") == step:
            return path
        say(f"passing over {path}: it was not written to the end (stopped while saving)")
    return None


def _load_teacher(cfg: FinetuneConfig, ctx: RunContext, student: Any, device: Any, say: Progress) -> Any:
    """The frozen dense teacher (`--teacher`) on the training device (bf16 under --bf16, else fp32)."""
    from tsenor_cli.models.loading import LoadOptions, load_model

    name = str(cfg.teacher)
    say(f"loading the teacher {name}")
    teacher = load_model(
        name,
        ctx,
        dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
        device=device,
        options=LoadOptions(cfg.trust_remote_code, progress=say),
    )
    check_teacher(student, teacher, name)
    return teacher.model


def _training_args(cfg: FinetuneConfig, state_dir: Path) -> Any:
    from transformers import TrainingArguments

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no CUDA device is available; use --device cpu")
    return TrainingArguments(
        output_dir=str(state_dir),
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=cfg.lr,
        warmup_steps=cfg.warmup,
        lr_scheduler_type=SCHEDULER,
        weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM,
        seed=cfg.seed,
        data_seed=cfg.seed,
        bf16=cfg.bf16,
        use_cpu=cfg.device == "cpu",
        logging_strategy="steps",
        logging_steps=1,
        save_strategy="steps" if cfg.save_every else "no",
        save_steps=cfg.save_every or 1,
        save_total_limit=1,
        # Every step gets batch_size full windows, so steps × windows × seqlen is the exact token count.
        dataloader_drop_last=True,
        remove_unused_columns=False,
        report_to="none",
        disable_tqdm=True,
    )


Curve = list[tuple[int, float]]


def _curves(
    history: list[dict[str, Any]], before: dict[str, float], after: dict[str, float], steps: int
) -> tuple[Curve, Curve, dict[str, Curve]]:
    """Trainer's log history → (loss curve, cross-entropy curve (DistillTrainer's `ce`; empty without a
    teacher), {dataset: ppl curve}) with the before/after perplexities added."""
    loss = [(int(e["step"]), float(e["loss"])) for e in history if "loss" in e]
    ce = [(int(e["step"]), float(e["ce"])) for e in history if "ce" in e]
    ppl: dict[str, list[tuple[int, float]]] = {name: [(0, value)] for name, value in before.items()}
    for entry in history:
        for key, value in entry.items():
            if key.startswith(PPL_LOG_PREFIX):
                ppl.setdefault(key.removeprefix(PPL_LOG_PREFIX), []).append((int(entry["step"]), float(value)))
    for name, value in after.items():
        ppl.setdefault(name, []).append((steps, value))
    return loss, ce, ppl


def _png(draw: Callable[[io.BytesIO], bool]) -> bytes | None:
    buffer = io.BytesIO()
    return buffer.getvalue() if draw(buffer) else None


def finetune(
    cfg: FinetuneConfig,
    ctx: RunContext,
    progress: Progress | None = None,
    *,
    after_save: Callable[[int], None] | None = None,
    stop: StopRequest | None = None,
) -> FinetuneReport:
    """Fine-tune `cfg.run_dir` with its pruned weights held at 0 and write `cfg.output`.

    ctx: where training text, evaluation data and hub models may come from (settings.RunContext).
    after_save(step) runs after each Trainer checkpoint (tests use it to simulate a kill). Every input
    the user can fix raises a `TsenorError` before anything is written.

    stop: the CLI's `interrupt.stop_on_signals` request. Set while training (SIGTERM, SIGUSR1/2), the
    run finishes the step in hand, saves a checkpoint (unless `save_every` is 0) and raises
    `Interrupted` (exit 75); set while evaluating, it stops at once. Ctrl-C raises `Interrupted` (exit
    130). Both say what was saved and how to continue (`--resume`).
    """
    # Under torchrun or accelerate each process runs this; the main one alone reports, as a prune's rank 0.
    say = sink(progress) if ctx.distributed.is_root else _quiet
    start = time.perf_counter()
    stop = stop if stop is not None else StopRequest()
    point = _RunPoint(max_steps=cfg.max_steps)
    state_dir = cfg.output / RESUME_DIR

    def interrupted(signal_name: str | None) -> Interrupted:
        return point.interrupted(cfg, state_dir, signal_name)

    with output_run(cfg.output, interrupted, say=say, stop=stop, remove_empty=(state_dir,)) as run:
        sparsity = read_run_sparsity(cfg.run_dir)
        run.check_location()
        check_not_input(cfg.output, str(cfg.run_dir))
        plan = plan_finetune(cfg, ctx, sparsity)  # the dry run's estimate: said, and a run that cannot fit refused
        for line in plan.summary():
            say(line)
        plan.check()
        args = _training_args(cfg, state_dir)
        # One writer per output folder, as for prune (docs/reliability.md): the main process holds the lock
        # from the folder check to the final swap; the other ranks of a torchrun/accelerate launch write
        # nothing.
        main = args.process_index == 0
        with run.locked(owner=main):
            if main:
                run.recover()
            done = None if cfg.force else finished_finetune(cfg.output, cfg.run_dir, cfg.result_fields())
            if done is not None:
                say(f"{cfg.output} already holds this run, finished with the same settings; nothing to do")
                return done
            run.prepare(force=cfg.force, resume=cfg.resume)
            return _train(_Run(cfg, ctx, args, sparsity, state_dir, say, start, after_save, stop, point))


@dataclass
class _RunPoint:
    """Where a fine-tuning run is, for the line an interruption prints: its phase ("starting",
    "evaluating before", "training", "stopped" (after a graceful stop), "evaluating after") and the
    optimizer steps done."""

    max_steps: int
    phase: str = "starting"
    step: int = 0

    def interrupted(self, cfg: FinetuneConfig, state_dir: Path, signal_name: str | None) -> Interrupted:
        """The `Interrupted` error for a stop here: by `signal_name` (exit 75) or by Ctrl-C (None, exit 130)."""
        where = {
            "starting": "before fine-tuning began",
            "evaluating before": "while evaluating the checkpoint before fine-tuning",
            "training": f"at step {self.step + 1}/{self.max_steps}",
            "stopped": f"after step {self.step}/{self.max_steps}",
            "evaluating after": "while evaluating after fine-tuning",
        }[self.phase]
        return interruption(signal_name, where, _saved(cfg, state_dir))


def _saved(cfg: FinetuneConfig, state_dir: Path) -> str:
    """What an interrupted run leaves to continue from, and how."""
    checkpoint = last_complete_checkpoint(state_dir, _quiet) if state_dir.is_dir() else None
    if checkpoint is not None:
        return (
            f"the resume state holds step {checkpoint_step(checkpoint)} ({checkpoint}): rerun the same command "
            "with --resume to continue"
        )
    if (state_dir / FINETUNE_STATE_FILE).is_file():
        return (
            f"{state_dir} holds the evaluation before fine-tuning, no step yet: rerun the same command with "
            "--resume to continue"
        )
    return "nothing was saved" + ("" if cfg.save_every else " (--save-every 0)") + ": rerunning starts over"


def _quiet(_message: str) -> None:
    """A progress sink that drops its lines."""


class StopCallback(TrainerCallback):
    """Records the steps done, and ends training at the end of a step once `stop` is requested, with a
    checkpoint of that step when `save` (the run's --save-every is not 0). Trainer also checkpoints the
    last step (`DefaultFlowCallback`); with `save_last` False (nothing is evaluated after training, so the
    output is written right after that step) that checkpoint is not written: it would be deleted with the
    resume state a moment later, and it holds the float32 weights and AdamW's two moments, 12 bytes a
    trained weight (about 96 GB for an 8B model)."""

    def __init__(self, stop: StopRequest, point: _RunPoint, *, save: bool, save_last: bool) -> None:
        self.stop = stop
        self.point = point
        self.save = save
        self.save_last = save_last

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.point.step = state.global_step
        if self.stop.requested:
            control.should_training_stop = True
            control.should_save = self.save
        elif state.global_step >= state.max_steps and not self.save_last:
            control.should_save = False


def matching_evaluation(cfg: FinetuneConfig, loaded: Any, device: torch.device) -> tuple[Path, dict[str, Any]] | None:
    """The evaluation of `cfg.run_dir` that tsenor already wrote, when it is the one fine-tuning would run
    first → (its eval.json, the record restricted to what `cfg` evaluates), else None.

    Looked for in RUN_DIR/eval.json (`tsenor prune --eval`, `tsenor eval --output RUN_DIR`) and beside
    RUN_DIR (a sweep's runs/NAME/eval.json for runs/NAME/model). It matches when it evaluated this folder
    (`source`) as it is on disk now (`models.identity.identity_digest`; an eval.json written before tsenor
    recorded it matches nothing), in float32 on the same kind of device, with the window
    length evaluation uses by default, the same --max-windows, every --ppl dataset and, with --tasks,
    the same tasks at the same --limit with no few-shot examples.
    """
    from tsenor_cli.evaluation.runner import effective_seqlen

    folder = cfg.run_dir.resolve()
    identity = identity_digest(str(folder))
    for path in (folder / EVAL_FILE, folder.parent / EVAL_FILE):
        try:
            record = EvalReport.from_json(json.loads(path.read_text(encoding="utf-8")), str(path)).to_json()
        except (OSError, ValueError):  # absent, unreadable, or not an eval.json this tsenor reads
            continue
        zeroshot = record.get("zeroshot")
        same = (
            record["source"] == str(folder)
            and identity is not None
            and record.get("model_identity") == identity
            and record["dtype"] == "float32"
            and torch.device(record["device"]).type == device.type
            and record["seqlen"] == effective_seqlen(loaded, None)
            and record["max_windows"] == cfg.max_windows
            and set(cfg.ppl_datasets) <= set(record["perplexity"])
            and (
                not cfg.tasks
                or (
                    zeroshot is not None
                    and set(zeroshot["tasks"]) == set(cfg.tasks)
                    and zeroshot["limit"] == cfg.limit
                    and zeroshot["num_fewshot"] == 0
                )
            )
        )
        if same:
            perplexity = {name: record["perplexity"][name] for name in cfg.ppl_datasets}
            return path, {**record, "perplexity": perplexity, "zeroshot": zeroshot if cfg.tasks else None}
    return None


@dataclass(frozen=True)
class _Inputs:
    """What training reads, loaded and checked before any step: the model (fp32 on the CPU) and its
    pruned masks {parameter: bool of its shape}, the training windows, the teacher (None without --teacher), the
    dtype the checkpoint was stored in, windows per optimizer step and windows available."""

    loaded: Any
    masks: dict[str, torch.Tensor]
    text: TrainingText
    teacher: Any
    saved_dtype: torch.dtype
    per_step: int
    available: int


@dataclass(frozen=True)
class _Run:
    """One fine-tuning run past its output checks: its settings and context, Trainer's arguments, the pruned
    checkpoint's sparsity, the resume state's folder, where progress goes, when it started, the hook after each
    checkpoint, the stop request and where the run is (`_RunPoint`, for an interruption's line)."""

    cfg: FinetuneConfig
    ctx: RunContext
    args: Any
    sparsity: RunSparsity
    state_dir: Path
    say: Progress
    start: float
    after_save: Callable[[int], None] | None
    stop: StopRequest
    point: _RunPoint


def _train(run: _Run) -> FinetuneReport:
    """`finetune` past its output checks, under the output lock, in the steps docs/architecture.md names:
    load (`_load_inputs`), evaluate before (`_evaluate_before`, or the resume state's or the prune's own
    eval.json), train (`_training_loop`), evaluate after, report and write (`_write_output`); `run.point`
    follows the phases and steps for an interruption's line."""
    from tsenor_cli.evaluation.runner import EvalConfig, evaluate_model

    cfg, ctx, args, sparsity, state_dir, say = run.cfg, run.ctx, run.args, run.sparsity, run.state_dir, run.say
    state = _load_state(state_dir, cfg) if cfg.resume else None
    inputs = _load_inputs(cfg, ctx, args, sparsity, say)
    model = inputs.loaded.model.to(args.device)
    for parameter in frozen_parameters(model, cfg):  # Trainer's optimizer takes the parameters that train
        parameter.requires_grad_(False)
    fixed = FixedMask(model, inputs.masks)
    kernels = _sparse_kernels(cfg, sparsity, model, args.device, say)
    mask = MaskCallback(fixed, refresh=kernels.refresh if kernels is not None else None)
    main = args.process_index == 0
    eval_cfg = EvalConfig(ppl_datasets=cfg.ppl_datasets, tasks=cfg.tasks, limit=cfg.limit, max_windows=cfg.max_windows)
    wants_eval = bool(cfg.ppl_datasets or cfg.tasks)
    eval_before: dict[str, Any] | None = state.eval_before if state is not None else None
    if eval_before is None and wants_eval and main:
        eval_before = _evaluate_before(run, inputs.loaded, eval_cfg)
    if main and cfg.save_every and state is None:
        FinetuneState(cfg.result_hash(), eval_before).write(state_dir)
    trained = _training_loop(run, inputs, model, mask)
    nonzero = fixed.nonzero_pruned()
    if nonzero:
        raise RuntimeError(f"{nonzero} pruned weights became non-zero despite the mask; this is a bug in tsenor")
    eval_after = None
    if wants_eval and main:
        say("evaluating after fine-tuning")
        run.point.phase = "evaluating after"
        with run.stop.at_once():
            eval_after = evaluate_model(inputs.loaded, eval_cfg, ctx, progress=say).to_json()
    report = _finetune_report(run, inputs, trained, (eval_before, eval_after), nonzero)
    if main:
        _write_output(cfg, sparsity, inputs.loaded, report, inputs.saved_dtype, say)
    return report


def _sparse_kernels(
    cfg: FinetuneConfig, sparsity: RunSparsity, model: Any, device: torch.device, say: Progress
) -> KernelPlan | None:
    """`--kernels sparse`: the 2:4-pruned linears routed through the sparse kernels for the training
    forwards (bf16 autocast; fp32 weights are not what the kernels take), said in one line; None for dense."""
    if cfg.kernels != "sparse":
        return None
    from tsenor_cli.kernels.sparse import plan_kernels

    dtype = torch.bfloat16 if cfg.bf16 else next(model.parameters()).dtype
    plan = plan_kernels(model, sparsity.record, torch.device(device), dtype, training=True)
    if plan.backend is not None:
        plan.note = "forwards outside bf16 autocast (the fp32 evaluations) run dense"
        plan.install(model)
    say(plan.line())
    return plan


def _load_inputs(cfg: FinetuneConfig, ctx: RunContext, args: Any, sparsity: RunSparsity, say: Progress) -> _Inputs:
    """Load the pruned checkpoint, its masks (checked against the recorded pattern), the training windows
    and the teacher; every input the user can fix fails here, before a step."""
    from tsenor_cli.models.loading import LoadOptions, load_model

    if cfg.tasks:
        from tsenor_cli.evaluation.zeroshot import validate_tasks

        validate_tasks(cfg.tasks)
    how = LoadOptions(cfg.trust_remote_code, progress=say)
    loaded = load_model(str(cfg.run_dir), ctx, dtype=torch.float32, device="cpu", options=how)
    saved_dtype = loaded.source_dtype or torch.float32
    calibration = cfg.data == CALIBRATION_DATA  # the prune's windows, whose length is the prune's
    if not calibration and loaded.max_positions is not None and cfg.seqlen > loaded.max_positions:
        raise UsageError(
            f"--seqlen {cfg.seqlen} exceeds the model's max_position_embeddings {loaded.max_positions}; "
            f"pass --seqlen {loaded.max_positions} or less"
        )
    masks = pruned_masks(loaded.model, sparsity)
    per_step = cfg.batch_size * cfg.grad_accum * args.world_size
    if calibration:
        text = calibration_windows(sparsity.report, loaded.tokenizer, ctx=ctx)
    else:
        text = training_windows(
            cfg.data, loaded.tokenizer, seqlen=cfg.seqlen, windows=cfg.max_steps * per_step, seed=cfg.seed, ctx=ctx
        )
    available = int(text.windows.shape[0])
    if available < cfg.batch_size * args.world_size:
        raise UsageError(
            f"--data {cfg.data} fills only {available} windows of {text.seqlen} tokens, fewer than one batch "
            f"({cfg.batch_size} per process); pass more text, a smaller --seqlen or a smaller --batch-size"
        )
    say(f"training data: {text.description}")
    teacher = _load_teacher(cfg, ctx, loaded, args.device, say) if cfg.teacher is not None else None
    return _Inputs(loaded, masks, text, teacher, saved_dtype, per_step, available)


def _evaluate_before(run: _Run, loaded: Any, eval_cfg: EvalConfig) -> dict[str, Any]:
    """The evaluation of the pruned checkpoint before training (eval.json's object): the prune's own
    eval.json when its settings match (`matching_evaluation`), else run now (stopping at once on a signal)."""
    from tsenor_cli.evaluation.runner import evaluate_model

    say = run.say
    earlier = matching_evaluation(run.cfg, loaded, run.args.device)
    if earlier is not None:
        path, record = earlier
        say(f"evaluation before fine-tuning: {path} (the same evaluation of this checkpoint), not run again")
        return record
    say(
        "evaluating the pruned checkpoint before fine-tuning (no eval.json of it with these settings; "
        "--max-windows N or --ppl none shortens it)"
    )
    run.point.phase = "evaluating before"
    with run.stop.at_once():
        return evaluate_model(loaded, eval_cfg, run.ctx, progress=say).to_json()


def _training_loop(run: _Run, inputs: _Inputs, model: Any, mask: MaskCallback) -> tuple[Any, CurveCallback, int | None]:
    """Trainer's loop with the mask held fixed, the perplexity curve every --eval-every steps and the stop
    signals honoured after the step in hand; continued from the last complete checkpoint with --resume
    → (the trainer, the curve callback, the step resumed from or None)."""
    from transformers import PrinterCallback, Trainer, default_data_collator

    from tsenor_cli.evaluation.runner import EvalConfig, evaluate_model

    cfg, ctx, stop, point, say = run.cfg, run.ctx, run.stop, run.point, run.say
    curve_cfg = EvalConfig(ppl_datasets=cfg.ppl_datasets, max_windows=cfg.max_windows)

    def ppl_now() -> dict[str, float]:
        if stop.requested:  # training stops after this step: no curve point (a resumed run evaluates it)
            return {}
        with stop.at_once():
            report = evaluate_model(inputs.loaded, curve_cfg, ctx)
        model.train()  # evaluate_model leaves the model in eval mode
        return {name: entry.ppl for name, entry in report.perplexity.items()}

    wants_eval = bool(cfg.ppl_datasets or cfg.tasks)
    curve = CurveCallback(ppl_now if wants_eval else None, cfg.eval_every, say, run.after_save)
    common: dict[str, Any] = {
        "model": model,
        "args": run.args,
        "train_dataset": WindowDataset(inputs.text.windows),
        "data_collator": default_data_collator,
        "callbacks": [mask, curve, StopCallback(stop, point, save=cfg.save_every > 0, save_last=wants_eval)],
    }
    if inputs.teacher is None:
        trainer = Trainer(**common)
    else:
        trainer = DistillTrainer(
            **common,
            teacher=inputs.teacher,
            weight=cfg.distill_weight,
            temperature=cfg.distill_temperature,
            hidden=cfg.distill_hidden,
            say=say,
        )
    trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout; CurveCallback reports instead
    checkpoint = last_complete_checkpoint(run.state_dir, say) if cfg.resume and run.state_dir.is_dir() else None
    resumed = checkpoint_step(checkpoint) if checkpoint is not None else None
    if resumed is not None:
        say(f"resuming after step {resumed}/{cfg.max_steps} from {checkpoint}")
    point.phase, point.step = "training", resumed or 0
    kept = keep_freed_memory()  # each step's activations in pages the last step faulted in already
    if kept is not None:
        say(f"the C allocator keeps its defaults: {kept}")
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None)
    if stop.requested:  # StopCallback ended training after the step in hand (and saved it)
        point.phase = "stopped"
        raise point.interrupted(cfg, run.state_dir, stop.name)
    return trainer, curve, resumed


def _finetune_report(
    run: _Run,
    inputs: _Inputs,
    trained: tuple[Any, CurveCallback, int | None],
    evaluations: tuple[dict[str, Any] | None, dict[str, Any] | None],
    nonzero: int,
) -> FinetuneReport:
    """finetune.json's content; trained: `_training_loop`'s (trainer, curve, step resumed from); evaluations:
    eval.json's objects before and after training (None: not run); nonzero: pruned weights found non-zero."""
    cfg, args, (trainer, curve, resumed) = run.cfg, run.args, trained
    eval_before, eval_after = evaluations
    steps = int(trainer.state.global_step)
    loss, ce, ppl = _curves(
        trainer.state.log_history,
        {k: v["ppl"] for k, v in (eval_before or {}).get("perplexity", {}).items()},
        {k: v["ppl"] for k, v in (eval_after or {}).get("perplexity", {}).items()},
        steps,
    )
    return FinetuneReport(
        settings={
            **cfg.result_fields(),
            "device": str(args.device),
            "optimizer": str(args.optim),
            "scheduler": SCHEDULER,
            "max_grad_norm": MAX_GRAD_NORM,
            "weight_decay": 0.0,
            "save_every": cfg.save_every,
            "saved_dtype": str(inputs.saved_dtype).removeprefix("torch."),
        },
        run_dir=str(cfg.run_dir),
        pattern=run.sparsity.record.summary(),
        data=inputs.text.description,
        data_source=inputs.text.source.to_json(),
        windows=inputs.available,
        steps=steps,
        tokens=steps * inputs.per_step * inputs.text.seqlen,
        epochs=steps * inputs.per_step / inputs.available,
        world_size=int(args.world_size),
        loss_curve=loss,
        ce_curve=ce,
        ppl_curve=ppl,
        eval_before=eval_before,
        eval_after=eval_after,
        pruned_nonzero=nonzero,
        seconds=time.perf_counter() - run.start,
        seconds_per_step=statistics.median(curve.step_seconds) if curve.step_seconds else 0.0,
        resumed_from_step=resumed,
        output=str(cfg.output),
        command=cfg.command,
        context=asdict(ContextRecord.of(run.ctx)),
        versions=versions(),
    )


def _write_output(
    cfg: FinetuneConfig,
    sparsity: RunSparsity,
    loaded: Any,
    report: FinetuneReport,
    saved_dtype: torch.dtype,
    say: Progress,
) -> None:
    """The checkpoint in its original dtype, the prune's reports, finetune.json, eval.json and the plots."""
    from tsenor_cli.packed.files import declares_packed
    from tsenor_cli.report.plots import plot_perplexity_vs_steps, plot_training_loss

    label = cfg.output.name
    files: dict[str, str | bytes] = {
        **loaded.processor_files,
        PRUNE_FILE: (cfg.run_dir / PRUNE_FILE).read_bytes(),
        FINETUNE_FILE: json.dumps(report.to_json(), indent=2) + "\n",
    }
    if (cfg.run_dir / PRUNE_MARKDOWN).is_file():
        files[PRUNE_MARKDOWN] = (cfg.run_dir / PRUNE_MARKDOWN).read_bytes()
    evaluation = EvalReport.from_json(report.eval_after) if report.eval_after is not None else None
    if report.eval_after is not None:
        files[EVAL_FILE] = json.dumps(report.eval_after, indent=2) + "\n"
    # The output keeps its input's format: a packed prune fine-tuned is packed again (its masks are fixed),
    # and its card says how to load it.
    packed = declares_packed(cfg.run_dir)
    files[MODEL_CARD] = card_text(sparsity.report, evaluation=evaluation, finetuned=report, packed=packed)
    for name, png in (
        (FINETUNE_LOSS_PLOT_FILE, _png(lambda out: plot_training_loss({label: report.loss_curve}, out))),
        (FINETUNE_PPL_PLOT_FILE, _png(lambda out: plot_perplexity_vs_steps({label: report.ppl_curve}, out))),
    ):
        if png is not None:
            files[name] = png
    say(f"writing {cfg.output}")
    loaded.model.to(saved_dtype)
    saved = SavedModel(loaded.model, loaded.tokenizer, cfg.max_shard_size, layout=loaded.layout, packed=packed)
    write_model_folder(cfg.output, sparsity.record, files, partial(save_model, saved=saved, sparsity=sparsity.record))

"""Trainer callbacks: the fixed sparsity mask, the perplexity curve and progress lines.

`MaskCallback` keeps every pruned weight at exactly 0 in two ways:

- a gradient hook on each pruned weight zeroes the gradient at pruned positions during backward,
  before it is accumulated, all-reduced (DDP), clipped or seen by the optimizer, so gradient clipping
  and Adam's moments only ever see the weights that train;
- after every optimizer step the mask is written into the weights again, which also covers what a
  zero gradient does not (weight decay on a non-zero value, an optimizer with other update rules).

The hooks sit on the parameters the model had when the callback was made; data-parallel wrappers
(DDP via `torchrun` / `accelerate launch`) keep those parameters, while FSDP replaces them by flat
shards, which this callback does not handle.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from tsenor_cli.fixedmask import FixedMask

# The key prefix of the perplexities this callback adds to `TrainerState.log_history` ("tsenor_ppl/c4"):
# Trainer saves that history with each checkpoint, so a resumed run keeps the curve before the interruption.
PPL_LOG_PREFIX = "tsenor_ppl/"


class MaskCallback(TrainerCallback):
    """Gradient hooks for the whole training run, and the mask re-applied after each optimizer step.

    refresh: called whenever the weights may have changed (at the start, which follows a resumed run's
    checkpoint load, and after each step's mask): the sparse kernels' compressed copies made again."""

    def __init__(self, fixed: FixedMask, refresh: Callable[[], None] | None = None) -> None:
        self.fixed = fixed
        self.refresh = refresh if refresh is not None else _nothing

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.fixed.apply()
        self.fixed.attach()
        self.refresh()

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.fixed.apply()
        self.refresh()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.fixed.detach()


def _nothing() -> None:
    """No compressed copies to make again (dense kernels)."""


class CurveCallback(TrainerCallback):
    """Perplexity every `eval_every` steps into the log history, step times, progress lines, and a hook
    after saves.

    evaluate() → {dataset: ppl} must leave the model in training mode ({}: no point this time, the run is
    stopping); it runs on the main process only, after the step (the final step is left to the caller's
    after-training evaluation).
    step_seconds: wall time of each optimizer step run by this process, from its first micro-batch's
    forward to the end of the optimizer step (batch loading, evaluation and checkpoints excluded).
    after_save(step) runs once a checkpoint is written (tests use it to simulate an interruption).
    """

    def __init__(
        self,
        evaluate: Callable[[], dict[str, float]] | None,
        eval_every: int,
        progress: Callable[[str], None],
        after_save: Callable[[int], None] | None = None,
    ) -> None:
        self.evaluate = evaluate
        self.eval_every = eval_every
        self.progress = progress
        self.after_save = after_save
        self.step_seconds: list[float] = []
        self._step_start = 0.0

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._step_start = time.perf_counter()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.step_seconds.append(time.perf_counter() - self._step_start)
        step = state.global_step
        due = self.eval_every > 0 and step % self.eval_every == 0 and step < state.max_steps
        values = self.evaluate() if due and self.evaluate is not None and state.is_world_process_zero else {}
        if values:  # none when the run is stopping
            state.log_history.append({"step": step, **{PPL_LOG_PREFIX + k: v for k, v in values.items()}})
            self.progress(f"step {step}: " + ", ".join(f"{name} ppl {ppl:.3f}" for name, ppl in values.items()))

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs and "loss" in logs and state.is_world_process_zero:
            ce = f" (ce {logs['ce']:.4f})" if "ce" in logs else ""  # DistillTrainer's cross-entropy part
            self.progress(
                f"step {state.global_step}/{state.max_steps}: loss {logs['loss']:.4f}{ce}, "
                f"lr {logs.get('learning_rate', float('nan')):.3g}"
            )

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.after_save is not None:
            self.after_save(state.global_step)

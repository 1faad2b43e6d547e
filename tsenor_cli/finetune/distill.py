"""Knowledge distillation from the dense model while fine-tuning with the mask fixed (`--teacher`).

Plain fine-tuning learns from one token per position; distillation learns the dense model's whole
next-token distribution, which carries far more signal per token. That matters here because the
offline C4 text is small (480 windows of 512 tokens, read 1.67 times by the issue's 200 steps), and
distillation is a common way to recover sparse LLMs (Kurtic et al. 2023, "Sparse Fine-tuning for
Inference Acceleration of Large Language Models"). Measured here (docs/guide/finetune.md): half
distillation beat cross-entropy alone on SmolLM2 16:32; distillation alone did worse by step 50. The
loss is Hinton et al.'s (2015):

    loss = w · τ² · KL(softmax(t/τ) ‖ softmax(s/τ)) + (1 − w) · CE(s, next token)

averaged over the predicted positions (every position but the last of each window); τ² keeps the
gradient's size independent of τ. The teacher runs under no_grad in eval mode, on the student's
device, and never changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer

from tsenor_cli.errors import UsageError


@dataclass(frozen=True)
class DistillLoss:
    """The distillation loss of one batch: `total` (what is minimized), and its two parts (detached)."""

    total: torch.Tensor
    kl: torch.Tensor
    ce: torch.Tensor


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    weight: float,
    temperature: float,
) -> DistillLoss:
    """student_logits, teacher_logits: (B, T, V); input_ids: (B, T) long → the scalar loss above.

    Position t predicts token t + 1, so the last position has no target and is left out of both parts.
    Computed in fp32 whatever the logits' dtype (a bf16 log-softmax over 49k-128k entries loses the
    small probabilities the KL term weighs).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} != teacher logits {tuple(teacher_logits.shape)}"
        )
    vocab = student_logits.shape[-1]
    s = student_logits[:, :-1].float().reshape(-1, vocab)  # (B·(T−1), V)
    t = teacher_logits[:, :-1].float().reshape(-1, vocab)  # (B·(T−1), V)
    targets = input_ids[:, 1:].reshape(-1)  # (B·(T−1),)
    kl = F.kl_div(
        F.log_softmax(s / temperature, dim=-1),
        F.log_softmax(t / temperature, dim=-1),
        log_target=True,
        reduction="batchmean",  # sum over V, mean over positions: the KL per predicted token
    ) * (temperature**2)
    ce = F.cross_entropy(s, targets)
    total = weight * kl + (1.0 - weight) * ce if weight < 1.0 else kl
    return DistillLoss(total=total, kl=kl.detach(), ce=ce.detach())


def check_teacher(student: Any, teacher: Any, teacher_name: str) -> None:
    """Raise UsageError unless the teacher scores the same vocabulary the student was tokenized with.

    student / teacher: `LoadedModel`s. A teacher with another tokenizer would be distilled into the
    wrong token ids without any error, so the vocabularies must be identical, not merely the same size.
    """
    if student.tokenizer.get_vocab() != teacher.tokenizer.get_vocab():
        raise UsageError(
            f"--teacher {teacher_name} has a different tokenizer from the pruned checkpoint; pass the dense "
            "model the checkpoint was pruned from"
        )
    sizes = student.model.get_output_embeddings().weight.shape[0], teacher.model.get_output_embeddings().weight.shape[0]
    if sizes[0] != sizes[1]:
        raise UsageError(
            f"--teacher {teacher_name} has {sizes[1]} output logits, the pruned checkpoint {sizes[0]}; pass the "
            "dense model the checkpoint was pruned from"
        )


class DistillTrainer(Trainer):
    """`Trainer` whose loss is `distillation_loss` against a frozen teacher.

    Each micro-batch's loss is a mean over its positions and every window has the same length, so
    Trainer's division by the accumulation steps (`loss_is_scaled_for_ga = False`) gives the exact mean
    over the optimizer step; data-parallel ranks are averaged by DDP. The cross-entropy part is logged
    as `ce` beside Trainer's `loss`, so the curve compares with a run without a teacher.
    """

    loss_is_scaled_for_ga = False

    def __init__(self, *args: Any, teacher: nn.Module, weight: float, temperature: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval().requires_grad_(False)
        self.weight = weight
        self.temperature = temperature
        self._ce_sum = 0.0
        self._ce_count = 0

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        input_ids = inputs["input_ids"]  # (B, T)
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=input_ids).logits  # (B, T, V)
        outputs = model(input_ids=input_ids)
        loss = distillation_loss(
            outputs.logits, teacher_logits, input_ids, weight=self.weight, temperature=self.temperature
        )
        if model.training:
            self._ce_sum += float(loss.ce)
            self._ce_count += 1
        return (loss.total, outputs) if return_outputs else loss.total

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._ce_count:
            logs["ce"] = self._ce_sum / self._ce_count
            self._ce_sum, self._ce_count = 0.0, 0
        super().log(logs, start_time)

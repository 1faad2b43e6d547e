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

The whole logits are never held (`head_distillation_loss`): the output layer, both softmaxes and the
loss's gradient run a few hundred positions at a time, from the models' last hidden states, which a
pre-hook on each model's output layer (`get_output_embeddings`) takes while handing the layer no positions.
With the whole (B, T, V) logits the loss held about eight fp32 copies of them (4 × 512 × 49,152 on
SmolLM2: 0.4 GB each); measured in docs/results.md ("Nineteenth session"). A model whose logits are
not its output layer of that hidden state (a soft cap, a scale) is seen on a short input before training
and keeps the whole-logits loss, said in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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


# Positions the output layer and the loss take at a time: a chunk's fp32 logits are at most this size. The
# loss holds about seven tensors of that size at once (both logits, the log-softmaxes, the teacher's
# probabilities, the gradient), so 32 MiB keeps it near a quarter of a GB whatever the batch.
CHUNK_BYTES = 32 << 20


def chunk_rows(vocab: int) -> int:
    """Positions per chunk for a vocabulary of `vocab` logits."""
    return max(1, CHUNK_BYTES // (4 * vocab))


@dataclass(frozen=True)
class OutputHead:
    """A model's output layer as the loss computes it: weight (V, H) and bias (V,) or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, model: Any) -> OutputHead:
        """The output layer `get_output_embeddings()` names (transformers' API for it, on every causal LM)."""
        head = model.get_output_embeddings()
        weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"{type(model).__name__} has no output layer with a weight")
        return cls(weight, bias if isinstance(bias, torch.Tensor) else None)

    def float(self) -> OutputHead:
        """The layer in fp32 (itself when it is)."""
        return OutputHead(self.weight.float(), self.bias.float() if self.bias is not None else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, H) → fp32 logits (n, V)."""
        out = hidden.float() @ self.weight.float().T
        return out + self.bias.float() if self.bias is not None else out


@dataclass(frozen=True)
class LastHidden:
    """What a model's output layer takes, and the layer: states (B, T, H) and head."""

    states: torch.Tensor
    head: OutputHead


@dataclass(frozen=True)
class _Taught:
    """`_HeadLoss`'s inputs that take no gradient: the teacher's states at the predicted positions (N, H)
    and its output layer, detached, and the loss's settings (`distillation_loss`'s weight and temperature)."""

    states: torch.Tensor
    head: OutputHead
    share: float
    temperature: float


class _HeadLoss(torch.autograd.Function):
    """`distillation_loss` from the last hidden states, a chunk of positions at a time (`chunk_rows`).

    The gradient is the closed form of the loss's, taken in the same pass: with q = softmax(s/τ) and
    p = softmax(t/τ), d(τ² · KL)/ds = τ · (q − p) and dCE/ds = softmax(s) − onehot(target), each over the
    N positions; then dL/dhidden = g · W (in the autocast's dtype when one is on) and dL/dW = gᵀ · hidden.
    Only those two (and the bias's) are kept for backward, never a (N, V) tensor.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        taught: _Taught,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) long → (total, kl, ce) scalars."""
        count = hidden.shape[0]
        share, temperature, teacher_hidden = taught.share, taught.temperature, taught.states
        student = OutputHead(weight, bias).float()
        teacher = taught.head.float()
        wants = ctx.needs_input_grad
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if wants[0] else None
        grad_weight = torch.zeros_like(student.weight) if wants[1] else None
        grad_bias = torch.zeros_like(student.bias) if wants[2] and student.bias is not None else None
        kl_sum = hidden.new_zeros((), dtype=torch.float32)
        ce_sum = hidden.new_zeros((), dtype=torch.float32)
        rows = chunk_rows(student.weight.shape[0])
        # The states' gradient in the autocast's dtype, as autocast's own backward would take it: 3x fp32's
        # speed on a CPU with bf16 units (54 → 18 ms a chunk of 170 rows, SmolLM2's head). The weight's stays
        # an fp32 addmm: adding a bf16 product into the fp32 sum costs more than it saves (59 against 45 ms).
        device = hidden.device.type
        low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        student_low = student.weight.to(low) if low is not None and wants[0] else None
        # The logits and softmaxes in fp32 whatever the autocast (a bf16 log-softmax over 49k-128k entries
        # loses the small probabilities the KL term weighs).
        with torch.autocast(device_type=device, enabled=False):
            for start in range(0, count, rows):
                piece = hidden[start : start + rows].float()  # (r, H)
                s = student.logits(piece)  # (r, V)
                log_q = F.log_softmax(s / temperature, dim=-1)
                log_p = F.log_softmax(teacher.logits(teacher_hidden[start : start + rows]) / temperature, dim=-1)
                p = log_p.exp()
                kl_sum += (p * (log_p - log_q)).sum()
                log_s = log_q if temperature == 1.0 else F.log_softmax(s, dim=-1)
                picked = targets[start : start + rows, None]  # (r, 1)
                ce_sum -= log_s.gather(1, picked).sum()
                if grad_hidden is None and grad_weight is None and grad_bias is None:
                    continue
                g = log_q.exp().sub_(p).mul_(share * temperature / count)  # (r, V)
                if share < 1.0:
                    softmax_minus_onehot = log_s.exp().scatter_add_(1, picked, torch.full_like(s[:, :1], -1.0))
                    g.add_(softmax_minus_onehot, alpha=(1.0 - share) / count)
                if grad_hidden is not None:
                    product = g @ student.weight if student_low is None else g.to(low) @ student_low
                    grad_hidden[start : start + rows] = product
                if grad_weight is not None:
                    grad_weight.addmm_(g.T, piece)
                if grad_bias is not None:
                    grad_bias += g.sum(0)
        kl = kl_sum * temperature**2 / count
        ce = ce_sum / count
        total = share * kl + (1.0 - share) * ce if share < 1.0 else kl.clone()
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = hidden.dtype, weight.dtype, bias.dtype if bias is not None else None
        ctx.mark_non_differentiable(kl, ce)
        return total, kl, ce

    @staticmethod
    def backward(
        ctx: Any, grad_total: torch.Tensor, _grad_kl: torch.Tensor, _grad_ce: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        grads = tuple(
            None if g is None else (g * grad_total).to(dtype) for g, dtype in zip(saved, ctx.dtypes, strict=True)
        )
        return (*grads, None, None)


def head_distillation_loss(
    student: LastHidden, teacher: LastHidden, input_ids: torch.Tensor, *, weight: float, temperature: float
) -> DistillLoss:
    """student, teacher: each model's last hidden states (B, T, H) and output layer; input_ids (B, T) →
    `distillation_loss` of the logits student.head(student.states) and teacher.head(teacher.states), without
    forming them whole. Gradients reach the student's states and its head's weight and bias, not the teacher.
    """
    width = student.states.shape[-1]
    head = teacher.head
    taught = _Taught(
        teacher.states[:, :-1].reshape(-1, width).detach(),
        OutputHead(head.weight.detach(), head.bias.detach() if head.bias is not None else None),
        weight,
        temperature,
    )
    total, kl, ce = _HeadLoss.apply(
        student.states[:, :-1].reshape(-1, width),
        student.head.weight,
        student.head.bias,
        input_ids[:, 1:].reshape(-1),
        taught,
    )
    return DistillLoss(total=total, kl=kl, ce=ce)


@contextmanager
def last_hidden(model: Any) -> Iterator[list[torch.Tensor]]:
    """While open, each call of `model`'s output layer appends the hidden states it was given to the yielded
    list and computes the logits of no position instead (its output is (..., 0, V)): the whole logits are
    never formed. A call that passes the states by keyword is left alone (and appends nothing)."""
    taken: list[torch.Tensor] = []

    def take(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            return None
        taken.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(take)
    try:
        yield taken
    finally:
        handle.remove()


def head_mismatch(model: Any, vocab: int) -> str | None:
    """Why `model`'s logits are not its output layer applied to the hidden states that layer takes, seen on a
    short input (eval mode, no grad), or None when they are. Where they are not (a soft cap or a scale
    after the layer, another head, a layer that computes more than weight · hidden + bias),
    `head_distillation_loss` would train the wrong logits. A bf16 model's layer is compared with the loss's
    fp32 one within bf16's rounding (before, every bf16 teacher fell back to the whole logits)."""
    ids = (torch.arange(8, device=model.device) % vocab)[None]  # (1, 8)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits  # (1, 8, V)
            with last_hidden(model) as taken:
                model(input_ids=ids)
            if len(taken) != 1:
                return f"its output layer took {len(taken)} positional inputs in one forward, not 1"
            layer = model.get_output_embeddings()(taken[0])  # (1, 8, V), as the forward computes it
            head = OutputHead.of(model)
            mine = head.logits(taken[0].reshape(-1, taken[0].shape[-1])).reshape(logits.shape)
    finally:
        model.train(was_training)
    if not torch.allclose(layer.float(), logits.float(), rtol=1e-4, atol=1e-4):
        return "its logits differ from its output layer's (a soft cap or a scale after it)"
    # The loss computes the layer in fp32: from a bf16 model's, it differs by the bf16 rounding alone.
    tol = max(1e-4, 4 * torch.finfo(layer.dtype).eps)
    if not torch.allclose(mine, layer.float(), rtol=tol, atol=tol):
        return "its output layer computes more than weight · hidden + bias"
    return None


def hidden_state_loss(student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor]) -> torch.Tensor:
    """student, teacher: the models' reported hidden states, (B, T, H) each, the embeddings' first → the mean
    over the layers' outputs (all but the first) of ‖h_s − h_t‖² / ‖h_t‖²: the normalized squared error of
    SquareHead distillation (Kurtic et al. 2023), which weighs every layer alike whatever its scale. In fp32."""
    if len(student) != len(teacher) or len(student) < 2:
        raise ValueError(f"{len(student)} student hidden states against {len(teacher)} of the teacher's")
    terms = [
        (s.float() - t.float()).pow(2).sum() / t.float().pow(2).sum().clamp_min(torch.finfo(torch.float32).tiny)
        for s, t in zip(student[1:], teacher[1:], strict=True)
    ]
    return torch.stack(terms).mean()


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

    With `hidden` > 0 the loss adds `hidden` × `hidden_state_loss` of the layers' outputs.

    The loss is `head_distillation_loss` from both models' last hidden states, unless `head_mismatch`
    finds either model's logits to be more than its output layer's; then the whole logits are formed
    and `say` is told why, once.
    """

    loss_is_scaled_for_ga = False

    def __init__(
        self,
        *args: Any,
        teacher: nn.Module,
        weight: float,
        temperature: float,
        hidden: float,
        say: Callable[[str], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval().requires_grad_(False)
        self.weight = weight
        self.temperature = temperature
        self.hidden = hidden
        self._ce_sum = 0.0
        self._ce_count = 0
        self.student: Any = self.model  # Trainer's own model, unwrapped (DDP's wrapper is `model` below)
        vocab = OutputHead.of(teacher).weight.shape[0]
        why = head_mismatch(self.student, vocab) or head_mismatch(teacher, vocab)
        if why is not None:
            say(f"distillation forms the whole logits of every batch: {why}")
        self.by_chunks = why is None

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        input_ids = inputs["input_ids"]  # (B, T)
        states = self.hidden > 0.0  # the layers' outputs too, for `hidden_state_loss`
        if self.by_chunks:
            with torch.no_grad(), last_hidden(self.teacher) as taught:
                teacher_out = self.teacher(input_ids=input_ids, output_hidden_states=states)
            with last_hidden(self.student) as taken:  # the hook sits on the unwrapped model's own layer
                # through DDP's wrapper, which syncs the gradients
                outputs = model(input_ids=input_ids, output_hidden_states=states)
            if len(taken) != 1 or len(taught) != 1:
                raise RuntimeError(
                    f"the output layers took {len(taken)} and {len(taught)} inputs in one forward, not 1 (checked "
                    "before training); this is a bug in tsenor"
                )
            loss = head_distillation_loss(
                LastHidden(taken[0], OutputHead.of(self.student)),
                LastHidden(taught[0], OutputHead.of(self.teacher)),
                input_ids,
                weight=self.weight,
                temperature=self.temperature,
            )
        else:
            with torch.no_grad():
                teacher_out = self.teacher(input_ids=input_ids, output_hidden_states=states)
            outputs = model(input_ids=input_ids, output_hidden_states=states)
            loss = distillation_loss(
                outputs.logits, teacher_out.logits, input_ids, weight=self.weight, temperature=self.temperature
            )
        total = loss.total
        if states:
            total = total + self.hidden * hidden_state_loss(outputs.hidden_states, teacher_out.hidden_states)
        if model.training:
            self._ce_sum += float(loss.ce)
            self._ce_count += 1
        return (total, outputs) if return_outputs else total

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._ce_count:
            logs["ce"] = self._ce_sum / self._ce_count
            self._ce_sum, self._ce_count = 0.0, 0
        super().log(logs, start_time)

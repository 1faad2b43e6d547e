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
# Under autocast, the loss's gradients with respect to the logits, in the autocast's dtype, of at most this
# many bytes of positions, go into the output layer's weight gradient as one product: one (V × n)·(n × H)
# product of SmolLM2's 2,044 positions took 149 ms in bf16, against 540 ms for the fp32 product of each
# 170-position chunk added in turn (a product over 170 positions keeps the bf16 units idle).
GROUP_BYTES = 256 << 20


def chunk_rows(vocab: int) -> int:
    """Positions per chunk for a vocabulary of `vocab` logits."""
    return max(1, CHUNK_BYTES // (4 * vocab))


def group_rows(vocab: int, rows: int, width: int) -> int:
    """Positions per product into the weight gradient (`GROUP_BYTES` at `width` bytes a logit), a whole number
    of chunks of `rows`."""
    return max(1, GROUP_BYTES // (width * vocab * rows)) * rows


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
        return self.to(torch.float32)

    def to(self, dtype: torch.dtype) -> OutputHead:
        """The layer whose product runs in `dtype` (its weight in it); the bias stays fp32, added to fp32 logits."""
        return OutputHead(self.weight.to(dtype), self.bias.float() if self.bias is not None else None)

    def logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None, low: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden (n, H) → fp32 logits (n, V): the product in the weight's dtype, the bias added in fp32; into
        `out` (n, V) fp32 when given, through `low` (n, V) in the weight's dtype when it is not fp32."""
        if self.weight.dtype == torch.float32:
            logits = torch.mm(hidden.float(), self.weight.T, out=out)
        else:
            product = torch.mm(hidden.to(self.weight.dtype), self.weight.T, out=low)
            logits = out.copy_(product) if out is not None else product.float()
        return logits.add_(self.bias.float()) if self.bias is not None else logits


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


@dataclass(frozen=True)
class _Workspace:
    """The (r, V) buffers `_HeadLoss` works a chunk in, made once a call and reused chunk after chunk: a fresh
    tensor of a chunk's 33 MB is mapped anew by the C allocator and faults its pages in again (measured inside
    a training run, SmolLM2 at 4 × 512, a step's 13 chunks: exp 229 ms on fresh tensors, 31 ms in these
    buffers; log-softmax 215 and 138 ms). s, t: the student's and the teacher's
    logits (t then the teacher's probabilities); log_q, log_p: their log-softmaxes (log_q then the gradient,
    log_p the KL's terms);
    low: the products in a low dtype (None in fp32)."""

    s: torch.Tensor
    t: torch.Tensor
    log_q: torch.Tensor
    log_p: torch.Tensor
    low: torch.Tensor | None

    @classmethod
    def of(cls, like: torch.Tensor, rows: int, vocab: int, product: torch.dtype) -> _Workspace:
        def buffer(dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return like.new_empty((rows, vocab), dtype=dtype)

        return cls(buffer(), buffer(), buffer(), buffer(), buffer(product) if product != torch.float32 else None)

    def rows(self, count: int) -> _Workspace:
        """The first `count` rows of each buffer (the last chunk's)."""
        low = self.low[:count] if self.low is not None else None
        return _Workspace(self.s[:count], self.t[:count], self.log_q[:count], self.log_p[:count], low)


def _chunk_loss(
    work: _Workspace, picked: torch.Tensor, taught: _Taught, count: int, sums: torch.Tensor, *, grad: bool
) -> torch.Tensor | None:
    """work: the chunk's workspace with both models' fp32 logits in `s` and `t` (r, V); picked: (r, 1) the next
    tokens; count: the positions of the whole loss → the chunk's KL and CE sums added to `sums` (2,), and (with
    `grad`) d loss / ds (r, V) fp32, in `work.log_q`: τ · share · (q − p) / count + (1 − share) ·
    (softmax(s) − onehot) / count. The buffers' contents are spent."""
    share, tau = taught.share, taught.temperature
    # At τ ≠ 1 the cross-entropy needs log softmax(s) beside log softmax(s/τ): the one fresh (r, V) tensor.
    log_s = torch.log_softmax(work.s, dim=-1) if tau != 1.0 else None
    if tau != 1.0:
        work.s.div_(tau)
        work.t.div_(tau)
    log_q = torch.log_softmax(work.s, dim=-1, out=work.log_q)
    log_p = torch.log_softmax(work.t, dim=-1, out=work.log_p)
    p = torch.exp(log_p, out=work.t)
    # Σ p · (log p − log q) in log_p's buffer, no (r, V) temporary. Not as Σ p · log p − Σ p · log q: those
    # two sums are each about the entropy, up to 100× the KL, and their difference lost 3e-4 of it in fp32.
    sums[0] += log_p.sub_(log_q).mul_(p).sum()
    log_s = log_q if log_s is None else log_s
    sums[1] -= log_s.gather(1, picked).sum()
    if not grad:
        return None
    # softmax(s) before log_q turns into q in place (the same tensor at τ = 1), into the spent logits' buffer
    softmax = torch.exp(log_s, out=work.s) if share < 1.0 else None
    g = log_q.exp_().sub_(p).mul_(share * tau / count)
    if softmax is not None:
        g.add_(softmax.scatter_add_(1, picked, torch.full_like(softmax[:, :1], -1.0)), alpha=(1.0 - share) / count)
    return g


class _Gradients:
    """The gradients `_HeadLoss` keeps for backward, filled a chunk at a time: the states' (N, H) and the output
    layer's weight (V, H) and bias (V,), each fp32 or None when not wanted.

    With a bf16 (any low) product, as autocast runs a linear: g is rounded to it once, the states' gradient is
    g · W per chunk and the weight's gᵀ · hidden once per group of chunks (`GROUP_BYTES`); in fp32, both per
    chunk, the weight's added into an fp32 sum."""

    def __init__(self, hidden: torch.Tensor, head: OutputHead, wants: tuple[bool, ...], rows: int) -> None:
        low = head.weight.dtype if head.weight.dtype != torch.float32 else None
        self.head, self.low, self.hidden = head, low, hidden
        self.states = torch.empty_like(hidden, dtype=torch.float32) if wants[0] else None
        self.weight: torch.Tensor | None = None
        self.wants_weight = wants[1]
        self.bias = torch.zeros_like(head.bias) if wants[2] and head.bias is not None else None
        group = group_rows(head.weight.shape[0], rows, head.weight.element_size()) if low is not None else 0
        shape = (min(group, hidden.shape[0]), head.weight.shape[0])
        self.buffer = hidden.new_empty(shape, dtype=low) if low is not None and wants[1] else None
        self.hidden_low = hidden.to(low) if self.buffer is not None else None
        self.begin = 0  # the first position of the group in the buffer

    @property
    def wanted(self) -> bool:
        return self.states is not None or self.wants_weight or self.bias is not None

    def add(self, start: int, g: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        """g: d loss / d logits (r, V) fp32 of the positions from `start`; scratch: an (r, V) buffer in the low
        dtype it may be rounded into (else a new tensor)."""
        stop = start + g.shape[0]
        if self.bias is not None:
            self.bias += g.sum(0)
        if self.buffer is not None:
            low = self.buffer[start - self.begin : stop - self.begin]
            low.copy_(g)
        elif self.low is not None:
            low = scratch.copy_(g) if scratch is not None else g.to(self.low)
        else:
            low = g
        if self.states is not None:
            self.states[start:stop] = low @ self.head.weight
        if self.low is None and self.wants_weight:
            piece = self.hidden[start:stop].float()
            self.weight = torch.mm(g.T, piece) if self.weight is None else self.weight.addmm_(g.T, piece)
        if self.buffer is not None and (stop - self.begin == self.buffer.shape[0] or stop == self.hidden.shape[0]):
            self._flush(stop)

    def _flush(self, stop: int) -> None:
        """The weight gradient of the buffered positions [begin, stop), one product in the low dtype."""
        assert self.buffer is not None and self.hidden_low is not None
        part = self.buffer[: stop - self.begin].T @ self.hidden_low[self.begin : stop]  # (V, H)
        self.weight = part.float() if self.weight is None else self.weight.add_(part)
        self.begin = stop


class _HeadLoss(torch.autograd.Function):
    """`distillation_loss` from the last hidden states, a chunk of positions at a time (`chunk_rows`).

    The gradient is the closed form of the loss's, taken in the same pass: with q = softmax(s/τ) and
    p = softmax(t/τ), d(τ² · KL)/ds = τ · (q − p) and dCE/ds = softmax(s) − onehot(target), each over the
    N positions; then dL/dhidden = g · W and dL/dW = gᵀ · hidden (`_Gradients`). Only those (and the bias's)
    are kept for backward, never a (N, V) tensor.

    The output layers' products run as the models' forwards run them: under autocast in its dtype (bf16: 4×
    fp32's speed on a CPU with bf16 units; the whole-logits loss and every other linear of the step take the
    same rounding), else in fp32; the logits, softmaxes and sums are always fp32 (a bf16 log-softmax over
    49k-128k entries loses the small probabilities the KL term weighs).
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
        device = hidden.device.type
        product = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.float32
        student, teacher = OutputHead(weight, bias).to(product), taught.head.to(product)
        rows = chunk_rows(student.weight.shape[0])
        grads = _Gradients(hidden, student, ctx.needs_input_grad, rows)
        sums = hidden.new_zeros(2, dtype=torch.float32)  # Σ KL, Σ CE over the positions
        whole = _Workspace.of(hidden, min(rows, count), student.weight.shape[0], product)
        with torch.autocast(device_type=device, enabled=False):
            for start in range(0, count, rows):
                stop = min(start + rows, count)
                work = whole.rows(stop - start)
                student.logits(hidden[start:stop], out=work.s, low=work.low)  # (r, V)
                teacher.logits(taught.states[start:stop], out=work.t, low=work.low)
                g = _chunk_loss(work, targets[start:stop, None], taught, count, sums, grad=grads.wanted)
                if g is not None:
                    grads.add(start, g, work.low)
        kl = sums[0] * taught.temperature**2 / count
        ce = sums[1] / count
        share = taught.share
        total = share * kl + (1.0 - share) * ce if share < 1.0 else kl.clone()
        ctx.save_for_backward(grads.states, grads.weight, grads.bias)
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
            mine = head.float().logits(taken[0].reshape(-1, taken[0].shape[-1])).reshape(logits.shape)
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
            # Under the training's autocast, which accelerate puts around the model's forward alone: without it
            # the output layers' products ran in fp32 under --dtype bf16 (4.6 of a 10.2 s step, SmolLM2 4 × 512).
            with self.accelerator.autocast():
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

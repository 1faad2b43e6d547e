"""Perplexity over non-overlapping windows (paper Section 5.2: HF methodology with full stride).

This is the SparseGPT/Wanda computation: the stream is cut into ``W = T // seqlen`` windows (the
tail is dropped), each window's mean next-token NLL over its ``seqlen - 1`` predictions is computed,
and ``ppl = exp(mean over windows)``. All windows are equally long, so this equals
``exp(nll_sum / tokens)`` with ``tokens = W * (seqlen - 1)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tsenor_cli.errors import UsageError


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll_sum: float  # summed next-token NLL (nats) over all predicted tokens
    tokens: int  # predicted tokens: windows * (seqlen - 1)
    windows: int
    seqlen: int


@dataclass(frozen=True)
class Windows:
    """How a token stream is cut for perplexity: non-overlapping windows of `seqlen` tokens, the first
    `max_windows` of them (None: all), `batch_size` windows per forward pass (`cut_windows` checks them)."""

    seqlen: int
    max_windows: int | None = None
    batch_size: int = 1


def window_nll(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """windows: (B, S) long → summed next-token NLL per window (B,) float64, computed in fp32.

    The logits are converted to fp32 one window at a time, so a bf16 model with a large vocabulary
    never holds more than one (S, V) fp32 block.
    """
    logits = model(input_ids=windows, use_cache=False).logits  # (B, S, V)
    targets = windows[:, 1:]  # (B, S-1)
    sums = [
        F.cross_entropy(logits[b, :-1].float(), targets[b], reduction="sum").double()  # (S-1, V), (S-1,) → ()
        for b in range(windows.shape[0])
    ]
    return torch.stack(sums)  # (B,)


def cut_windows(input_ids: torch.Tensor, windows: Windows) -> torch.Tensor:
    """input_ids (1, T) long → the (W, seqlen) non-overlapping windows evaluated (W = T // seqlen, at most
    max_windows); UsageError for a bad shape or setting, or a text shorter than one window."""
    seqlen, max_windows, batch_size = windows.seqlen, windows.max_windows, windows.batch_size
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise UsageError(f"input_ids must be (1, T), got shape {tuple(input_ids.shape)}")
    if seqlen < 2:
        raise UsageError(f"seqlen must be at least 2, got {seqlen}")
    if batch_size < 1:
        raise UsageError(f"batch size must be positive, got {batch_size}")
    if max_windows is not None and max_windows < 1:
        raise UsageError(f"--max-windows must be positive, got {max_windows}")
    total = int(input_ids.shape[1]) // seqlen
    if max_windows is not None:
        total = min(total, max_windows)
    if total == 0:
        raise UsageError(
            f"the text has {input_ids.shape[1]} tokens, fewer than one window of {seqlen}; use a smaller --seqlen"
        )
    return input_ids[0, : total * seqlen].view(total, seqlen)  # (T,) → (W, S)


def result_of(nll: torch.Tensor, seqlen: int) -> PerplexityResult:
    """nll: (W,) float64 summed next-token NLL per window → the perplexity over them."""
    total = int(nll.shape[0])
    tokens = total * (seqlen - 1)
    nll_sum = float(nll.sum())
    if not math.isfinite(nll_sum):
        ppl = float("inf") if nll_sum > 0 else float("nan")
    else:
        ppl = math.exp(nll_sum / tokens)
    return PerplexityResult(ppl=ppl, nll_sum=nll_sum, tokens=tokens, windows=total, seqlen=seqlen)


def perplexity(
    model: nn.Module,
    input_ids: torch.Tensor,
    windows: Windows,
    *,
    device: str | torch.device,
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Perplexity of `model` on input_ids (1, T) long over the non-overlapping `windows` of the text.

    progress(done_windows, total_windows) after each batch of `windows.batch_size`.
    """
    cut = cut_windows(input_ids, windows)
    total, batch_size = int(cut.shape[0]), windows.batch_size
    nll = torch.zeros(total, dtype=torch.float64)
    model.eval()
    with torch.inference_mode():
        for start in range(0, total, batch_size):
            batch = cut[start : start + batch_size].to(device)  # (b, S)
            nll[start : start + batch.shape[0]] = window_nll(model, batch).cpu()
            if progress is not None:
                progress(start + batch.shape[0], total)
    return result_of(nll, windows.seqlen)

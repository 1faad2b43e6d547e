"""Refuse NaN/Inf weights: one error naming the tensor and its first bad index, never a silent number.

A NaN in a weight turns every solver score, reconstruction error and verification count around it into
NaN or into a comparison that quietly reads False; checking once, up front, keeps that out of the run.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tsenor_cli.errors import BadInputError

# The check reads a tensor in slices of about this many entries along its first dimension. torch.isfinite
# builds |x| and two bool tensors the size of its input: twice the input's bytes in bf16. On a 70B model's
# token embedding and output head (2.1 GB each in bf16) the whole-tensor check made 4.2 GB of temporaries
# beside the 4.2 GB of weights and put the load phase's host peak over the dry run's estimate: at that
# shape on the CPU a streamed load grew by 8.85-9.05 GiB with it, 3.97 GiB with slices of 4 Mi entries
# (scripts/load_peak.py; the H200's 70B step grew by 8.93). Sliced, it was faster too (11.8-14.0 s
# against 20.3-21.5 s).
FINITE_SLICE = 1 << 22


def all_finite(tensor: torch.Tensor) -> bool:
    """tensor: any shape → whether every entry is finite, with temporaries of one slice (`FINITE_SLICE`)."""
    if tensor.dim() == 0:
        return bool(torch.isfinite(tensor))
    row = tensor.numel() // max(1, tensor.shape[0])  # entries under one index of the first dimension
    rows = max(1, FINITE_SLICE // max(1, row))
    # Each slice's verdict is read before the next slice: keeping the verdicts to read them once (one
    # wait for a GPU instead of one a slice) left 0.6-0.8 GiB more resident at the 70B shape on the CPU
    # (4.59-4.77 against 3.99 GiB, scripts/load_peak.py): small tensors kept between the freed slices.
    return all(bool(torch.isfinite(part).all()) for part in tensor.split(rows))


def first_non_finite(tensor: torch.Tensor) -> tuple[tuple[int, ...], float, int] | None:
    """tensor: any shape → None when every entry is finite, else (index of the first NaN/Inf in row-major
    order, its value, how many entries are non-finite). Only a failing tensor pays for the search."""
    if all_finite(tensor):
        return None
    bad = ~torch.isfinite(tensor)
    flat = int(bad.reshape(-1).nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tensor.shape))
    return index, float(tensor.reshape(-1)[flat]), int(bad.sum())


def check_finite(named: Iterable[tuple[str, torch.Tensor]], *, where: str, fix: str) -> None:
    """Raise BadInputError for the first tensor of `named` holding NaN/Inf: its name, first bad index, count.

    where: what the tensors belong to (e.g. "model /path"); fix: what the user should do.
    """
    for name, tensor in named:
        found = first_non_finite(tensor.detach())
        if found is not None:
            index, value, count = found
            raise BadInputError(
                f"{name} in {where} holds {value} at [{', '.join(map(str, index))}] "
                f"({count} non-finite value(s)); {fix}"
            )

"""Refuse NaN/Inf weights: one error naming the tensor and its first bad index, never a silent number.

A NaN in a weight turns every solver score, reconstruction error and verification count around it into
NaN or into a comparison that quietly reads False; checking once, up front, keeps that out of the run.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tsenor_cli.errors import BadInputError


def first_non_finite(tensor: torch.Tensor) -> tuple[tuple[int, ...], float, int] | None:
    """tensor: any shape → None when every entry is finite, else (index of the first NaN/Inf in row-major
    order, its value, how many entries are non-finite). Only a failing tensor pays for the search."""
    if bool(torch.isfinite(tensor).all()):
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

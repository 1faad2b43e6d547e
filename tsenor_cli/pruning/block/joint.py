"""Masks chosen with the weights inside block refinement (`--refine-mask-every K`).

`--refine block` alone trains a block's kept weights with the layer-wise mask held fixed
(`fixedmask.FixedMask`). With a mask period K > 0 the mask moves with the weights, ALPS's alternation
(paper Section 4: a weight step, then the exact projection onto the pattern) one level up, on the block's
output error instead of one linear's:

- every pruned matrix keeps a dense shadow W (its kept weights as pruned, zeros where pruned);
- each step's forward runs on W ⊙ S (S the current mask) and the whole gradient at W ⊙ S, pruned
  positions included, updates W (the straight-through step of learned-mask methods): a pruned weight
  whose gradient keeps pushing it grows in the shadow until it outscores a kept one;
- every K steps S becomes the pattern's best mask for the scores (W_ij · ‖X_j‖)², the projection score
  of ALPS's S-step (`alps._project` on B = W·D, D = diag(XᵀX)^½), solved exactly by the same solver as
  the layer-wise masks (`masks.choose_mask`, warm-started from the previous solve), so every mask is
  feasible: a transposable tile keeps exactly N per row and per column.

‖X_j‖² is the squared norm of input column j over the block's calibration samples as the pruned block
sees them, read by forward hooks during the error pass before training (every rank's samples added in
sample order, so the masks do not depend on the number of processes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch
from torch import nn

from tsenor_cli.errors import UsageError
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block.distributed import Team
from tsenor_cli.pruning.methods.masks import choose_mask
from tsenor_cli.pruning.settings.config import RefineConfig
from tsenor_cli.solver import SolveResult


def joint_scores(weight: torch.Tensor, column_sq: torch.Tensor) -> torch.Tensor:
    """weight: (out, in) dense shadow, column_sq: (in,) Σ over tokens of x_j² → (out, in) keep scores
    (W_ij · ‖X_j‖)², ALPS's projection score (module docstring)."""
    return weight.square() * column_sq.to(weight.dtype)


class ColumnNorms:
    """Forward hooks on a block's pruned linears that add up, per calibration sample, Σ_tokens x_j² of
    each linear's input (float64), for `JointMasks`' scores."""

    def __init__(self, block: nn.Module, names: list[str]) -> None:
        self.sums: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        self._hooks = []
        for name in names:
            module = block.get_submodule(name.removesuffix(".weight"))
            if not isinstance(module, nn.Linear) or not name.endswith(".weight"):
                raise UsageError(f"--refine-mask-every needs pruned nn.Linear weights; {name} is not one")
            self._hooks.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            x = args[0].detach().double()
            self.sums[name].append(x.reshape(-1, x.shape[-1]).square().sum(0))

        return hook

    def close(self, team: Team, first: int) -> dict[str, torch.Tensor]:
        """Remove the hooks → {name: (in,) float64} summed over every rank's samples in sample order
        (this rank's samples start at global index `first`, one forward each)."""
        for hook in self._hooks:
            hook.remove()
        mine = {str(first + j): {n: s[j].cpu() for n, s in self.sums.items()} for j in range(self._count())}
        every = team.gather_objects(mine)
        total: dict[str, torch.Tensor] = {}
        for key in sorted(every, key=int):
            for name, value in every[key].items():
                total[name] = value if name not in total else total[name] + value
        return total

    def _count(self) -> int:
        counts = {len(s) for s in self.sums.values()}
        if len(counts) != 1:
            raise RuntimeError(f"pruned linears ran a different number of times: {sorted(counts)}")
        return counts.pop()


class JointMasks:
    """The masks of a block's pruned matrices, re-solved every `every` steps from dense shadows (module
    docstring). Same calls as `FixedMask` in `refine._train` (`apply` after every step), plus `dense`
    before the optimizer's step; `resolves` and `seconds` count the re-solves and their time."""

    def __init__(
        self,
        block: nn.Module,
        masks: Mapping[str, torch.Tensor],
        column_sq: Mapping[str, torch.Tensor],
        cfg: RefineConfig,
        dense: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """masks: {name: True where pruned}; column_sq: `ColumnNorms.close`'s; cfg: the run's pattern,
        solver and period (`RefineConfig.mask_every`); dense: {name: the weight before pruning} or None."""
        pattern, solver, every = cfg.pattern, cfg.solver, cfg.mask_every
        if pattern is None or pattern.kind not in ("transposable", "nm"):
            kind = pattern.kind if pattern is not None else "none"
            raise UsageError(f"--refine-mask-every needs an N:M pattern, not {kind}")
        self.names = tuple(masks)
        self.weights = [block.get_parameter(name) for name in self.names]
        self.keep = [~m.to(w.device) for m, w in zip(masks.values(), self.weights, strict=True)]
        self.column_sq = [column_sq[name].to(w.device) for name, w in zip(self.names, self.weights, strict=True)]
        self.shadows: list[torch.Tensor] = []
        # dense: {name: the weight before pruning}, the shadows' start at pruned positions (None: zeros).
        self.start = None if dense is None else [dense[name] for name in self.names]
        self.warm: list[SolveResult | None] = [None] * len(self.names)
        self.pattern: SparsityPattern = pattern
        self.solver, self.every = solver, every
        self.steps = self.resolves = self.changed = 0
        self.seconds = 0.0
        self._dense = False

    def attach(self) -> None:
        """Start: the shadows are the weights as pruned, or with `dense` the dense weights at pruned
        positions (the gradient is left whole: no hook)."""
        self.shadows = [w.detach() for w in self.weights]
        if self.start is not None:
            pairs = zip(self.shadows, self.start, self.keep, strict=True)
            self.shadows = [torch.where(keep, s, d.to(s)) for s, d, keep in pairs]
        self._sparse()

    def detach(self) -> None:
        """End: the weights are the shadows under the last mask."""
        if self.shadows:
            self._sparse()

    def dense(self) -> None:
        """Before the optimizer's step: the parameters hold the shadows, which the step updates."""
        for w, shadow in zip(self.weights, self.shadows, strict=True):
            w.data = shadow
        self._dense = True

    def apply(self) -> None:
        """After a step: re-solve the masks when one is due, then the forward's weights W ⊙ S."""
        if self._dense:
            self._dense = False
            self.steps += 1
            if self.steps % self.every == 0:
                self._resolve()
            self._sparse()

    def _sparse(self) -> None:
        # masked_fill, not a product: exact +0.0 where pruned (a negative shadow times 0 is -0.0), as FixedMask.
        with torch.no_grad():
            for w, shadow, keep in zip(self.weights, self.shadows, self.keep, strict=True):
                w.data = shadow.masked_fill(~keep, 0.0)

    @torch.no_grad()
    def _resolve(self) -> None:
        start = time.perf_counter()
        for i, (shadow, column_sq) in enumerate(zip(self.shadows, self.column_sq, strict=True)):
            choice = choose_mask(joint_scores(shadow, column_sq), self.pattern, self.solver, init=self.warm[i])
            self.warm[i] = choice.result
            self.changed += int((choice.mask != self.keep[i]).sum()) // 2
            self.keep[i] = choice.mask
        self.resolves += 1
        self.seconds += time.perf_counter() - start

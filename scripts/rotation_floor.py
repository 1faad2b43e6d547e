"""Does rotating the residual stream lower the transposable pattern's floor? A layer-wise screening.

Usage: .venv/bin/python scripts/rotation_floor.py [--blocks 2,15,28] [--nsamples 32] [--seqlen 512] [--nm 16:32]

The transposable pattern keeps exactly N of every M rows in each input channel, so the few outlier input
channels of q/k (2% of the channels hold 65-74% of ALPS's score, `scripts/pattern_cost.py`) lose half their
weights whatever the solver does. An orthogonal rotation Q of the residual stream (QuaRot, SliceGPT: each
RMSNorm's weight folded into the linears that read it, which makes the model invariant to Q) spreads those
channels over all of them. This measures what that does to the mask's floor, before any model is rewritten.

For each linear of the chosen blocks of the dense model (64 × 512 C4 calibration windows of
docs/results.md, or fewer): its input Gram G = XᵀX, a mask of each kind (ordinary and transposable N:M) from
the score W_ij²·G_jj (ALPS's projection score; the exact solver), and the layer's relative error
tr(ΔW G ΔWᵀ) / tr(W G Wᵀ) twice: with the kept weights as they are, and with each row's kept weights refitted
by least squares on its mask (1% dampening in the solve; the best any weight update can do on that mask).
Rotated, a linear that reads the residual stream through a norm with weight γ becomes W·diag(γ)·Q with
Gram Qᵀ·diag(1/γ)·G·diag(1/γ)·Q (the same product W·Xᵀ); a linear that writes to it, Qᵀ·W with G unchanged.
Readers are found by observation: the linears whose input is the output of a module with a weight vector
of their input size (a norm); writers, the other linears whose output has the hidden size. Q is a seeded
random orthogonal matrix (QR of a Gaussian one).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from tsenor_cli.pruning import InputStats, SparsityPattern
from tsenor_cli.pruning.methods.masks import choose_mask
from tsenor_cli.pruning.run.api import dense_calibration_inputs
from tsenor_cli.replay import run_block
from tsenor_cli.settings import RunContext

DAMP = 0.01
ROWS_PER_SOLVE = 128  # rows refitted at once: (rows, k, k) float64 systems, 0.6 GB at k = 768 (down_proj)


def relative_error(weight: torch.Tensor, gram: torch.Tensor, change: torch.Tensor) -> float:
    """weight, change: (out, in); gram: (in, in) → tr(ΔW G ΔWᵀ) / tr(W G Wᵀ)."""
    total = torch.einsum("ri,ij,rj->", weight, gram, weight)
    return float(torch.einsum("ri,ij,rj->", change, gram, change) / total)


def refit(weight: torch.Tensor, gram: torch.Tensor, kept: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """weight: (out, in) float64; gram: (in, in); kept: (out, in) bool, the same count in every row → the
    weight whose row r minimizes (w_r − v) G (w_r − v)ᵀ over v supported on kept[r] (G dampened by
    damp·mean(diag) for the solve): v_S = w G[:, S] G[S, S]⁻¹."""
    damped = gram + damp * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    count = int(kept[0].sum())
    out = torch.zeros_like(weight)
    for lo in range(0, weight.shape[0], ROWS_PER_SOLVE):
        rows, mask = weight[lo : lo + ROWS_PER_SOLVE], kept[lo : lo + ROWS_PER_SOLVE]
        index = mask.nonzero()[:, 1].view(rows.shape[0], count)  # (r, k): each row's kept inputs, ascending
        system = damped[index[:, :, None], index[:, None, :]]  # (r, k, k)
        rhs = (rows @ damped).gather(1, index)  # (r, k): w G[:, S]
        factor = torch.linalg.cholesky(system)
        out[lo : lo + ROWS_PER_SOLVE] = torch.zeros_like(rows).scatter_(
            1, index, torch.cholesky_solve(rhs.unsqueeze(-1), factor).squeeze(-1)
        )
    return out


def floor(weight: torch.Tensor, gram: torch.Tensor, pattern: SparsityPattern) -> tuple[float, float]:
    """(error with the kept weights as they are, error with them refitted) of the best mask of `pattern`
    for the score W_ij²·G_jj."""
    scores = (weight.square() * gram.diagonal()[None, :]).float()
    kept = choose_mask(scores, pattern, "auto").mask
    plain = relative_error(weight, gram, weight * ~kept)
    return plain, relative_error(weight, gram, weight - refit(weight, gram, kept))


def roles(
    layer: Any, linears: dict[str, torch.nn.Linear], hidden_size: int, call: Any, probe: torch.Tensor
) -> dict[str, tuple[str, torch.Tensor | None]]:
    """{linear name: ("reader", norm weight) | ("writer", None)} of one block, by observation: one forward of
    `probe` records each module's output; a linear fed by a module with a weight vector of its input size
    reads the residual stream through that norm."""
    outputs: dict[int, tuple[torch.nn.Module, Any]] = {}  # the output kept alive, so that no id is reused
    inputs: dict[str, int] = {}

    def produced(module: torch.nn.Module, _args: Any, output: Any) -> None:
        outputs.setdefault(id(output), (module, output))

    def consumed(name: str) -> Any:
        def hook(_module: torch.nn.Module, args: Any, _output: Any) -> None:
            inputs.setdefault(name, id(args[0]))

        return hook

    handles = [m.register_forward_hook(produced) for m in layer.modules() if not isinstance(m, torch.nn.Linear)]
    handles += [linear.register_forward_hook(consumed(name)) for name, linear in linears.items()]
    try:
        run_block(layer, probe, call, torch.empty_like(probe))
    finally:
        for handle in handles:
            handle.remove()
    found: dict[str, tuple[str, torch.Tensor | None]] = {}
    for name, linear in linears.items():
        source = outputs.get(inputs[name], (None, None))[0]
        gamma = getattr(source, "weight", None)
        if isinstance(gamma, torch.Tensor) and gamma.dim() == 1 and gamma.numel() == linear.in_features:
            found[name] = ("reader", gamma.detach())
        elif linear.out_features == hidden_size:
            found[name] = ("writer", None)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default="2,15,28")
    parser.add_argument("--nsamples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--nm", default="16:32")
    args = parser.parse_args()
    blocks = sorted(int(b) for b in args.blocks.split(","))
    base = SparsityPattern.parse(args.nm)
    patterns = [SparsityPattern.from_nm(base.n, base.m, transposable=t) for t in (False, True)]
    loaded, inputs = dense_calibration_inputs(
        "smollm2-135m", RunContext.from_environment(), nsamples=args.nsamples, seqlen=args.seqlen
    )
    structure = loaded.structure
    hidden = inputs.hidden  # (S, T, H)
    buffer = torch.empty_like(hidden)
    size = hidden.shape[-1]
    gen = torch.Generator().manual_seed(0)
    rotation = torch.linalg.qr(torch.randn(size, size, generator=gen, dtype=torch.float64))[0]
    print(
        f"Relative layer error of the best {args.nm} mask (score W²·G_jj), kept weights as they are / refitted; "
        f"{args.nsamples}×{args.seqlen} C4 windows\n"
    )
    print("| block | linear | role | O | T | O refit | T refit | rotated O | T | O refit | T refit |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for index, layer in enumerate(structure.blocks):
        if index > blocks[-1]:
            break
        linears = structure.block_linears(index)
        chosen = index in blocks
        stats = {name: InputStats(lin.in_features, gram=True, device="cpu") for name, lin in linears.items()}
        found = roles(layer, linears, size, inputs.calls[index], hidden[:1]) if chosen else {}
        handles = [
            lin.register_forward_hook(lambda _m, a, _o, s=stats[name]: s.add(a[0]))
            for name, lin in linears.items()
            if chosen
        ]
        try:
            run_block(layer, hidden, inputs.calls[index], buffer)
        finally:
            for handle in handles:
                handle.remove()
        hidden, buffer = buffer, hidden
        for name, (role, gamma) in found.items():
            weight = linears[name].weight.detach().double()
            gram = stats[name].gram
            assert gram is not None  # requested above
            gram = gram.double()
            if gamma is not None:
                g = gamma.double()
                turned, turned_gram = (weight * g) @ rotation, rotation.T @ (gram / g[:, None] / g[None, :]) @ rotation
            else:
                turned, turned_gram = rotation.T @ weight, gram
            cells = []
            for w, g2 in ((weight, gram), (turned, turned_gram)):
                (o, o_fit), (t, t_fit) = (floor(w, g2, pattern) for pattern in patterns)
                cells += [o, t, o_fit, t_fit]
            print(f"| {index} | {name} | {role} | " + " | ".join(f"{c:.4f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()

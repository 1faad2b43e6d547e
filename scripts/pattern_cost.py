"""What the transposable pattern itself costs on SmolLM2-135M, before any weight update.

Usage: .venv/bin/python scripts/pattern_cost.py [--nm 16:32] [--results docs/results] [--output FILE.md]
Runs the dense model on the calibration protocol of docs/results.md (64×512 offline C4 tokens, seed 0),
collects every decoder linear's input column norms ‖X_j‖₂, and scores each weight by (W_ij·‖X_j‖)²: ALPS's
projection score in its unit-diagonal coordinates, up to the 1% dampening (the square of Wanda's). For
each linear it finds the best ordinary N:M mask (row-wise top-N) and the best transposable mask (the
exact `tsenor` solve on CPU) and reports the share of the score each leaves out. Averaged by projection
type, next to ALPS's reconstruction-error ratio alps-NxM-t / alps-NxM-o from RESULTS/runs (when both
runs are there), this separates what the pattern costs from what the ADMM and the weight update do with it.

The transposable pattern caps every input channel at N of every M rows; a channel whose inputs are
large for every output row (an outlier channel) loses half of its weights whatever the solver does.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from tsenor_cli import atomic
from tsenor_cli.pruning import InputStats, SparsityPattern
from tsenor_cli.pruning.methods.masks import choose_mask
from tsenor_cli.pruning.run.api import dense_calibration_inputs
from tsenor_cli.replay import run_block
from tsenor_cli.settings import RunContext

# Outlier channels: the share of the score held by this fraction of a layer's input channels.
TOP_CHANNELS = 0.02
TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def left_out(scores: torch.Tensor, n: int, m: int, *, transposable: bool) -> float:
    """scores: (out, in) ≥ 0 → share of Σ scores outside the best mask of the pattern."""
    mask = choose_mask(scores, SparsityPattern.from_nm(n, m, transposable=transposable), "auto").mask
    total = scores.sum(dtype=torch.float64)
    return float((total - (scores * mask).sum(dtype=torch.float64)) / total)


def top_channel_share(scores: torch.Tensor, fraction: float) -> float:
    """scores: (out, in) ≥ 0 → share of Σ scores in the `fraction` of input channels with the largest column sums."""
    per_channel = scores.sum(0, dtype=torch.float64)  # (in,)
    k = max(1, round(fraction * per_channel.numel()))
    return float(per_channel.topk(k).values.sum() / per_channel.sum())


def column_norms(nsamples: int, seqlen: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights (out, in), input column norms (in,)) of every decoder linear of the dense model, by name."""
    loaded, inputs = dense_calibration_inputs(
        "smollm2-135m", RunContext.from_environment(), nsamples=nsamples, seqlen=seqlen
    )
    structure = loaded.structure
    cpu = torch.device("cpu")
    hidden = inputs.hidden  # (S, T, H)
    buffer = torch.empty_like(hidden)
    weights: dict[str, torch.Tensor] = {}
    norms: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(structure.blocks):
        linears = structure.block_linears(index)
        stats = {name: InputStats(lin.in_features, gram=False, device=cpu) for name, lin in linears.items()}
        handles = [
            lin.register_forward_hook(lambda _m, args, _o, s=stats[name]: s.add(args[0]))
            for name, lin in linears.items()
        ]
        try:
            run_block(layer, hidden, inputs.calls[index], buffer)
        finally:
            for handle in handles:
                handle.remove()
        hidden, buffer = buffer, hidden
        for name, lin in linears.items():
            key = f"{index}.{name.split('.')[-1]}"
            weights[key] = lin.weight.data.clone()
            norms[key] = stats[name].col_norms
        print(f"block {index + 1}/{len(structure)}", flush=True)
    return weights, norms


def alps_error_ratios(results: Path, nm: str) -> dict[str, float] | None:
    """Mean over blocks of the per-layer error ratio alps-NxM-t / alps-NxM-o by projection type, or None."""
    tag = nm.replace(":", "x")
    paths = [results / "runs" / f"alps-{tag}-{k}" / "tsenor_report.json" for k in ("t", "o")]
    if not all(p.exists() for p in paths):
        return None
    t, o = ({rec["name"]: rec["recon_error"] for rec in json.loads(p.read_text())["layers"]} for p in paths)
    out = {}
    for kind in TYPES:
        ratios = [t[name] / o[name] for name in t if name.endswith(kind) and o.get(name)]
        out[kind] = statistics.mean(ratios)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nm", default="16:32")
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--results", type=Path, default=Path("docs/results"))
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    pattern = SparsityPattern.parse(args.nm)
    n, m = pattern.n, pattern.m
    weights, norms = column_norms(args.nsamples, args.seqlen)
    by_type: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in TYPES}
    for key, weight in weights.items():
        scores = (weight * norms[key][None, :]).square()  # (out, in)
        row = (
            left_out(scores, n, m, transposable=False),
            left_out(scores, n, m, transposable=True),
            top_channel_share(scores, TOP_CHANNELS),
        )
        by_type[key.split(".")[-1]].append(row)
    alps = alps_error_ratios(args.results, args.nm)
    lines = [
        f"Share of the score (W_ij·‖X_j‖)² left out by the best {args.nm} mask, mean over the 30 blocks "
        f"(dense SmolLM2-135M, {args.nsamples}×{args.seqlen} C4 calibration tokens):",
        "",
        "| projection | ordinary | transposable | T / O | median layer T / O "
        f"| top {TOP_CHANNELS:.0%} input channels' share | ALPS error T / O |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, rows in by_type.items():
        o_loss = statistics.mean(r[0] for r in rows)
        t_loss = statistics.mean(r[1] for r in rows)
        median = statistics.median(r[1] / r[0] for r in rows)
        share = statistics.mean(r[2] for r in rows)
        alps_cell = "—" if alps is None else f"{alps[kind]:.2f}×"
        lines.append(
            f"| {kind} | {o_loss:.4f} | {t_loss:.4f} | {t_loss / o_loss:.2f}× | {median:.2f}× "
            f"| {share:.0%} | {alps_cell} |"
        )
    lines += [
        "",
        "T / O is the ratio of the two means; the ALPS column is the mean over blocks of the per-layer",
        f"reconstruction-error ratio alps-{args.nm.replace(':', 'x')}-t / -o ({args.results}/runs).",
    ]
    text = "\n".join(lines) + "\n"
    if args.output is not None:
        atomic.write_text(args.output, text)
    print(text, end="")


if __name__ == "__main__":
    main()

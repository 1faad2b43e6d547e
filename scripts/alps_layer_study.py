"""ALPS on one real SmolLM2 layer: how the intermediate projections' solver budget trades time for error.

Usage: .venv/bin/python scripts/alps_layer_study.py [--block 5] [--linear mlp.gate_proj] [--threads 1]
Runs the dense model on 64×512 offline C4 calibration tokens up to `--block`, collects the layer's Gram
matrix, then prunes it with ALPS at transposable 16:32 and at ordinary 16:32, printing a Markdown table
(docs/design/solver.md quotes it). On CPU the default solver (`auto`) is the exact `flow`, so every ADMM
projection is exact; the cheaper inner projections of `tsenor` (`alps_inner_sweeps`,
`alps_inner_iterations`) apply where it runs (`auto` on CUDA, where `scripts/bench_cuda.py layers` times them).
"""

from __future__ import annotations

import argparse
import time

import torch

from tsenor_cli.pruning import PRUNERS, InputStats, MatrixPruneConfig, SparsityPattern, reconstruction_error
from tsenor_cli.pruning.run.api import dense_calibration_inputs
from tsenor_cli.replay import run_block
from tsenor_cli.settings import RunContext


def layer_problem(block: int, linear: str, nsamples: int, seqlen: int) -> tuple[torch.Tensor, InputStats]:
    """(weight (out, in), input statistics with the Gram matrix) of one linear of the dense model."""
    loaded, inputs = dense_calibration_inputs(
        "smollm2-135m", RunContext.from_environment(), nsamples=nsamples, seqlen=seqlen
    )
    structure = loaded.structure
    cpu = torch.device("cpu")
    hidden = inputs.hidden  # (S, T, H)
    buffer = torch.empty_like(hidden)
    layers = structure.blocks
    for index in range(block):
        run_block(layers[index], hidden, inputs.calls[index], buffer)
        hidden, buffer = buffer, hidden
    target = structure.block_linears(block)[linear]
    stats = InputStats(target.in_features, gram=True, device=cpu)
    handle = target.register_forward_hook(lambda _m, args, _o: stats.add(args[0]))
    try:
        run_block(layers[block], hidden, inputs.calls[block], None)
    finally:
        handle.remove()
    return target.weight.data.clone(), stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--linear", default="mlp.gate_proj")
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    weight, stats = layer_problem(args.block, args.linear, args.nsamples, args.seqlen)
    torch.set_num_threads(args.threads)
    gram = stats.require_gram()
    alps = PRUNERS["alps"].prune
    print(f"block {args.block} {args.linear} {tuple(weight.shape)}, {args.threads} thread(s)\n")
    print("| pattern | projections | ADMM iterations | rel. error | seconds |")
    print("|---|---|---:|---:|---:|")
    runs = (("transposable", True, "exact (flow)"), ("ordinary", False, "row top-n"))
    for label, transposable, projections in runs:
        cfg = MatrixPruneConfig(SparsityPattern.from_nm(16, 32, transposable=transposable))
        start = time.perf_counter()
        out = alps(weight, stats, cfg)
        secs = time.perf_counter() - start
        err = reconstruction_error(weight, out.weight, gram)
        print(f"| {label} 16:32 | {projections} | {out.iterations} | {err:.5f} | {secs:.1f} |")


if __name__ == "__main__":
    main()

"""`--loss-aware λ` screened on real SmolLM2 blocks: one block pruned at a time (the others dense), the
model's held-out next-token loss and the block's held-out output error for each λ.

Usage: .venv/bin/python scripts/loss_aware_block_study.py [--blocks 2 15 28] [--nsamples 32] [--heldout 16]
    [--seqlen 256] [--lambdas 0 1 4 16] [--method alps] [--nm 16:32]
The dense model runs on offline C4 windows (the first `--nsamples` calibrate, the next `--heldout` are held
out). The loss curvature at every linear's outputs comes from the library's pre-pass on the calibration
windows (`pruning/block/curvature.loss_curvature`, what a `--loss-aware` run computes). For each block and
λ the block is pruned by the run's own block pruner (`engine.BlockPruner`, sequential groups, transposable
N:M, the row weights of `--loss-aware λ`; λ = 0 is today's objective) on its dense calibration inputs; then
the whole model's mean next-token cross-entropy on the held-out windows (that block pruned, every other
dense) and the block's relative output error on them. A block-level screen of λ, not whole-model quality.
"""

from __future__ import annotations

import argparse
import time

import torch

from tsenor_cli.data.calibration import calibration_batches
from tsenor_cli.models.loading import load_model
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block.curvature import CalibrationBatch, curvature_rows, loss_curvature
from tsenor_cli.pruning.block.distributed import Team
from tsenor_cli.pruning.block.engine import BlockPruner
from tsenor_cli.pruning.block.slots import linear_slots
from tsenor_cli.pruning.methods.registry import get_pruner
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.replay import BlockCall, BlockSource, capture_block_inputs, run_block
from tsenor_cli.settings import RunContext

CPU = torch.device("cpu")


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """ids: (W, T) → the mean next-token cross-entropy over every window's T − 1 predictions."""
    total = 0.0
    for row in ids:
        logits = model(input_ids=row[None], use_cache=False).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum"))
    return total / (ids.shape[0] * (ids.shape[1] - 1))


def heldout_scores(
    model: torch.nn.Module,
    block: torch.nn.Module,
    call: BlockCall,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    ids: torch.Tensor,
) -> tuple[float, float]:
    """(the block's relative output error on the held-out `inputs` against the dense `targets`, the whole
    model's held-out loss on `ids` with the block as it is)."""
    out = torch.empty_like(inputs)
    run_block(block, inputs, call, out)
    target = targets.double()
    error = float((out.double() - target).square().sum() / target.square().sum())
    return error, heldout_loss(model, ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 15, 28])
    parser.add_argument("--nsamples", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--lambdas", type=float, nargs="+", default=[0.0, 1.0, 4.0, 16.0])
    parser.add_argument("--method", default="alps")
    parser.add_argument("--nm", default="16:32")
    args = parser.parse_args()
    ctx = RunContext.from_environment()
    n = args.nsamples
    loaded = load_model("smollm2-135m", ctx, dtype=torch.float32, device="cpu")
    model, structure = loaded.model, loaded.structure
    total = n + args.heldout
    ids = calibration_batches("c4", loaded.tokenizer, ctx, nsamples=total, seqlen=args.seqlen, seed=0).input_ids
    inputs = capture_block_inputs(structure, ids, CPU)
    slots = linear_slots(structure)
    start = time.perf_counter()
    source = BlockSource(structure, CPU, offloaded=False)
    curvature = loss_curvature(
        model, source, CalibrationBatch(inputs.calls, inputs.hidden[:n], ids[:n]), slots, Team.solo(CPU)
    )
    print(f"curvature pre-pass over {n} x {args.seqlen}: {time.perf_counter() - start:.1f}s", flush=True)
    dense_loss = heldout_loss(model, ids[n:])
    print(f"dense held-out loss {dense_loss:.5f}", flush=True)
    n_, m_ = (int(x) for x in args.nm.split(":"))
    layer = MatrixPruneConfig(SparsityPattern.from_nm(n_, m_, transposable=True), solver="flow")
    print("| block | λ | held-out loss (Δ vs dense) | held-out block output error | s |")
    print("|---:|---:|---|---:|---:|")
    hidden, buffer = inputs.hidden, torch.empty_like(inputs.hidden)
    for index in range(max(args.blocks) + 1):
        block, call = structure.blocks[index], inputs.calls[index]
        run_block(block, hidden, call, buffer)  # buffer: the dense block's outputs
        if index in args.blocks:
            dense = {k: v.clone() for k, v in block.state_dict().items()}
            for weight in args.lambdas:
                rows = curvature_rows(curvature, weight) if weight else {}
                pruner = BlockPruner(
                    structure, slots, get_pruner(args.method), layer, CPU, lambda _line: None, row_weights=rows
                )
                began = time.perf_counter()
                pruner.prune(block, index, hidden[:n], call)
                seconds = time.perf_counter() - began
                error, loss = heldout_scores(model, block, call, hidden[n:], buffer[n:], ids[n:])
                print(
                    f"| {index} | {weight:g} | {loss:.5f} ({loss - dense_loss:+.5f}) | {error:.4e} | {seconds:.0f} |",
                    flush=True,
                )
                block.load_state_dict(dense)
        hidden, buffer = buffer, hidden


if __name__ == "__main__":
    main()

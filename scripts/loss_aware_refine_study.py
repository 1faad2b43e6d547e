"""Block refinement towards a loss-aware objective, screened on real SmolLM2 blocks: one block pruned and
refined at a time (the others dense), the model's held-out next-token loss for each weight λ.

Usage: .venv/bin/python scripts/loss_aware_refine_study.py --cache DIR [--blocks 2 15] [--nsamples 32]
    [--heldout 16] [--seqlen 256] [--curvature-samples 8] [--lambdas 0 1 4 16] [--epochs 4] [--metric full]
    [--skip 0]
The dense model runs on offline C4 windows (the first `--nsamples` calibrate, the `--heldout` after the next
`--skip` are held out, so runs with different `--nsamples` can share them). The loss's curvature at each
studied block's output, g_h = Σ_t δ_th² (δ the gradient of the dense model's next-token loss at the block
output's feature h), comes from the dense model's own forward and backward over the first
`--curvature-samples` calibration windows (a hook on the block's output; what the run's curvature pass does
for the linears' outputs). Each block starts from the same ALPS transposable 16:32 prune every time (the
block's seven linears, each on its own dense calibration inputs, as `scripts/joint_block_study.py` prunes
them; cached in `--cache`) and `refine.refine_block` trains it towards the dense block's outputs with each
feature h's squared error weighted 1 + λ·g_h/mean g (`--metric diagonal`), or the error e_t of each token
measured by e_tᵀ(I + λ·F/mean g)e_t, F = Σ_t δ_t δ_tᵀ (`--metric full`: the second-order Taylor term of the
loss with the whole outer product; λ = 0: today's refinement). The columns are the whole model's mean
next-token cross-entropy on the held-out windows with that block pruned and refined (every other block dense),
and the block's plain (unweighted) relative output error on them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from joint_block_study import _prune  # scripts/ is on the path when a script runs
from loss_aware_block_study import heldout_loss, heldout_scores

from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block.refine import RefineJob, block_masks, refine_block
from tsenor_cli.pruning.methods.loss_aware import row_weights
from tsenor_cli.pruning.run.api import dense_calibration_inputs
from tsenor_cli.pruning.settings.config import RefineConfig
from tsenor_cli.replay import run_block
from tsenor_cli.settings import RunContext

CPU = torch.device("cpu")
T1632 = SparsityPattern.from_nm(16, 32, transposable=True)


def output_curvature(model: torch.nn.Module, blocks: dict[int, torch.nn.Module], ids: torch.Tensor) -> dict[int, Any]:
    """{block index: (H, H) float32 Σ_t δ_t δ_tᵀ over the windows `ids` (W, T)}, δ the loss gradient at the
    block's output hidden states (each window's loss its mean next-token cross-entropy)."""
    sums: dict[int, torch.Tensor] = {}

    def hook_of(index: int) -> Any:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output

            def add(delta: torch.Tensor) -> None:
                flat = delta.reshape(-1, delta.shape[-1]).float()
                part = flat.T @ flat  # (H, H) Σ_t δ_t δ_tᵀ; its diagonal is Σ_t δ_th²
                sums[index] = sums[index] + part if index in sums else part

            hidden.register_hook(add)

        return hook

    handles = [block.register_forward_hook(hook_of(i)) for i, block in blocks.items()]
    try:
        for row in ids:
            logits = model(input_ids=row[None], use_cache=False).logits[0, :-1].float()
            torch.nn.functional.cross_entropy(logits, row[1:]).backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    return sums


def metric(fisher: torch.Tensor, weight: float, kind: str) -> torch.Tensor:
    """fisher: (H, H) Σ_t δ_t δ_tᵀ → the objective's weights: (H,) 1 + λ·g_h/mean g (diagonal, g its
    diagonal), or (H, H) I + λ·F/mean g (full: the second-order Taylor term of the loss in the output's
    error with the whole E[δδᵀ], on the scale of the diagonal's)."""
    g = fisher.diagonal()
    if kind == "diagonal":
        return row_weights(g.contiguous(), weight)
    return torch.eye(len(g)) + weight * fisher / g.mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 15])
    parser.add_argument("--nsamples", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--curvature-samples", type=int, default=8)
    parser.add_argument("--lambdas", type=float, nargs="+", default=[0.0, 1.0, 4.0, 16.0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--metric", choices=("diagonal", "full"), default="diagonal")
    parser.add_argument("--skip", type=int, default=0, help="windows between the calibration and the held-out ones")
    args = parser.parse_args()
    ctx = RunContext.from_environment()
    n = args.nsamples
    total = n + args.skip + args.heldout
    loaded, inputs = dense_calibration_inputs("smollm2-135m", ctx, nsamples=total, seqlen=args.seqlen)
    from tsenor_cli.data.calibration import calibration_batches

    ids = calibration_batches("c4", loaded.tokenizer, ctx, nsamples=total, seqlen=args.seqlen, seed=0)
    held = slice(n + args.skip, total)
    model, layers = loaded.model, loaded.structure.blocks
    start = time.perf_counter()
    curvature = output_curvature(model, {i: layers[i] for i in args.blocks}, ids.input_ids[: args.curvature_samples])
    print(f"curvature over {args.curvature_samples} x {args.seqlen}: {time.perf_counter() - start:.1f}s", flush=True)
    for i, full in curvature.items():
        g = full.diagonal()
        top = (g / g.mean()).topk(4)
        print(
            f"block {i}: g/mean g max {[f'{v:.1f}@{int(k)}' for v, k in zip(top.values, top.indices, strict=True)]}",
            flush=True,
        )
    dense_loss = heldout_loss(model, ids.input_ids[held])
    print(f"dense held-out loss {dense_loss:.5f}", flush=True)
    print("| block | λ | held-out loss (Δ vs dense) | held-out block output error | steps | s |")
    print("|---:|---:|---|---:|---:|---:|")
    hidden, buffer = inputs.hidden, torch.empty_like(inputs.hidden)
    for index in range(max(args.blocks) + 1):
        block, call = layers[index], inputs.calls[index]
        run_block(block, hidden, call, buffer)  # buffer: the dense block's outputs, the targets
        if index in args.blocks:
            dense = {k: v.clone() for k, v in block.state_dict().items()}
            path = args.cache / f"alps-block{index}-{n}of{total}x{args.seqlen}.pt"
            if not path.exists():
                _prune(block, call, hidden[:n], "alps")
                torch.save(block.state_dict(), path)
            pruned = torch.load(path)
            names = [f"{m}.weight" for m, mod in block.named_modules() if isinstance(mod, torch.nn.Linear)]
            block.load_state_dict(pruned)
            loss = heldout_loss(model, ids.input_ids[held])
            print(f"| {index} | pruned, not refined | {loss:.5f} ({loss - dense_loss:+.5f}) | | | |", flush=True)
            for weight in args.lambdas:
                block.load_state_dict(pruned)
                masks = block_masks(block, "", names)
                cfg = RefineConfig("block", args.epochs, 1e-3, pattern=T1632)
                features = metric(curvature[index], weight, args.metric) if weight else None
                began = time.perf_counter()
                job = RefineJob(block, index, hidden[:n], call, buffer[:n], cfg, 0, CPU, masks, weights=features)
                record = refine_block(job)
                seconds = time.perf_counter() - began
                error, loss = heldout_scores(model, block, call, hidden[held], buffer[held], ids.input_ids[held])
                print(
                    f"| {index} | {weight:g} | {loss:.5f} ({loss - dense_loss:+.5f}) | {error:.4e} | {record.steps} "
                    f"| {seconds:.0f} |",
                    flush=True,
                )
            block.load_state_dict(dense)
        hidden, buffer = buffer, hidden


if __name__ == "__main__":
    main()

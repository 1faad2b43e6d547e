"""Block refinement variants on real SmolLM2 blocks: the block output error they reach, on the calibration
samples and on held-out ones, and their seconds (the quality study's block-level screening).

Usage: .venv/bin/python scripts/joint_block_study.py [--blocks 2 15 28] [--nsamples 32] [--heldout 16]
    [--seqlen 256] [--method alps] [--cache DIR]
Runs the dense model on offline C4 windows up to each block (the first `--nsamples` windows calibrate, the
next `--heldout` are held out), prunes the block's seven linears with `--method` at transposable 16:32 on
the dense inputs (each linear on its own input statistics, not sequentially; cached in --cache), then,
from the same pruned block every time, runs `refine.refine_block` towards the dense block's outputs with
each variant of `VARIANTS` (sub-block variants: each region towards the dense block's residual stream
after it, `refine.dense_pass`) and prints a Markdown table: the relative squared error of the block output
before and after, on the calibration and the held-out samples. The dense stream stands for the pruned
one (no earlier block is pruned), so the numbers compare variants, not whole-model quality.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from argparse import Namespace
from pathlib import Path

import torch

from tsenor_cli.pruning import PRUNERS, InputStats, MatrixPruneConfig, SparsityPattern
from tsenor_cli.pruning.block.refine import RefineJob, block_masks, dense_pass, refine_block
from tsenor_cli.pruning.run.api import dense_calibration_inputs
from tsenor_cli.pruning.settings.config import RefineConfig
from tsenor_cli.replay import BlockCall, run_block
from tsenor_cli.settings import RunContext

T1632 = SparsityPattern.from_nm(16, 32, transposable=True)
# name: RefineConfig's settings (epochs, lr, mask_every, regions, samples_per_step, schedule) and whether
# the mask re-solves' shadows start from the dense weights ("dense_init"). mask_every 0 holds the mask
# fixed (today's --refine block); regions "sub-blocks" trains each region of the block in turn
# (--refine-regions sub-blocks), `epochs` epochs each.
VARIANTS: dict[str, dict[str, object]] = {
    "fixed e2 lr1e-3 (default)": {"epochs": 2},
    "fixed e4 lr1e-3": {"epochs": 4},
    "fixed e8 lr1e-3": {"epochs": 8},
    "fixed e2 lr3e-3": {"epochs": 2, "lr": 3e-3},
    "joint k4 e2 lr1e-3": {"epochs": 2, "mask_every": 4},
    "joint k1 e2 lr1e-3": {"epochs": 2, "mask_every": 1},
    "joint k4 e4 lr1e-3": {"epochs": 4, "mask_every": 4},
    "joint k8 e8 lr1e-3": {"epochs": 8, "mask_every": 8},
    "joint k4 e2 lr1e-3 dense-init": {"epochs": 2, "mask_every": 4, "dense_init": True},
    "joint k4 e2 lr3e-3": {"epochs": 2, "lr": 3e-3, "mask_every": 4},
    "sub-blocks e2 lr1e-3": {"epochs": 2, "regions": "sub-blocks"},
    "sub-blocks e4 lr1e-3": {"epochs": 4, "regions": "sub-blocks"},
    # The schedule (quality issue, item 4): steps of fewer samples, and a cosine learning rate.
    "fixed e4 lr1e-3 cosine": {"epochs": 4, "schedule": "cosine"},
    "fixed e4 lr2e-3 cosine": {"epochs": 4, "lr": 2e-3, "schedule": "cosine"},
    "fixed e4 lr1e-3 spp2": {"epochs": 4, "samples_per_step": 2},
    "fixed e4 lr1e-3 spp1": {"epochs": 4, "samples_per_step": 1},
    "fixed e4 lr1e-3 spp1 cosine": {"epochs": 4, "samples_per_step": 1, "schedule": "cosine"},
    "fixed e4 lr1e-3 spp2 cosine": {"epochs": 4, "samples_per_step": 2, "schedule": "cosine"},
    "fixed e4 lr5e-4 spp1 cosine": {"epochs": 4, "lr": 5e-4, "samples_per_step": 1, "schedule": "cosine"},
}


def _error(block: torch.nn.Module, call: BlockCall, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    out = torch.empty_like(inputs)
    run_block(block, inputs, call, out)
    return float((out.double() - targets.double()).square().sum() / targets.double().square().sum())


def _prune(block: torch.nn.Module, call: BlockCall, hidden: torch.Tensor, method: str) -> None:
    """Prune the block's seven linears in place, each on its inputs' statistics (Gram matrix)."""
    linears = {n: m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    stats = {n: InputStats(m.in_features, gram=True, device=torch.device("cpu")) for n, m in linears.items()}
    hooks = [m.register_forward_hook(lambda _m, a, _o, s=stats[n]: s.add(a[0])) for n, m in linears.items()]
    try:
        run_block(block, hidden, call, None)
    finally:
        for h in hooks:
            h.remove()
    for name, module in linears.items():
        out = PRUNERS[method].prune(module.weight.data, stats[name], MatrixPruneConfig(T1632))
        module.weight.data = out.weight.to(module.weight.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 15, 28])
    parser.add_argument("--nsamples", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--method", default="alps")
    parser.add_argument("--cache", type=Path, default=Path("joint-study-cache"))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = parser.parse_args()
    ctx = RunContext.from_environment()
    total = args.nsamples + args.heldout
    loaded, inputs = dense_calibration_inputs("smollm2-135m", ctx, nsamples=total, seqlen=args.seqlen)
    layers, hidden, buffer = loaded.structure.blocks, inputs.hidden, torch.empty_like(inputs.hidden)
    args.cache.mkdir(parents=True, exist_ok=True)
    print("| block | variant | calib error before → after | held-out before → after | steps | mask solves | s |")
    print("|---:|---|---|---|---:|---:|---:|")
    for index in range(max(args.blocks) + 1):
        block, call = layers[index], inputs.calls[index]
        run_block(block, hidden, call, buffer)  # buffer: the dense block's outputs, the targets
        if index in args.blocks:
            _study(block, index, call, hidden, buffer, args)
        hidden, buffer = buffer, hidden


def _study(
    block: torch.nn.Module, index: int, call: BlockCall, hidden: torch.Tensor, targets: torch.Tensor, args: Namespace
) -> None:
    n = args.nsamples
    dense = {k: v.clone() for k, v in block.state_dict().items()}
    path = args.cache / f"{args.method}-block{index}-{n}x{args.seqlen}.pt"
    if path.exists():
        pruned = torch.load(path)
    else:
        _prune(block, call, hidden[:n], args.method)
        pruned = {k: v.clone() for k, v in block.state_dict().items()}
        torch.save(pruned, path)
    names = [f"{m}.weight" for m, mod in block.named_modules() if isinstance(mod, torch.nn.Linear)]
    for variant in args.variants:
        settings = dict(VARIANTS[variant])
        from_dense = bool(settings.pop("dense_init", False))
        cfg = RefineConfig("block", pattern=T1632, **settings)  # type: ignore[arg-type]
        block.load_state_dict(dense)  # the regions' dense targets come from the dense block
        found, values, why = dense_pass(block, hidden[:n].clone(), call, torch.device("cpu"), cfg)
        if why is not None:
            print(f"block {index}: {why}; refined as a whole block", flush=True)
        block.load_state_dict(pruned)
        masks = block_masks(block, "", names)
        held_before = _error(block, call, hidden[n:], targets[n:])
        start = time.perf_counter()
        start_from = {k: dense[k] for k in names} if from_dense else None
        job = RefineJob(block, index, hidden[:n], call, targets[:n], cfg, 0, torch.device("cpu"), masks)
        rec = refine_block(dataclasses.replace(job, dense=start_from, regions=found, region_targets=values))
        secs = time.perf_counter() - start
        held = _error(block, call, hidden[n:], targets[n:])
        print(
            f"| {index} | {variant} | {rec.error_before:.4g} → {rec.error_after:.4g} | {held_before:.4g} → "
            f"{held:.4g} | {rec.steps} | {rec.mask_solves} ({rec.mask_seconds:.1f}s, {rec.mask_changed} moved) "
            f"| {secs:.0f} |",
            flush=True,
        )
    block.load_state_dict(dense)


if __name__ == "__main__":
    main()

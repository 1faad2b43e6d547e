"""Distributed scaling of `tsenor prune`: K processes of T/K threads against one process of T threads.

Usage (issue 19's CPU target, SmolLM2 ALPS transposable 16:32, 64 × 512, 2 × 1 thread vs 1 × 2 threads):
    .venv/bin/python scripts/distributed_scaling.py --out /tmp/scaling \\
        -- --model smollm2-135m --method alps --nm 16:32 --nsamples 64 --seqlen 512
Everything after `--` is passed to both `tsenor prune` runs (not --output, --nproc or --no-resume-state,
which the script sets). Each run is a fresh `python -m tsenor_cli prune` with OMP_NUM_THREADS and
NUMBA_NUM_THREADS set (torch's and the flow solver's thread pools), the distributed one through
`--nproc` (torchrun, gloo on the CPU). Prints, and writes to OUT/scaling.json: both wall times, the
speedup, and whether the two checkpoints have the same masks and the same weights (sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tsenor_cli.settings import child_environment


def run_prune(prune_args: list[str], output: Path, threads: int, nproc: int) -> float:
    """Wall seconds of one `tsenor prune` run into `output` (raises on a non-zero exit)."""
    command = [sys.executable, "-m", "tsenor_cli", "prune", *prune_args, "--no-resume-state", "--output", str(output)]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    env = child_environment({"OMP_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads)})
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return seconds


def compare(a: Path, b: Path) -> dict[str, Any]:
    """Whether two checkpoints have the same masks (nonzero pattern of every tensor) and the same bytes."""
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    same_masks = wa.keys() == wb.keys() and all(torch.equal(wa[k] != 0, wb[k] != 0) for k in wa)
    sha = [hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest() for p in (a, b)]
    return {"same_masks": same_masks, "same_weights": sha[0] == sha[1], "sha256": sha[0]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args_in = sys.argv[1:] if argv is None else argv
    split = args_in.index("--") if "--" in args_in else len(args_in)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the two checkpoints and scaling.json")
    parser.add_argument("--nproc", type=int, default=2, help="processes of the distributed run")
    parser.add_argument("--threads", type=int, default=2, help="threads in all: the single run's, split evenly")
    args = parser.parse_args(args_in[:split])
    prune_args = args_in[split + 1 :]
    if args.threads % args.nproc:
        raise SystemExit(f"--threads {args.threads} must be a multiple of --nproc {args.nproc}")
    args.out.mkdir(parents=True, exist_ok=True)
    single = run_prune(prune_args, args.out / "single", args.threads, 1)
    distributed = run_prune(prune_args, args.out / "distributed", args.threads // args.nproc, args.nproc)
    result = {
        "prune_args": prune_args,
        "threads": args.threads,
        "nproc": args.nproc,
        "single_seconds": round(single, 2),
        "distributed_seconds": round(distributed, 2),
        "speedup": round(single / distributed, 3),
        **compare(args.out / "single", args.out / "distributed"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    (args.out / "scaling.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"1 process × {args.threads} threads: {single:.1f} s; {args.nproc} processes × "
        f"{args.threads // args.nproc} threads: {distributed:.1f} s; speedup {single / distributed:.2f}×; "
        f"masks {'identical' if result['same_masks'] else 'DIFFER'}, "
        f"weights {'identical' if result['same_weights'] else 'differ'}"
    )
    return result


if __name__ == "__main__":
    main()

"""The host peak of a streamed prune's load phase at a LLaMA shape: the load, then the check that its weights
are finite, with that check over whole tensors and in slices (`tsenor_cli/pruning/block/finite.py`).

Usage: .venv/bin/python scripts/load_peak.py [--model llama-3.1-70b] [--scale-down 1] [--repeats 2] [--work-dir DIR]

Writes the model's one-block checkpoint with random bf16 weights once into the work folder (`tsenor bench
prune --stream`'s writer: 5.6 GB and about a minute at the 70B shape), then, alternating the two checks
(whole, sliced, whole, sliced, ...), loads it as `tsenor prune --stream` does (`models.loading.load_model`:
what lies outside the blocks resident on the CPU) and checks it, and prints the resident-set growth over the
start (VmHWM, reset at the start) after the load and after the check, and the check's seconds. Linux only.
The 70B step of `make gpu-check` measured its host peak on an H200 with the whole-tensor check: 8.93 GiB
over the start (docs/measurements/gpu.md).
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from tsenor_cli.bench.prune import shape_config, write_random_checkpoint
from tsenor_cli.models.embedded import materialize
from tsenor_cli.models.loading import LoadOptions, load_model
from tsenor_cli.models.streaming import trim_heap
from tsenor_cli.phases import host_peak, reset_host_peak
from tsenor_cli.pruning.block import finite
from tsenor_cli.settings import RunContext

GIB = 1 << 30


def measure(folder: Path, ctx: RunContext, slice_entries: int) -> tuple[float, float, float]:
    """(GiB over the start after the load, after the check, the check's seconds) with slices of `slice_entries`."""
    gc.collect()
    trim_heap()
    finite.FINITE_SLICE = slice_entries
    start = reset_host_peak()
    if start is None:
        raise SystemExit("this kernel cannot reset the peak resident set (/proc/self/clear_refs)")
    how = LoadOptions(False, progress=lambda _: None, check_tokenizer=True)
    loaded = load_model(str(folder), ctx, dtype=torch.bfloat16, device="cpu", stream=True, options=how)
    after_load = host_peak()
    began = time.perf_counter()
    finite.check_finite(
        ((name, p) for name, p in loaded.model.named_parameters() if not p.is_meta), where=str(folder), fix=""
    )
    seconds = time.perf_counter() - began
    return (after_load - start) / GIB, (host_peak() - start) / GIB, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-70b")
    parser.add_argument("--scale-down", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tsenor-load-peak"))
    args = parser.parse_args()
    ctx = RunContext.from_environment()
    folder = args.work_dir / f"{args.model}-{args.scale_down}"
    if not (folder / "config.json").is_file():
        config, _ = shape_config(args.model, 1, args.scale_down)
        tokenizer = AutoTokenizer.from_pretrained(materialize("smollm2-135m", ctx.cache_dir))
        write_random_checkpoint(folder, config, tokenizer, torch.device("cpu"), torch.bfloat16, seed=0)
    modes = {"whole": 1 << 62, "sliced": finite.FINITE_SLICE}
    print(f"{args.model} / {args.scale_down}, one block, bf16, streamed: GiB over the start")
    print("| check | after the load | after the check | check s |\n|---|---:|---:|---:|")
    for _ in range(args.repeats):
        for mode, entries in modes.items():
            load, check, seconds = measure(folder, ctx, entries)
            print(f"| {mode} | {load:.2f} | {check:.2f} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()

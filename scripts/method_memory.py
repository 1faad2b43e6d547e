"""How far one matrix's method work lifts the process's RSS, against the method's working-set formula.

Usage: .venv/bin/python scripts/method_memory.py [--method alps] [--nm 16:32] [--shape 576x1536] [--rows 8192]

Prunes one random (out, in) matrix on the Gram of `--rows` correlated random inputs (transposable N:M, the
`auto` solver), after a warm-up prune of a small matrix (the solver's kernels and torch's code paths
loaded) and a `malloc_trim` (`return_free_memory`), while a thread samples /proc/self/statm about every
half millisecond. Prints the RSS before, the highest RSS during the prune and the RSS after it, before and
after one more trim, as increases over the RSS before; and the method's working set as the plan estimates
it (`matrix_workspace`). Run it with glibc's ``MALLOC_MMAP_THRESHOLD_`` set to see the same prune with large
blocks handed straight back to the system: the increase then follows the live tensors. The difference is
what `memory.ALLOCATOR_SLACK` covers in the host estimate.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch

from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block.memory import MethodCost, matrix_workspace, return_free_memory
from tsenor_cli.pruning.methods.registry import get_pruner
from tsenor_cli.pruning.methods.stats import InputStats
from tsenor_cli.pruning.methods.types import MatrixPruneConfig

_STATM = Path("/proc/self/statm")
_PAGE = 4096


def rss() -> int:
    """This process's resident bytes, from /proc/self/statm (Linux)."""
    return int(_STATM.read_text().split()[1]) * _PAGE


def inputs(features: int, rows: int, gen: torch.Generator) -> InputStats:
    """The statistics of `rows` correlated random inputs of `features` features (a random mixing matrix)."""
    mixing = torch.randn(features, features, generator=gen) / features**0.5
    return InputStats.from_inputs(torch.randn(rows, features, generator=gen) @ mixing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="alps")
    parser.add_argument("--nm", default="16:32")
    parser.add_argument("--shape", default="576x1536", help="OUTxIN")
    parser.add_argument("--rows", type=int, default=8192)
    args = parser.parse_args()
    out, inp = (int(x) for x in args.shape.split("x"))
    base = SparsityPattern.parse(args.nm)
    pattern = SparsityPattern.from_nm(base.n, base.m, transposable=True)
    cfg = MatrixPruneConfig(pattern, solver="auto")
    spec = get_pruner(args.method)
    gen = torch.Generator().manual_seed(0)
    spec.prune_batch(torch.randn(64, 64, generator=gen) * 0.02, inputs(64, 512, gen), cfg)  # warm-up
    stats, weight = inputs(inp, args.rows, gen), torch.randn(out, inp, generator=gen) * 0.02
    highest, running = [0], [True]

    def sample() -> None:
        while running[0]:
            highest[0] = max(highest[0], rss())
            time.sleep(0.0005)

    return_free_memory()
    before = rss()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    spec.prune_batch(weight, stats, cfg)
    seconds = time.perf_counter() - start
    running[0] = False
    sampler.join()
    after = rss()
    return_free_memory()
    trimmed = rss()
    cost = MethodCost.of(spec, pattern, "auto", device=torch.device("cpu"), width=4)
    estimate = matrix_workspace(out, inp, cost)
    mb = 1e6
    print(
        f"{args.method} {args.nm} transposable {out}x{inp}: RSS before {before / mb:.1f} MB; "
        f"highest +{(highest[0] - before) / mb:.1f} MB ({(highest[0] - before) / estimate:.2f}x the working set "
        f"{estimate / mb:.1f} MB); after +{(after - before) / mb:.1f} MB, after a trim +{(trimmed - before) / mb:.1f} "
        f"MB; {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()

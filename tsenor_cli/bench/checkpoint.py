"""`tsenor bench checkpoint`: what the packed format saves, and what loading and evaluating it costs, as ratios
measured in one run.

- Matrices: one (size × size) bf16 matrix per pattern and kind, pruned to a valid mask (transposable: each
  M×M tile keeps N per row and per column) and encoded by `packed.layout.encode`; its values' and code's
  bytes over its dense bytes. The format's own size function (`MatrixPattern.stored_nbytes`) must give the
  same count (checked), and the code must decode back to the matrix bit for bit (checked).
- Shapes: the whole checkpoint of a published shape (configs/models), in its dtype, from the size function
  alone: the decoder blocks' linear weights packed (`models.structure.discover_structure`, on the meta
  device), everything else (embeddings, head, norms) dense.
- The real model: `tsenor prune` of it run twice, `--save-format dense` and `packed` (the same prune), each
  in its own process; the packed weight files' bytes over the dense ones' (the packed folder must decode to
  the dense one bit for bit: checked). Then `AutoModelForCausalLM.from_pretrained` of each folder in a fresh
  child process (`import tsenor_cli` in both), alternating, `loads` times each: the child reports the
  load's seconds and its own peak resident set (VmHWM, as `bench.memory` reads it); the medians' ratios.
  Then `tsenor eval --ppl wikitext2` of each folder: the printed perplexities must be equal.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tsenor_cli.bench.machine import environment
from tsenor_cli.errors import BadInputError, UsageError
from tsenor_cli.packed.layout import MatrixPattern, decode, encode

KINDS = ("nm", "transposable")
PPL_DATA = "wikitext2"


@dataclass(frozen=True)
class CheckpointBenchConfig:
    """model_dir/model_name: the real model; patterns: "N:M" of the matrix rows; size: their matrices' side;
    shapes: names in configs/models; nm/method/dtype: the real prune (transposable); loads: loads of each
    folder; max_windows: the evaluation's windows (None: all); seed: the matrices' and the prune's."""

    model_dir: Path
    model_name: str
    patterns: tuple[str, ...] = ("2:4", "16:32")
    size: int = 2048
    shapes: tuple[str, ...] = ("llama-3.2-1b", "llama-3.1-8b")
    nm: str = "2:4"
    method: str = "magnitude"
    dtype: str = "bf16"
    loads: int = 3
    max_windows: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for text in (*self.patterns, self.nm):
            n, m = _nm(text)
            if self.size % m:
                raise UsageError(f"--size {self.size} must be a multiple of every pattern's M ({text})")


def _nm(text: str) -> tuple[int, int]:
    try:
        n, m = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise UsageError(f"{text!r} is not an N:M pattern, e.g. 2:4") from exc
    if not 1 <= n < m:
        raise UsageError(f"{text!r} is not an N:M pattern with 1 <= N < M, e.g. 2:4")
    return n, m


def pruned_matrix(kind: str, n: int, m: int, size: int, gen: torch.Generator) -> torch.Tensor:
    """A (size, size) bf16 matrix with a random N:M mask: each tile cyclic (row i keeps columns i..i+N-1
    mod M, so each column keeps N too), its rows and columns shuffled within the tile (which keeps both
    counts); for nm the mask of each row group is drawn on its own."""
    weight = torch.randn(size, size, generator=gen).to(torch.bfloat16)
    if kind == "transposable":
        tile = (torch.arange(m).view(1, m) - torch.arange(m).view(m, 1)) % m < n
        tile = tile[torch.randperm(m, generator=gen)][:, torch.randperm(m, generator=gen)]
        mask = tile.repeat(size // m, size // m)
    else:
        scores = torch.rand(size, size // m, m, generator=gen)
        chosen = scores.topk(n, dim=-1).indices
        mask = torch.zeros(size, size // m, m, dtype=torch.bool).scatter_(-1, chosen, True).view(size, size)
    # Pruned entries are +0.0, as the prune writes them (where() keeps no -0.0 sign bit).
    return torch.where(mask, weight, torch.zeros((), dtype=weight.dtype))


def matrix_rows(cfg: CheckpointBenchConfig) -> list[dict[str, Any]]:
    """Per pattern and kind: the packed bytes of one bf16 matrix over its dense bytes (module docstring)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    for text in cfg.patterns:
        n, m = _nm(text)
        for kind in KINDS:
            weight = pruned_matrix(kind, n, m, cfg.size, gen)
            pattern = MatrixPattern.of(kind, n, m, tuple(weight.shape))
            values, code = encode(weight, pattern)
            stored = values.numel() * values.element_size() + code.numel() * code.element_size()
            if stored != pattern.stored_nbytes(weight.element_size()):
                raise BadInputError(f"{text} {kind}: the size function disagrees with the encoded bytes ({stored})")
            if not torch.equal(decode(values, code, pattern).view(torch.int16), weight.view(torch.int16)):
                raise BadInputError(f"{text} {kind}: the packed matrix does not decode to itself")
            dense = weight.numel() * weight.element_size()
            label = pattern.label
            rows.append({"pattern": label, "encoding": pattern.encoding, "packed": stored, "dense": dense})
    return rows


def shape_row(shape: str, n: int, m: int) -> dict[str, Any]:
    """The whole checkpoint of the configs/models shape `shape` at N:M (transposable), from the size
    function: its bytes packed (block linears) and dense, and the pruned matrices' own."""
    from transformers import AutoModelForCausalLM

    from tsenor_cli.bench.prune import shape_config
    from tsenor_cli.models.structure import discover_structure

    config, _ = shape_config(shape, None)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    structure = discover_structure(model)
    pruned = {
        f"{structure.blocks_name}.{index}.{linear}.weight"
        for index, names in enumerate(structure.linears)
        for linear in names
    }
    totals = {"packed": 0, "dense": 0, "matrices_packed": 0, "matrices_dense": 0}
    for name, param in model.named_parameters():
        dense = param.numel() * param.element_size()
        stored = dense
        if name in pruned:
            stored = MatrixPattern.of("transposable", n, m, tuple(param.shape)).stored_nbytes(param.element_size())
            totals["matrices_packed"] += stored
            totals["matrices_dense"] += dense
        totals["packed"] += stored
        totals["dense"] += dense
    return {"model": shape, "pattern": f"{n}:{m} transposable", "dtype": str(dtype).removeprefix("torch."), **totals}


def _weight_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("model*.safetensors"))


def _run(argv: list[str], what: str) -> str:
    """Run a child `python` command line → its stdout; BadInputError with its last error line when it fails."""
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:]
        raise BadInputError(f"{what} failed (exit {done.returncode}): {last}")
    return done.stdout


def prune_both(cfg: CheckpointBenchConfig, work: Path) -> dict[str, Path]:
    """The same `tsenor prune` of the real model written dense and packed → {format: folder}."""
    folders = {}
    for fmt in ("dense", "packed"):
        out = work / fmt
        argv = ["-m", "tsenor_cli", "-q", "prune", "--model", str(cfg.model_dir), "--nm", cfg.nm]
        argv += ["--method", cfg.method, "--dtype", cfg.dtype, "--save-format", fmt, "--output", str(out)]
        argv += ["--nsamples", "1", "--seqlen", "32", "--seed", str(cfg.seed), "--no-resume-state"]
        _run(argv, f"the {fmt} prune of {cfg.model_name}")
        folders[fmt] = out
    return folders


def check_same_tensors(dense: Path, packed: Path) -> None:
    """BadInputError unless the packed folder decodes to the dense folder's tensors bit for bit."""
    from tsenor_cli.models.checkpoint import Checkpoint

    a, b = Checkpoint.open(dense), Checkpoint.open(packed)
    if set(a.keys()) != set(b.keys()):
        raise BadInputError(f"{packed} holds other tensors than {dense}")
    for key, tensor in a.iter_read(a.keys()):
        other = b.read([key])[key]
        if other.dtype != tensor.dtype or not torch.equal(other.view(torch.uint8), tensor.view(torch.uint8)):
            raise BadInputError(f"{packed}: {key} does not decode to the dense prune's tensor")


# The load child: `python -c LOAD_CHILD FOLDER` → one JSON line: the load's seconds, the process's VmHWM after
# `from_pretrained`, and again after one forward pass of 16 tokens. A dense safetensors load maps the file and
# reads no weight (transformers takes each tensor as a view of the map, paged in when first used), so its
# first peak holds almost none of the weights, while a packed load has decoded every pruned matrix by then;
# after the forward pass both hold every weight.
LOAD_CHILD = (
    "import json, sys, time, torch; import tsenor_cli; from transformers import AutoModelForCausalLM; "
    "from tsenor_cli.bench.memory import _peak_rss; started = time.perf_counter(); "
    "model = AutoModelForCausalLM.from_pretrained(sys.argv[1]); seconds = time.perf_counter() - started; "
    "peak = _peak_rss(); torch.no_grad().__enter__(); model(torch.arange(16).view(1, 16)); "
    "print(json.dumps({'seconds': seconds, 'peak_rss': peak, 'peak_rss_forward': _peak_rss()}))"
)


def measure_loads(folders: dict[str, Path], loads: int) -> dict[str, dict[str, Any]]:
    """Each folder loaded `loads` times in fresh processes, alternating → {format: seconds and peaks, medians}."""
    runs: dict[str, list[dict[str, Any]]] = {fmt: [] for fmt in folders}
    for _ in range(loads):
        for fmt, folder in folders.items():
            out = _run(["-c", LOAD_CHILD, str(folder)], f"loading the {fmt} folder")
            runs[fmt].append(json.loads(out.strip().splitlines()[-1]))
    return {
        fmt: {
            "seconds": [r["seconds"] for r in found],
            "peak_rss": [r["peak_rss"] for r in found],
            "peak_rss_forward": [r["peak_rss_forward"] for r in found],
            "median_seconds": statistics.median(r["seconds"] for r in found),
            "median_peak_rss": statistics.median(r["peak_rss"] for r in found),
            "median_peak_rss_forward": statistics.median(r["peak_rss_forward"] for r in found),
        }
        for fmt, found in runs.items()
    }


def measure_eval(folders: dict[str, Path], max_windows: int | None) -> dict[str, dict[str, Any]]:
    """`tsenor eval --ppl wikitext2` of each folder → {format: ppl, printed (its table's digits), windows}."""
    found = {}
    for fmt, folder in folders.items():
        argv = ["-m", "tsenor_cli", "-q", "eval", str(folder), "--ppl", PPL_DATA, "--json"]
        argv += ["--max-windows", str(max_windows)] if max_windows is not None else []
        entry = json.loads(_run(argv, f"tsenor eval of the {fmt} folder"))["perplexity"][PPL_DATA]
        found[fmt] = {"ppl": entry["ppl"], "printed": f"{entry['ppl']:.3f}", "windows": entry["windows"]}
    return found


def run_checkpoint_bench(
    cfg: CheckpointBenchConfig, work_dir: Path | None = None, *, say: Any = print
) -> dict[str, Any]:
    """Every measurement of the module docstring → the result (`to_markdown` prints it)."""
    machine = environment("cpu")
    matrices = matrix_rows(cfg)
    say("matrices: " + ", ".join(f"{r['pattern']} {r['packed'] / r['dense']:.4f}" for r in matrices))
    shapes = [shape_row(shape, *_nm(text)) for shape in cfg.shapes for text in cfg.patterns]
    if work_dir is not None:
        # --work-dir may name a folder still to be made (the CLI checked that it can be).
        work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tsenor-bench-checkpoint-", dir=work_dir) as tmp:
        folders = prune_both(cfg, Path(tmp))
        check_same_tensors(folders["dense"], folders["packed"])
        real: dict[str, Any] = {"model": cfg.model_name, "pattern": f"{cfg.nm} transposable", "dtype": cfg.dtype}
        real |= {"packed": _weight_bytes(folders["packed"]), "dense": _weight_bytes(folders["dense"])}
        say(f"{cfg.model_name}: packed / dense bytes {real['packed'] / real['dense']:.4f}")
        loads = measure_loads(folders, cfg.loads)
        say(f"load: packed / dense seconds {loads['packed']['median_seconds'] / loads['dense']['median_seconds']:.2f}")
        evaluation = measure_eval(folders, cfg.max_windows)
        shutil.rmtree(folders["dense"])
        shutil.rmtree(folders["packed"])
    config = {**asdict(cfg), "model_dir": str(cfg.model_dir)}
    return {
        "config": config,
        "matrices": matrices,
        "shapes": shapes,
        "real": real,
        "loads": loads,
        "eval": evaluation,
        "machine": machine,
    }


def _ratio(row: dict[str, Any]) -> float:
    return float(row["packed"]) / float(row["dense"])


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def judged(result: dict[str, Any]) -> dict[str, bool]:
    """Each target of the issue against the measurements: matrices ≤ 0.57, load seconds ≤ 1.5×, load peak ≤
    dense (after `from_pretrained`, and after a forward pass: `LOAD_CHILD`), the printed perplexities equal."""
    loads, evaluation = result["loads"], result["eval"]
    packed, dense = loads["packed"], loads["dense"]
    return {
        "matrices": all(_ratio(row) <= 0.57 for row in result["matrices"]),
        "load_seconds": packed["median_seconds"] <= 1.5 * dense["median_seconds"],
        "load_peak": packed["median_peak_rss"] <= dense["median_peak_rss"],
        "forward_peak": packed["median_peak_rss_forward"] <= dense["median_peak_rss_forward"],
        "ppl": evaluation["packed"]["printed"] == evaluation["dense"]["printed"],
    }


def _header(result: dict[str, Any], command: str) -> list[str]:
    env = result["machine"]
    return [
        "# Packed checkpoints: bytes, load and evaluation against dense",
        "",
        f"Measured {env['date']} with `{command}` on {env['platform']} ({env['processor']}, "
        f"{env['cpu_threads']} threads); tsenor {env['tsenor']}, torch {env['torch']}, transformers "
        f"{env['transformers']}, Python {env['python']}; load average {env['load_average']:.1f} at the start "
        "(a shared machine: compare the ratios, not the seconds). What is measured and how: "
        "`tsenor_cli/bench/checkpoint.py`.",
        "",
    ]


def _bytes_sections(result: dict[str, Any], targets: dict[str, bool]) -> list[str]:
    cfg, real = result["config"], result["real"]
    return [
        f"## One pruned matrix ({cfg['size']} × {cfg['size']}, bf16, encoded)",
        "",
        "| pattern | code | packed bytes | dense bytes | packed / dense |",
        "|---|---|---:|---:|---:|",
        *(
            f"| {r['pattern']} | {r['encoding']} | {r['packed']:,} | {r['dense']:,} | {_ratio(r):.4f} |"
            for r in result["matrices"]
        ),
        "",
        f"Target ≤ 0.57 for every row: {_verdict(targets['matrices'])}. Each matrix decodes back bit for bit, "
        "and its bytes equal the format's size function (`MatrixPattern.stored_nbytes`), checked.",
        "",
        "## Whole checkpoints (embeddings, head and norms dense)",
        "",
        "| model | pattern | dtype | pruned matrices: packed / dense | checkpoint GiB: packed / dense | ratio |",
        "|---|---|---|---:|---:|---:|",
        f"| {real['model']} (real: `tsenor prune --method {cfg['method']}`, weight files) | {real['pattern']} | "
        f"{real['dtype']} | — | {real['packed'] / 2**30:.3f} / {real['dense'] / 2**30:.3f} | {_ratio(real):.4f} |",
        *(
            f"| {r['model']} (shape, size function) | {r['pattern']} | {r['dtype']} | "
            f"{r['matrices_packed'] / r['matrices_dense']:.4f} | {r['packed'] / 2**30:.3f} / "
            f"{r['dense'] / 2**30:.3f} | {_ratio(r):.4f} |"
            for r in result["shapes"]
        ),
        "",
        "The real model's packed folder decodes to its dense folder bit for bit (checked). The embeddings, head "
        "and norms stay dense: their share of a model's bytes is how far its ratio lies above its matrices'.",
        "",
    ]


def _spread(found: dict[str, Any], key: str, unit: float, digits: int) -> str:
    """A load measurement's median with the lowest and highest run, in `unit`s: "2.18 (2.01–2.40)"."""
    runs = [value / unit for value in found[key]]
    return f"{found['median_' + key] / unit:.{digits}f} ({min(runs):.{digits}f}–{max(runs):.{digits}f})"


def _load_eval_sections(result: dict[str, Any], targets: dict[str, bool]) -> list[str]:
    loads, evaluation, model = result["loads"], result["eval"], result["real"]["model"]
    seconds = loads["packed"]["median_seconds"] / loads["dense"]["median_seconds"]
    peak = loads["packed"]["median_peak_rss"] / loads["dense"]["median_peak_rss"]
    forward = loads["packed"]["median_peak_rss_forward"] / loads["dense"]["median_peak_rss_forward"]
    return [
        f"## Loading `{model}` with `AutoModelForCausalLM.from_pretrained`",
        "",
        f"Each folder loaded {result['config']['loads']} times in a fresh process (`import tsenor_cli` in both), "
        "alternating; seconds of `from_pretrained` alone; peak RSS the child's own VmHWM (imports included) after "
        "`from_pretrained`, and after one forward pass of 16 tokens; medians, and in brackets the lowest and "
        "highest of the runs (MB = 10^6 bytes).",
        "",
        "| folder | seconds | peak RSS MB after the load | after a forward pass |",
        "|---|---:|---:|---:|",
        *(
            f"| {fmt} | {_spread(found, 'seconds', 1, 2)} | {_spread(found, 'peak_rss', 1e6, 1)} | "
            f"{_spread(found, 'peak_rss_forward', 1e6, 1)} |"
            for fmt, found in loads.items()
        ),
        "",
        f"Load time packed / dense {seconds:.2f} (target ≤ 1.5: {_verdict(targets['load_seconds'])}); peak RSS "
        f"packed / dense after the load {peak:.3f} (target ≤ 1: {_verdict(targets['load_peak'])}), after a forward "
        f"pass {forward:.3f} (≤ 1: {_verdict(targets['forward_peak'])}). The dense load maps its file and reads no "
        "weight until it is used (transformers keeps each tensor as a view of the map), so its peak after "
        "`from_pretrained` holds almost none of the weights; the packed load has decoded every pruned matrix into "
        "memory of its own by then (and dropped the map's pages of their values and codes, `packed/pages.py`). "
        "After the forward pass both hold every weight: that peak is the one to compare.",
        "",
        f"## `tsenor eval --ppl {PPL_DATA}`",
        "",
        "| folder | printed ppl | windows |",
        "|---|---:|---:|",
        *(f"| {fmt} | {found['printed']} | {found['windows']} |" for fmt, found in evaluation.items()),
        "",
        f"Equal to the last printed digit: {_verdict(targets['ppl'])}.",
        "",
    ]


def to_markdown(result: dict[str, Any], command: str) -> str:
    """The measurement page: the tables, each target met or missed, the machine and the command."""
    targets = judged(result)
    return "\n".join(_header(result, command) + _bytes_sections(result, targets) + _load_eval_sections(result, targets))

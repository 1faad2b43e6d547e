"""`tsenor bench ...`: benchmarks (quality against exact, and speed ratios measured in one run)."""

from __future__ import annotations

from pathlib import Path

import typer

from tsenor_cli import atomic
from tsenor_cli.cli.app import Command, app, run_context
from tsenor_cli.cli.options import DEVICE, DTYPE, DataDirOpt, DeviceOpt, DtypeOpt, ForceOpt, JsonOpt, MaxWindowsOpt
from tsenor_cli.errors import InputNotFoundError, UsageError
from tsenor_cli.pattern import SparsityPattern

bench_app = typer.Typer(
    help="Benchmarks (speed and quality ratios measured in one run).", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(bench_app, name="bench")

_BENCH_HEADER = """# Solver benchmarks

Written by `make bench` (`tsenor bench solver`); every number below comes from that run. Quality is
measured on tiles sampled from every linear layer of every decoder block of the real checkpoint;
speed on one matrix assembled from real tiles, all methods in the same process, so compare the
ratios, not the absolute seconds (the CI machines are shared 2-core VMs). `docs/design/solver.md` explains
the methods and how the defaults were chosen.

"""


# What a bench writes at most into each file it is given (its JSON or Markdown: kilobytes).
BENCH_FILE_BYTES = 1 << 20


def _check_outputs(
    force: bool, files: dict[str, Path | None], merged: Path | None = None, folder: Path | None = None
) -> None:
    """Refuse, before any work, output locations the run could not write at its end (exit 4).

    files: {option: a file the run writes (replaced only with --force)}; merged: a Markdown file the run
    merges its section into (kept otherwise, so no --force needed); folder: --work-dir. Each is the one
    output check of every command (`tsenor_cli.outputs`: not a folder or an existing file without
    --force, its folder able to take a new file, room for what is written), the one `tsenor prune` runs
    on its --output."""
    from tsenor_cli.outputs import check_output_file, check_output_location

    for option, path in [*files.items(), ("--markdown", merged)]:
        if path is None:
            continue
        check_output_file(path, BENCH_FILE_BYTES, option=option, force=force or path is merged)
    if folder is not None:
        check_output_location(folder, option="--work-dir", what="the benchmark's checkpoints")


def _require_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device} was asked for but CUDA is not available; use --device cpu")


def _names(text: str) -> tuple[str, ...]:
    """A comma list's non-empty items, stripped."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _patterns(text: str) -> tuple[SparsityPattern, ...]:
    return tuple(SparsityPattern.parse(p) for p in text.split(",") if p.strip())


def _methods(text: str) -> tuple[str, ...]:
    from tsenor_cli.solver import METHODS

    if text == "all":
        # `auto` only runs one of the others: "all" lists each solver once.
        return tuple(name for name, info in METHODS.items() if info.choose is None)
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in METHODS]
    if unknown:
        raise UsageError(f"unknown solver method(s) {', '.join(unknown)}; choose from: {', '.join(METHODS)}")
    return names


@bench_app.command("solver", cls=Command)
def bench_solver(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m", help="Embedded model name or a local HF checkpoint folder."),
    patterns: str = typer.Option("2:4,4:8,8:16,16:32,8:32", help="N:M patterns for the quality table."),
    methods: str = typer.Option("all", help="Comma-separated mask methods, or 'all'."),
    tiles: int = typer.Option(500, min=1, help="Tiles per pattern for the quality table."),
    time_size: int = typer.Option(2048, min=16, help="Side of the square matrix timed for every method."),
    time_patterns: str = typer.Option("8:16,16:32", help="Patterns timed on the large matrices."),
    time_methods: str = typer.Option("all", help="Comma-separated methods to time, or 'all' (those of --methods)."),
    repeats: int = typer.Option(3, min=1, help="Timed solves per method, round-robin; the minimum is reported."),
    large_size: int = typer.Option(
        8192, min=0, help="Side of the matrix for the default solver's time and peak memory (0: skip)."
    ),
    device: DeviceOpt = DEVICE,
    seed: int = typer.Option(0, help="Seed for tile sampling and noise."),
    quick: bool = typer.Option(False, "--quick", help="A small, fast run (CI smoke test)."),
    output: Path | None = typer.Option(None, help="Write the JSON result here."),
    markdown: Path | None = typer.Option(
        None, help="Write the Markdown tables here (e.g. docs/measurements/benchmarks.md)."
    ),
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Quality of every mask method against `exact` on real tiles, and speed ratios on one matrix."""
    from tsenor_cli.bench.solver import BenchConfig, run_bench, to_markdown

    _require_device(device)
    _check_outputs(force, {"--output": output, "--markdown": markdown})
    model_dir = _model_dir(ctx, model)
    if quick:
        patterns, tiles, time_size, time_patterns, large_size = "2:4,8:16", min(tiles, 24), 128, "8:16", 0
    chosen = _methods(methods)
    timed = chosen if time_methods == "all" else _methods(time_methods)
    cfg = BenchConfig(
        model_dir=model_dir,
        model_name=model,
        patterns=_patterns(patterns),
        methods=chosen,
        tiles=tiles,
        time_size=time_size,
        time_patterns=_patterns(time_patterns),
        time_methods=timed,
        large_size=large_size,
        repeats=1 if quick else repeats,
        device=device,
        seed=seed,
    )
    result = run_bench(cfg)
    table = to_markdown(result)
    if output is not None:
        atomic.write_text(output, result.to_json() + "\n")
    if markdown is not None:
        atomic.write_text(markdown, _BENCH_HEADER + table)
    typer.echo(result.to_json() if json_out else table)


def _model_dir(ctx: typer.Context, model: str) -> Path:
    """The folder of --model: the embedded SmolLM2 materialized in the cache, or a local checkpoint folder."""
    from tsenor_cli.models.embedded import is_embedded, materialize

    if is_embedded(model):
        return materialize(model, run_context(ctx, None, offline=False).cache_dir)
    if not Path(model).is_dir():
        raise InputNotFoundError(
            f"model folder {model} not found; pass a local HF checkpoint folder or --model smollm2-135m"
        )
    return Path(model)


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise UsageError(f"{option} {text!r} must be a comma list of integers, e.g. 4096,16384") from exc


def _commands(text: str) -> tuple[str, ...]:
    """--commands as a tuple; `MemoryConfig` checks the names (one line, exit 2)."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


@bench_app.command("speedup", cls=Command)
def bench_speedup(
    models: str = typer.Option("llama-3.2-1b,llama-3.1-8b", help="Model shapes (comma list)."),
    tokens: str = typer.Option("4096,16384", help="Tokens per matmul (batch × sequence), comma list."),
    backends: str = typer.Option(
        "cutlass,cusparselt,cusparselt-direct",
        help="Sparse backends (comma list): cutlass, cusparselt (torch's semi-structured tensor), "
        "cusparselt-direct (torch._cslt_sparse_mm); those this GPU cannot run are listed, not timed.",
    ),
    warmup: int = typer.Option(10, min=0, help="Untimed calls before timing."),
    repeats: int = typer.Option(30, min=1, help="Timed spans; the median is reported."),
    inner: int = typer.Option(5, min=1, help="Calls per timed span."),
    quick: bool = typer.Option(False, "--quick", help="One model, 4096 tokens, few repeats (smoke test)."),
    output: Path | None = typer.Option(None, help="Write the JSON result here."),
    markdown: Path | None = typer.Option(
        None, help="Write the Markdown tables here (docs/measurements/benchmarks-speedup.md)."
    ),
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Forward/backward matmul speedups of ordinary and transposable 2:4 over dense (CUDA only)."""
    from tsenor_cli.bench.speedup import SpeedupConfig, require_cuda, run_speedup, to_markdown

    _check_outputs(force, {"--output": output, "--markdown": markdown})
    cfg = SpeedupConfig(
        models=("llama-3.2-1b",) if quick else tuple(x.strip() for x in models.split(",") if x.strip()),
        tokens=(4096,) if quick else _int_list(tokens, "--tokens"),
        backends=tuple(x.strip() for x in backends.split(",") if x.strip()),
        warmup=min(warmup, 3) if quick else warmup,
        repeats=min(repeats, 5) if quick else repeats,
        inner=inner,
    )
    require_cuda()
    result = run_speedup(cfg)
    table = to_markdown(result)
    if output is not None:
        atomic.write_text(output, result.to_json() + "\n")
    if markdown is not None:
        atomic.write_text(markdown, table)
    typer.echo(result.to_json() if json_out else table)


@bench_app.command("kernels", cls=Command)
def bench_kernels(
    model: str = typer.Option("llama-3.1-8b", help="Model shape: a name in configs/models or a config JSON."),
    blocks: int = typer.Option(2, min=1, help="Decoder blocks built (random weights, pruned to transposable 2:4)."),
    tokens: int = typer.Option(8192, min=8, help="Tokens of the prefill and of the MLP training step."),
    scale_down: int = typer.Option(1, "--scale-down", min=1, help="Divide the widths (CPU smoke runs)."),
    device: DeviceOpt = DEVICE,
    warmup: int = typer.Option(3, min=0, help="Untimed calls before timing."),
    repeats: int = typer.Option(10, min=1, help="Timed calls; the median is reported."),
    output: Path | None = typer.Option(None, help="Write the JSON result here."),
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Prefill tokens/s and an MLP training step, dense against --kernels sparse, at a LLaMA shape (CUDA;
    on the CPU the kernels' dense stand-in, to check the path, not to time it)."""
    from tsenor_cli.bench.kernels import KernelsConfig, run_kernels, to_markdown

    _check_outputs(force, {"--output": output})
    _require_device(device)
    cfg = KernelsConfig(model, blocks, tokens, scale_down, device, warmup, repeats)
    result = run_kernels(cfg)
    if output is not None:
        atomic.write_text(output, result.to_json() + "\n")
    typer.echo(result.to_json() if json_out else to_markdown(result))


_E2E_HEADER = """# End-to-end pruning benchmarks at LLaMA shapes

Written by `tsenor bench prune --markdown` (`make bench-gpu-e2e`); each section below is one run of the
benchmark, replaced when the same shape, block count, device and methods run again. See
`tsenor_cli/bench/prune.py` for what is measured and how the projections are made.

"""


_TOKENIZER = typer.Option(
    None, help="A folder with SmolLM2's tokenizer files (default: the embedded model's), e.g. on a GPU machine."
)
_STREAM = typer.Option(
    False,
    "--stream/--no-stream",
    help="Write the random weights to a safetensors checkpoint in the work folder, one tensor at a time, and "
    "prune it as `tsenor prune --stream` does (one block read at a time); default: held in memory.",
)


# `tsenor bench prune`'s options whose help takes more than a line.
_E2E_MODEL = typer.Option(
    "llama-3.2-1b",
    help="A model shape in configs/models (llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, llama-3.1-70b, "
    "smollm2-135m) or a config .json.",
)
_E2E_REFINE = typer.Option(
    "none",
    help="Block refinement modes (comma list): none, block; with both, the refined / plain time of each pair.",
)
_E2E_BLOCKS = typer.Option(
    None, min=1, help="Build only the first K decoder blocks and project the whole model (labelled a projection)."
)
_E2E_SCALE_DOWN = typer.Option(
    1, min=1, help="Divide hidden, intermediate and head counts by this (CPU smoke runs; 1: the published shape)."
)
_E2E_RESUME_STATE = typer.Option(
    True, "--resume-state/--no-resume-state", help="Save the resume state after each block, as `tsenor prune` does."
)
_E2E_WORK_DIR = typer.Option(
    None,
    help="Folder for the model config and the checkpoints (each removed once verified); default: a temp folder.",
)
_E2E_MARKDOWN = typer.Option(
    None,
    help="Put the tables into this Markdown file (docs/measurements/benchmarks-e2e.md), replacing the section "
    "of the same shape, blocks, device, methods and refine modes.",
)


@bench_app.command("prune", cls=Command)
def bench_prune(
    ctx: typer.Context,
    model: str = _E2E_MODEL,
    methods: str = typer.Option("alps,sparsegpt,wanda", help="Pruning methods (comma list)."),
    kinds: str = typer.Option("transposable,ordinary", help="Pattern kinds (comma list): transposable, ordinary."),
    refine: str = _E2E_REFINE,
    nm: str = typer.Option("16:32", help="The N:M pattern."),
    nsamples: int = typer.Option(128, min=1, help="Calibration samples."),
    seqlen: int = typer.Option(2048, min=1, help="Tokens per calibration sample."),
    blocks: int | None = _E2E_BLOCKS,
    scale_down: int = _E2E_SCALE_DOWN,
    device: DeviceOpt = DEVICE,
    dtype: DtypeOpt = DTYPE,
    solver: str = typer.Option("auto", help="Transposable mask solver."),
    seed: int = typer.Option(0, help="Seed of the random weights and of the calibration windows."),
    resume_state: bool = _E2E_RESUME_STATE,
    tokenizer: Path | None = _TOKENIZER,
    stream: bool = _STREAM,
    work_dir: Path | None = _E2E_WORK_DIR,
    data_dir: DataDirOpt = None,
    output: Path | None = typer.Option(None, help="Write the JSON result here."),
    markdown: Path | None = _E2E_MARKDOWN,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Prune a LLaMA-shaped model with random weights end to end: seconds and peak memory per phase."""
    from tsenor_cli.bench.prune import E2EConfig, merge_section, run_e2e, section_key, to_markdown
    from tsenor_cli.progress import logger

    _require_device(device)
    _check_outputs(force, {"--output": output}, merged=markdown, folder=work_dir)
    pattern = SparsityPattern.parse(nm)
    cfg = E2EConfig(
        model=model,
        methods=_names(methods),
        kinds=_names(kinds),
        refine=_names(refine),
        n=pattern.n,
        m=pattern.m,
        nsamples=nsamples,
        seqlen=seqlen,
        blocks=blocks,
        scale_down=scale_down,
        device=device,
        dtype=dtype,
        solver=solver,
        seed=seed,
        resume_state=resume_state,
        tokenizer=tokenizer,
        stream=stream,
    )
    result = run_e2e(cfg, run_context(ctx, data_dir, offline=False), work_dir, progress=logger.info)
    table = to_markdown(result)
    if output is not None:
        atomic.write_text(output, result.to_json() + "\n")
    if markdown is not None:
        existing = markdown.read_text() if markdown.exists() else _E2E_HEADER
        atomic.write_text(markdown, merge_section(existing, section_key(result), table))
    typer.echo(result.to_json() if json_out else table)


@bench_app.command("moe", cls=Command)
def bench_moe(
    experts: int = typer.Option(64, min=2, help="Experts of the Qwen3-MoE-shaped block."),
    top_k: int = typer.Option(8, min=1, help="Experts each token is routed to."),
    hidden: int = typer.Option(128, min=32, help="Hidden size (a multiple of 32)."),
    expert_width: int = typer.Option(64, min=32, help="Each expert's intermediate size (a multiple of 32)."),
    samples: int = typer.Option(32, min=1, help="Calibration samples."),
    seqlen: int = typer.Option(128, min=1, help="Tokens per sample."),
    methods: str = typer.Option("wanda,sparsegpt", help="Methods pruned batched and one by one (comma list)."),
    repeats: int = typer.Option(5, min=1, help="Timed runs of each; the median is reported."),
    output: Path | None = typer.Option(None, help="Write the JSON result here."),
    markdown: Path | None = typer.Option(
        None, help="Write the Markdown section here (docs/measurements/benchmarks-moe.md)."
    ),
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Routed statistics of a mixture-of-experts block against its dense forward, and experts pruned
    batched against one by one (CPU; ratios measured in one run)."""
    from tsenor_cli.bench.moe import MoeBenchConfig, run_moe_bench, to_markdown
    from tsenor_cli.progress import logger
    from tsenor_cli.pruning.methods.registry import get_pruner

    _check_outputs(force, {"--output": output, "--markdown": markdown})
    names = tuple(get_pruner(x.strip()).name for x in methods.split(",") if x.strip())
    cfg = MoeBenchConfig(experts, top_k, hidden, expert_width, samples, seqlen, names, repeats=repeats)
    result = run_moe_bench(cfg, logger.info)
    if output is not None:
        atomic.write_text(output, result.to_json() + "\n")
    if markdown is not None:
        atomic.write_text(markdown, _MOE_HEADER + to_markdown(result))
    typer.echo(result.to_json() if json_out else to_markdown(result))


_MOE_HEADER = """# Mixture-of-experts benchmark

Written by `make bench` (`tsenor bench moe`); every number below comes from that run. See
`tsenor_cli/bench/moe.py` for what is measured; compare the ratios, not the seconds (shared 2-core CPU).
The sequential engine collects a block's statistics one group at a time because each group's inputs
depend on the groups pruned before it (the down-projection experts read what the pruned gate/up experts
produce), so a block with two expert stacks pays two watched passes, as a dense LLaMA block pays one
(cut short at the group) per group. The calibration gives each expert more routed rows than its input
dimension, as a real one does (128 × 2048 tokens); with fewer (8 × 128 tokens here: 128 rows per expert
on average) about half of the experts fall back to every-token statistics, an extra pass that costs up
to the `--moe-calibration all` row. The routed statistics cost 9.0× the forward on 2026-11-25 08:46,
before the watch was limited to the experts module and the rows of several samples were batched.

"""


# `tsenor bench memory`'s options whose help takes more than a line.
_MEMORY_COMMANDS = typer.Option(
    "eval,prune",
    help="What to measure (comma list): eval, prune, prune-eval (`tsenor prune --eval` itself, streamed and "
    "--no-stream; reads WikiText-2 from the data folder).",
)
_MEMORY_MERGE = typer.Option(
    False,
    "--merge",
    help="Replace only the measured commands in the --output JSON of an earlier run and keep the others; "
    "the page says when each section was measured.",
)


@bench_app.command("memory", cls=Command)
def bench_memory(
    ctx: typer.Context,
    blocks: str = typer.Option("8,16,32", help="Model depths to measure (comma list)."),
    width: int = typer.Option(1024, min=64, help="Hidden size of the random LLaMA models (MLP 4x, heads of 64)."),
    seqlen: int = typer.Option(256, min=2, help="Tokens per perplexity window."),
    windows: int = typer.Option(2, min=1, help="Perplexity windows per evaluation."),
    seed: int = typer.Option(0, help="Seed of the random weights and tokens."),
    commands: str = _MEMORY_COMMANDS,
    machine: str = typer.Option("", help="The machine, as the Markdown page names it (default: platform, cores)."),
    output: Path | None = typer.Option(None, help="Write the JSON result here."),
    markdown: Path | None = typer.Option(None, help="Write the Markdown page here (docs/measurements/)."),
    merge: bool = _MEMORY_MERGE,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Peak host memory and time of `tsenor eval --ppl`, `prune` and `prune --eval`, streamed and whole, by depth."""
    import datetime
    import json
    import os
    import platform

    from tsenor_cli.bench.memory import MemoryConfig, merge_results, read_result, run_memory_bench, to_markdown
    from tsenor_cli.cli.app import command_line
    from tsenor_cli.progress import logger

    if merge and (output is None or not output.is_file()):
        raise UsageError("--merge keeps the other commands of an earlier --output JSON; pass it with --output")
    _check_outputs(force, {"--markdown": markdown})
    _check_outputs(force or merge, {"--output": output})  # --merge rewrites the JSON it reads
    cfg = MemoryConfig(
        blocks=_int_list(blocks, "--blocks"),
        width=width,
        intermediate=4 * width,
        heads=max(1, width // 64),
        seqlen=seqlen,
        windows=windows,
        seed=seed,
        commands=_commands(commands),
    )
    earlier = read_result(output) if merge and output is not None else None
    today = datetime.date.today().isoformat()
    run_ctx = run_context(ctx, None, False)  # the cache and data folders: the bench reads no environment itself
    result = {**run_memory_bench(cfg, run_ctx, say=logger.info), "date": today, "command": command_line()}
    if earlier is not None:
        result = merge_results(earlier, result, str(output))
    where = machine or f"{platform.machine()} Linux, {os.cpu_count()} CPU cores"
    page = to_markdown(result, command_line(), today, where)
    if output is not None:
        atomic.write_json(output, result)
    if markdown is not None:
        atomic.write_text(markdown, page)
    typer.echo(json.dumps(result, indent=2) if json_out else page)


@bench_app.command("checkpoint", cls=Command)
def bench_checkpoint(
    ctx: typer.Context,
    model: str = typer.Option(
        "smollm2-135m", help="Embedded model name or a local HF checkpoint folder, pruned for real."
    ),
    patterns: str = typer.Option("2:4,16:32", help="N:M patterns of the matrix and shape rows (comma list)."),
    size: int = typer.Option(2048, min=32, help="Side of the bf16 matrix encoded per pattern and kind."),
    shapes: str = typer.Option("llama-3.2-1b,llama-3.1-8b", help="Model shapes in configs/models (comma list)."),
    nm: str = typer.Option("2:4", help="The real prune's pattern (transposable)."),
    method: str = typer.Option("magnitude", help="The real prune's method."),
    loads: int = typer.Option(3, min=1, help="Loads of each folder (fresh processes, alternating); medians."),
    max_windows: MaxWindowsOpt = None,
    work_dir: Path | None = typer.Option(None, help="Folder for the two pruned checkpoints (default: a temp folder)."),
    output: Path | None = typer.Option(None, help="Write the JSON result here."),
    markdown: Path | None = typer.Option(
        None, help="Write the Markdown page here (docs/measurements/benchmarks-checkpoint.md)."
    ),
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Packed against dense checkpoints: bytes of pruned matrices and whole models, load time and peak host
    memory through AutoModelForCausalLM, and eval perplexity (ratios measured in one run)."""
    import json

    from tsenor_cli.bench.checkpoint import CheckpointBenchConfig, run_checkpoint_bench, to_markdown
    from tsenor_cli.cli.app import command_line
    from tsenor_cli.progress import logger
    from tsenor_cli.pruning.methods.registry import get_pruner

    _check_outputs(force, {"--output": output, "--markdown": markdown}, folder=work_dir)
    cfg = CheckpointBenchConfig(
        model_dir=_model_dir(ctx, model),
        model_name=model,
        patterns=_names(patterns),
        size=size,
        shapes=_names(shapes),
        nm=nm,
        method=get_pruner(method).name,
        loads=loads,
        max_windows=max_windows,
    )
    result = {**run_checkpoint_bench(cfg, work_dir, say=logger.info), "command": command_line()}
    page = to_markdown(result, command_line())
    if output is not None:
        atomic.write_json(output, result)
    if markdown is not None:
        atomic.write_text(markdown, page)
    typer.echo(json.dumps(result, indent=2) if json_out else page)

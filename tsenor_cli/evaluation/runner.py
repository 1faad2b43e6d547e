"""Library entry for evaluation: perplexity on WikiText2/PTB/C4 and optional zero-shot tasks.

``evaluate_model(loaded, cfg, ctx) -> EvalReport``; ``EvalReport.to_json()`` is the content of
``eval.json`` (defined in tsenor_cli/runfiles/run.py, read back by ``tsenor report``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tsenor_cli.data.eval_text import eval_token_stream
from tsenor_cli.data.sources import DATASET_NAMES, DatasetName
from tsenor_cli.errors import OutputExistsError, UsageError
from tsenor_cli.evaluation.perplexity import Windows, perplexity
from tsenor_cli.evaluation.streamed import BlockCallbacks, streamed_perplexity
from tsenor_cli.kernels import KERNELS
from tsenor_cli.models.identity import identity_digest
from tsenor_cli.models.loading import LoadedModel, LoadOptions
from tsenor_cli.precision import NAMES, machine_versions, warn_slow_products
from tsenor_cli.progress import counted, sink
from tsenor_cli.provenance import tsenor_versions
from tsenor_cli.runfiles import (
    CONFIG_FILE,
    EVAL_FILE,
    ContextRecord,
    EvalReport,
    PerplexityRecord,
    ZeroShotResult,
    read_sparsity,
)
from tsenor_cli.settings import RunContext

if TYPE_CHECKING:
    from tsenor_cli.kernels.sparse import KernelPlan

DEFAULT_SEQLEN = 2048
STREAM_TASKS = (
    "--stream evaluates perplexity only: zero-shot tasks need the whole model; drop --stream, with "
    "--device-map auto to spread the model over the GPUs present"
)


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate. seqlen None = min(2048, the model's max positions); command: the command line,
    recorded in eval.json; stream: evaluate perplexity block by block when the model is a safetensors
    checkpoint on disk and no zero-shot task needs the whole model (`load_for_evaluation`); kernels:
    "sparse" runs the 2:4-pruned linears on the GPU's sparse tensor cores (`kernels/sparse.py`)."""

    ppl_datasets: tuple[DatasetName, ...] = DATASET_NAMES
    tasks: tuple[str, ...] = ()
    num_fewshot: int = 0
    limit: int | float | None = None
    batch_size: int | str = "auto"  # lm-eval's; perplexity uses it when it is an integer, else 1
    seqlen: int | None = None
    max_windows: int | None = None
    command: str | None = None
    stream: bool = True
    kernels: str = KERNELS.default

    def __post_init__(self) -> None:
        KERNELS.validate(self.kernels)
        unknown = [d for d in self.ppl_datasets if d not in DATASET_NAMES]
        if unknown:
            raise UsageError(f"unknown perplexity dataset(s) {', '.join(unknown)}; use {','.join(DATASET_NAMES)}")
        if len(set(self.ppl_datasets)) != len(self.ppl_datasets):
            raise UsageError(f"perplexity dataset list {','.join(self.ppl_datasets)} repeats a name; give each once")
        if self.seqlen is not None and self.seqlen < 2:
            raise UsageError(f"--seqlen must be at least 2, got {self.seqlen}")
        if self.max_windows is not None and self.max_windows < 1:
            raise UsageError(f"--max-windows must be positive, got {self.max_windows}")
        if self.num_fewshot < 0:
            raise UsageError(f"--num-fewshot must be >= 0, got {self.num_fewshot}")
        if isinstance(self.batch_size, int) and self.batch_size < 1:
            raise UsageError(f"--batch-size must be positive or 'auto', got {self.batch_size}")
        if isinstance(self.batch_size, str) and self.batch_size != "auto":
            raise UsageError(f"--batch-size must be a positive integer or 'auto', got {self.batch_size!r}")

    def check_sources(self, ctx: RunContext) -> None:
        """Refuse perplexity datasets with no source under `ctx` (hub off, no data folder) before loading a model."""
        from tsenor_cli.data.sources import data_folder

        for name in self.ppl_datasets:
            data_folder(ctx, name)

    def check(self, ctx: RunContext, *, stream: bool = False, device_map: str | None = None) -> None:
        """Everything `tsenor eval` can refuse before loading a model: nothing to evaluate, a dataset with
        no source (`check_sources`), and how the model is placed (--stream, --device-map)."""
        if not self.ppl_datasets and not self.tasks:
            raise UsageError("nothing to evaluate: --ppl none and no --tasks; pass --ppl wikitext2 or --tasks piqa")
        self.check_sources(ctx)
        if device_map is not None and device_map != "auto":
            raise UsageError(f"--device-map {device_map!r} is not supported; pass --device-map auto")
        if stream and self.tasks:
            raise UsageError(STREAM_TASKS)
        if stream and device_map is not None:
            raise UsageError("--stream and --device-map both place the model; pass one of them")


# What `tsenor eval --output` writes: eval.json (kilobytes; its temporary beside it while written).
EVAL_FILE_BYTES = 1 << 20


def eval_target(output: Path | None, *, force: bool) -> Path | None:
    """The eval.json `tsenor eval --output FOLDER` writes (None without --output), refused before any
    work (exit 4) when FOLDER is a file, cannot be created or written, or lacks the room for the file
    (`tsenor_cli.outputs.check_output_folder`, the check `tsenor prune --output` runs), or when the file
    exists without --force."""
    from tsenor_cli.outputs import check_output_folder

    if output is None:
        return None
    check_output_folder(output, EVAL_FILE_BYTES, what=EVAL_FILE)
    target = output / EVAL_FILE
    if target.exists() and not force:
        raise OutputExistsError(f"{target} already exists; pass --force to overwrite it or choose another --output")
    return target


def finished_evaluation_in(
    output: Path | None, model: str, cfg: EvalConfig, ctx: RunContext, *, force: bool
) -> EvalReport | None:
    """`tsenor eval MODEL --output OUT` run again (a requeued batch job, a script rerun after its prune found
    its run finished): OUT's eval.json when this command line wrote it of MODEL as it is now (its identity:
    `runfiles.output.finished_evaluation`), else None: without --output, with --force, or when OUT holds
    another evaluation, which `eval_target` then refuses."""
    from tsenor_cli.runfiles.output import finished_evaluation

    if output is None or force or not (output / EVAL_FILE).is_file():
        return None
    return finished_evaluation(output, cfg.command, ContextRecord.of(ctx), identity_digest(model))


def package_versions() -> dict[str, str]:
    """Versions of the libraries that decide the numbers (absent ones are reported as such), and the CPU's
    kind (`precision.machine_versions`)."""
    versions = tsenor_versions()
    for key, dist in (
        ("torch", "torch"),
        ("transformers", "transformers"),
        ("datasets", "datasets"),
        ("lm-eval", "lm_eval"),
    ):
        try:
            versions[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[key] = "not installed"
    return versions | machine_versions()


def effective_seqlen(loaded: LoadedModel, seqlen: int | None) -> int:
    """seqlen, or min(2048, max positions); a seqlen beyond the model's max positions is refused."""
    limit = loaded.max_positions
    if seqlen is None:
        return min(DEFAULT_SEQLEN, limit) if limit else DEFAULT_SEQLEN
    if limit is not None and seqlen > limit:
        raise UsageError(
            f"--seqlen {seqlen} exceeds the model's max_position_embeddings {limit}; pass --seqlen {limit} or less"
        )
    return seqlen


def load_for_evaluation(
    model: str, ctx: RunContext, cfg: EvalConfig, *, dtype: str | None, device: str, options: LoadOptions | None = None
) -> LoadedModel:
    """The model to evaluate under `cfg`: streamed (blocks on the meta device, read one at a time by
    `evaluation/streamed.py`) when `cfg.stream` and only perplexity is asked for and no --device-map
    places it; pickle weights (a folder's or a hub id's) are then loaded whole with one line saying so
    (`models.loading.load_model`). Zero-shot tasks need the whole model: loaded whole. options: the rest of
    the load (None: `LoadOptions()`)."""
    from tsenor_cli.models.loading import load_model, parse_dtype

    how = LoadOptions() if options is None else options
    stream = cfg.stream and not cfg.tasks and how.device_map is None
    return load_model(
        model,
        ctx,
        dtype=parse_dtype(dtype),
        device=device,
        stream=stream,
        options=how,
    )


@dataclass(frozen=True)
class EvalModel:
    """The model `evaluate_into` evaluates and how it is loaded: `name` (an embedded name, a checkpoint folder
    or a hub id), its dtype (None: `auto`) and device, and the rest of the load (`load_for_evaluation`)."""

    name: str
    dtype: str | None
    device: str
    options: LoadOptions | None = None


def evaluate_into(
    model: EvalModel, cfg: EvalConfig, ctx: RunContext, *, output: Path | None, force: bool
) -> EvalReport:
    """`tsenor eval MODEL` and `tsenor_cli.evaluate`: `model` loaded (`load_for_evaluation`) and evaluated under
    `cfg`, into `output`/eval.json when `output` is given (refused before any work when it cannot be written,
    or holds an eval.json and not `force`: `eval_target`). The same command line again on the unchanged
    folder returns the eval.json on disk (`found_finished`) and writes nothing (`finished_evaluation_in`)."""
    from tsenor_cli.progress import logger
    from tsenor_cli.runfiles.write import write_eval

    done = finished_evaluation_in(output, model.name, cfg, ctx, force=force)
    if done is not None:
        logger.info("%s already held this command's evaluation of %s as it is now; nothing written", output, model.name)
        return done
    target = eval_target(output, force=force)
    loaded = load_for_evaluation(model.name, ctx, cfg, dtype=model.dtype, device=model.device, options=model.options)
    report = evaluate_model(loaded, cfg, ctx)
    if target is not None:
        write_eval(target, report)
        logger.info("wrote %s", target)
    return report


def evaluate_model(
    loaded: LoadedModel,
    cfg: EvalConfig,
    ctx: RunContext,
    *,
    progress: Callable[[str], None] | None = None,
) -> EvalReport:
    """Perplexity on each of cfg.ppl_datasets, then zero-shot cfg.tasks (when any), with data from
    where `ctx` says (tsenor_cli/settings.py). A model loaded with ``stream=True`` is evaluated block by
    block (`evaluation/streamed.py`; perplexity only: zero-shot needs the whole model)."""
    if cfg.tasks and loaded.checkpoint is not None:
        raise UsageError(STREAM_TASKS)
    started = time.perf_counter()
    # The checkpoint's identity as it was evaluated (a rerun compares it: `finished_evaluation_in`).
    identity = identity_digest(loaded.name)
    seqlen = effective_seqlen(loaded, cfg.seqlen)
    first = next(loaded.model.parameters())
    device = first.device
    if first.dtype in NAMES:
        warn_slow_products(device, first.dtype, [f"evaluating in {NAMES[first.dtype]}"], "--dtype fp32")
    kernels = sparse_kernels(loaded, device, sink(progress)) if cfg.kernels == "sparse" else None
    try:
        results = _perplexities(loaded, cfg, ctx, seqlen, progress, kernels)
        zeroshot = _run_zeroshot(loaded, cfg, ctx, progress) if cfg.tasks else None
    finally:
        if kernels is not None:
            kernels.uninstall()
    return EvalReport(
        model=loaded.name,
        source=loaded.source,
        model_type=loaded.model_type,
        dtype=str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
        device=str(device),
        seqlen=seqlen,
        max_windows=cfg.max_windows,
        perplexity=results,
        zeroshot=zeroshot,
        versions=package_versions(),
        seconds=time.perf_counter() - started,
        command=cfg.command,
        context=ContextRecord.of(ctx),
        model_identity=identity,
    )


def sparse_kernels(loaded: LoadedModel, device: torch.device, say: Callable[[str], None]) -> KernelPlan:
    """`--kernels sparse`: the plan of the linears that run on 2:4 kernels (from the sparsity record of
    the checkpoint folder, when it is one), said in one line, installed on a whole model (a streamed
    one's blocks get theirs as each is read, `_perplexities`)."""
    from tsenor_cli.kernels.sparse import plan_kernels

    source = Path(loaded.source)
    record = read_sparsity(source) if (source / CONFIG_FILE).is_file() else None
    dtype = next(loaded.model.parameters()).dtype
    plan = plan_kernels(loaded.model, record, device, dtype)
    say(plan.line())
    if loaded.checkpoint is None:
        plan.install(loaded.model)
    return plan


def _block_installer(loaded: LoadedModel, kernels: KernelPlan | None) -> Callable[[int, Any], None] | None:
    """For a streamed model with sparse kernels: (index, block just read) → its linears' kernels installed."""
    if kernels is None or kernels.backend is None:
        return None
    names = {id(module): name for name, module in loaded.model.named_modules()}
    blocks = loaded.structure.blocks

    def install(index: int, block: Any) -> None:
        kernels.install(block, names[id(blocks[index])])

    return install


def _perplexities(
    loaded: LoadedModel,
    cfg: EvalConfig,
    ctx: RunContext,
    seqlen: int,
    progress: Callable[[str], None] | None,
    kernels: KernelPlan | None = None,
) -> dict[str, PerplexityRecord]:
    """{dataset: its perplexity record} for cfg.ppl_datasets in windows of `seqlen` on the device of the model's
    parameters, streamed block by block when the model was loaded with ``stream=True`` (each block's sparse
    kernels installed as it is read)."""
    ppl_batch = cfg.batch_size if isinstance(cfg.batch_size, int) else 1
    device = next(loaded.model.parameters()).device
    say = sink(progress)
    # Every stream first: the window count of the whole evaluation is known before the first window, so
    # the first window's time gives an estimate of it all (`_WindowClock`).
    streams = {}
    for name in cfg.ppl_datasets:
        t0 = time.perf_counter()
        text = eval_token_stream(name, loaded.tokenizer, ctx, seqlen=seqlen)
        say(f"{name}: {text.tokens} tokens ({text.description})")
        streams[name] = (text, time.perf_counter() - t0)
    counts = {name: window_count(text.tokens, seqlen, cfg.max_windows) for name, (text, _) in streams.items()}
    clock = _WindowClock(sum(counts.values()), say, every_window=progress is not None)
    if clock.total:
        parts = ", ".join(f"{name} {count}" for name, count in counts.items())
        say(f"perplexity: {counted(clock.total, 'window')} of {seqlen} tokens ({parts})")
    results: dict[str, PerplexityRecord] = {}
    for name, (text, spent) in streams.items():
        t0 = time.perf_counter()
        report, windows = clock.reporter(name), Windows(seqlen, cfg.max_windows, ppl_batch)
        if loaded.checkpoint is not None:
            result = streamed_perplexity(
                loaded, text.input_ids, windows, device=device, progress=report,
                blocks=BlockCallbacks(prepare=_block_installer(loaded, kernels)),
            )  # fmt: skip
        else:
            result = perplexity(loaded.model, text.input_ids, windows, device=device, progress=report)
        results[name] = PerplexityRecord(
            ppl=result.ppl,
            nll_sum=result.nll_sum,
            tokens=result.tokens,
            windows=result.windows,
            seqlen=result.seqlen,
            data=text.description,
            data_source=text.source,
            seconds=spent + time.perf_counter() - t0,
        )
        say(f"{name}: ppl {result.ppl:.3f} over {counted(result.windows, 'window')} of {seqlen}")
    return results


def window_count(tokens: int, seqlen: int, max_windows: int | None) -> int:
    """The windows `perplexity` evaluates in a stream of `tokens` (non-overlapping, capped by max_windows)."""
    whole = tokens // seqlen
    return whole if max_windows is None else min(whole, max_windows)


def duration(seconds: float) -> str:
    """A rough duration for a person: "40 s", "12 min", "3.5 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _WindowClock:
    """Windows done over the whole perplexity evaluation (`total` windows over its datasets) → an estimate
    of the time left: said once after the first window (the evaluation's length, before it is spent) and,
    with `every_window`, after each window."""

    def __init__(self, total: int, say: Callable[[str], None], *, every_window: bool) -> None:
        self.total = total
        self.say = say
        self.every_window = every_window
        self.done = 0
        self.started = time.perf_counter()

    def reporter(self, name: str) -> Callable[[int, int], None]:
        before = self.done

        def step(done: int, total: int) -> None:
            first = self.done == 0
            self.done = before + done
            spent = time.perf_counter() - self.started
            left = spent / self.done * (self.total - self.done)
            if first:
                self.say(
                    f"{name}: window {done}/{total} took {spent:.1f} s; the perplexity evaluation takes about "
                    f"{duration(spent + left)} ({counted(self.total, 'window')}; --max-windows N shortens it)"
                )
            elif self.every_window:
                self.say(f"{name}: window {done}/{total} ({spent:.0f} s, about {duration(left)} left)")

        return step


def _run_zeroshot(
    loaded: LoadedModel, cfg: EvalConfig, ctx: RunContext, progress: Callable[[str], None] | None
) -> ZeroShotResult:
    try:
        from tsenor_cli.evaluation.zeroshot import ZeroShotTasks, run_zeroshot
    except ModuleNotFoundError as exc:
        if exc.name != "tsenor_cli.evaluation.zeroshot":
            raise
        raise UsageError("zero-shot evaluation is not available in this build; omit --tasks") from exc
    tasks = ZeroShotTasks(cfg.tasks, num_fewshot=cfg.num_fewshot, limit=cfg.limit, batch_size=cfg.batch_size)
    return run_zeroshot(loaded.model, loaded.tokenizer, tasks, ctx, progress)

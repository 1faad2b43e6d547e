"""`tsenor bench prune`: the whole prune pipeline at LLaMA shapes, timed and measured phase by phase.

There is no hub here, so the model is built from a published shape (`configs/models/NAME.json`, a
transformers config) with seeded random weights: initialized on the compute device in the run's dtype
(no fp32 copy), then moved to the CPU, where `tsenor prune` keeps a model while one block at a time
works on the device. The calibration text is real (the project's C4 reader) and tokenized with the
embedded SmolLM2 tokenizer; its ids (< 49152) index the LLaMA vocabulary (128256) unchanged, so they
are valid inputs, though not the tokens a LLaMA tokenizer would give. Each run is `prune_model` itself
(calibration, capture, block by block with the resume state, checkpoint write), with the phases of
`phases.py` recorded, and the checkpoint is verified afterwards.

ALPS stops when its support stops changing, which depends on the weights: random weights may stop
earlier or later than real ones. So every ALPS layer's iterations and its loop seconds (method + mask
solver) are kept, and the run is also given at the iterations measured on the real SmolLM2
(`docs/results/runs/alps-16x32-{t,o}`): each layer's loop time scaled by (the mean SmolLM2 iterations of
its linear, e.g. mlp.down_proj) / (its own iterations).

With `blocks` < the model's layers only the first blocks are built; the whole model is projected as
fixed costs (calibration text, block-0 capture) + the checkpoint write scaled by the parameter count +
everything else scaled by layers / blocks, and labelled a projection. A run on fewer calibration tokens
than `tsenor prune`'s default (128 × 2048) is also projected at that default: the phases whose work
grows with the tokens (`TOKEN_PHASES`: the text, the forwards over every sample, the input statistics)
scaled by the token ratio, the rest (the methods' work on the weights and Gram matrices) as measured.
Small forwards cost more per token than large ones, so this errs high.

With `stream`, the random weights are not held: they are written tensor by tensor to a safetensors
checkpoint in the work folder (`write_random_checkpoint`, through the checkpoint writer of
`models/saving.py`), and each run prunes that folder as `tsenor prune --stream` does, reading one block
at a time. Either way each run's host peak (the process's resident-set high-water mark, reset when the
run starts) is set against the dry run's host estimate (`pruning/block/memory.py`'s `HostEstimate`).
"""

from __future__ import annotations

import copy
import gc
import itertools
import json
import resource
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tsenor_cli.bench.machine import environment
from tsenor_cli.errors import BadInputError, InputNotFoundError, UsageError
from tsenor_cli.phases import PHASES, REFINE_PHASES
from tsenor_cli.progress import Progress, sink
from tsenor_cli.pruning.settings.config import REFINE_MODES
from tsenor_cli.settings import RunContext

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
REFERENCE_RUNS = Path(__file__).resolve().parents[2] / "docs" / "results" / "runs"
METHODS = ("alps", "sparsegpt", "wanda")
# The phases that happen once per run whatever the number of blocks.
FIXED_PHASES = ("plan", "calibration", "capture")
# The phases whose work grows with the calibration tokens (forwarded, summed into statistics). Not the
# calibration phase: reading the text file is most of it at any size (0.16-0.23 s on the H100 at 128 × 2048).
TOKEN_PHASES = ("capture", "statistics", "rerun", "dense stream", "refine")
MARK = "<!-- tsenor bench prune: {key} -->"


@dataclass(frozen=True)
class E2EConfig:
    """model: a name in configs/models or a path to a config JSON; blocks: build only the first `blocks`
    decoder blocks (None: all); scale_down: divide the widths (`scale_shape`, 1: the published shape; for
    CPU smoke runs); pattern kinds: "transposable" and/or "ordinary" N:M; tokenizer: a folder with the
    SmolLM2 tokenizer files (None: the embedded model's, materialized), for machines without the package;
    refine: the `--refine` modes to run each method and kind with ("none" and/or "block"); with both, the
    tables give each refined run's wall time over its plain twin's (against a target of ≤ 2×); stream:
    prune from a safetensors checkpoint of the random weights, block by block (module docstring)."""

    model: str
    methods: tuple[str, ...] = METHODS
    kinds: tuple[str, ...] = ("transposable", "ordinary")
    refine: tuple[str, ...] = ("none",)
    n: int = 16
    m: int = 32
    nsamples: int = 128
    seqlen: int = 2048
    blocks: int | None = None
    scale_down: int = 1
    device: str = "cpu"
    dtype: str | None = None
    solver: str = "auto"
    seed: int = 0
    resume_state: bool = True
    tokenizer: Path | None = None
    reference_runs: Path = REFERENCE_RUNS
    stream: bool = False


@dataclass
class RunResult:
    """One prune run: seconds per phase (exclusive; `other` is the rest of `seconds`), device peaks in
    bytes (None off CUDA), ALPS layers (name, iterations, loop seconds), projections (None where they do
    not apply). Host: the resident set when the run started (the runtime, and a held model) and its peak
    during the run (None where the kernel cannot reset the high-water mark), the dry run's host estimate,
    and the peak over it, whole and less the start: the dry run's fit check sets the estimate against
    the memory still available to a process whose runtime is already resident, so what the run adds to
    the start is what the estimate predicts (a held model is resident at the start and counted in it);
    the peak per phase (a phase's includes its nested phases': `phases.Timings.host_peaks`)."""

    method: str
    kind: str
    pattern: str
    solver: str | None
    seconds: float
    phases: dict[str, float]
    other_seconds: float
    peak_bytes: int | None
    phase_peak_bytes: dict[str, int]
    estimate_bytes: int
    peak_over_estimate: float | None
    verified: bool
    refine: str = "none"
    alps_layers: list[dict[str, Any]] = field(default_factory=list)
    alps_iterations_mean: float | None = None
    alps_seconds_per_iteration: float | None = None
    reference_iterations_mean: float | None = None
    seconds_at_reference_iterations: float | None = None
    projected_whole_seconds: float | None = None
    projected_whole_seconds_at_reference_iterations: float | None = None
    projected_whole_seconds_default_calibration: float | None = None
    host_start_bytes: int | None = None
    host_peak_bytes: int | None = None
    host_estimate_bytes: int = 0
    host_peak_over_estimate: float | None = None
    host_added_over_estimate: float | None = None
    host_phase_peak_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class E2EResult:
    config: dict[str, Any]
    environment: dict[str, Any]
    shape: dict[str, Any]
    runs: list[RunResult]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


def config_path(model: str) -> Path:
    """The config JSON of `model`: a path, or a name in configs/models."""
    path = Path(model).expanduser()
    if path.suffix == ".json":
        if not path.is_file():
            raise InputNotFoundError(f"model config {path} not found; pass a transformers config JSON")
        return path
    named = CONFIG_DIR / f"{model}.json"
    if not named.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.json")) if CONFIG_DIR.is_dir() else []
        raise InputNotFoundError(
            f"no model shape {model!r} in {CONFIG_DIR}; "
            f"use one of {', '.join(known) or '(none)'} or a config .json path"
        )
    return named


def _scale_problem(raw: dict[str, Any], factor: int) -> str | None:
    """Why `factor` cannot divide the shape `raw` (a config dict), or None when it can."""
    for key in ("hidden_size", "intermediate_size", "num_attention_heads"):
        if raw[key] % factor:
            return f"does not divide {key}={raw[key]}"
    heads = raw["num_attention_heads"] // factor
    kv = max(1, int(raw.get("num_key_value_heads", raw["num_attention_heads"])) // factor)
    if heads % kv:
        return f"leaves {heads} heads for {kv} KV heads"
    return None


def scale_shape(raw: dict[str, Any], factor: int) -> dict[str, Any]:
    """The config dict with hidden, intermediate and attention-head counts divided by `factor` (head_dim,
    vocabulary and layers kept; key/value heads down to at least 1), for a small run of the same kind."""
    if factor == 1:
        return raw
    problem = _scale_problem(raw, factor)
    if problem is not None:
        # Suggest only factors that work for this shape (a fixed "16" fails on 9 or 24 heads).
        fits = [f for f in range(2, raw["num_attention_heads"] + 1) if _scale_problem(raw, f) is None]
        hint = f"use one of {', '.join(map(str, fits))}" if fits else "this shape has none but 1 (no scaling)"
        raise UsageError(f"--scale-down {factor} {problem}; {hint}")
    scaled = dict(raw)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads"):
        scaled[key] = raw[key] // factor
    scaled["num_key_value_heads"] = max(1, int(raw.get("num_key_value_heads", raw["num_attention_heads"])) // factor)
    scaled.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    return scaled


def shape_config(model: str, blocks: int | None, scale_down: int = 1) -> tuple[Any, int]:
    """(transformers config with `blocks` decoder layers and widths / `scale_down`, the published layer count)."""
    from transformers import AutoConfig

    raw = scale_shape(json.loads(config_path(model).read_text()), scale_down)
    config = AutoConfig.for_model(**raw)
    layers = int(config.num_hidden_layers)
    if blocks is not None:
        if not 1 <= blocks <= layers:
            raise UsageError(f"--blocks {blocks} must be between 1 and {layers} (the layers of {model})")
        config.num_hidden_layers = blocks
    return config, layers


def build_random_model(config: Any, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """The causal LM of `config` with seeded random weights, initialized on `device` in `dtype` (no
    fp32 copy), in eval mode on the CPU where `prune_model` expects it."""
    from transformers import AutoModelForCausalLM

    gc.collect()  # the previous run's model and activations, before this one is measured
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to("cpu")
    model.eval()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def reference_iterations(runs: Path, transposable: bool, n: int, m: int) -> dict[str, float]:
    """{linear name inside its block (e.g. "mlp.down_proj"): mean ALPS iterations on the real SmolLM2}
    from the published run `alps-{n}x{m}-{t|o}` under `runs`; {} when that run is not there."""
    from tsenor_cli.runfiles import PRUNE_FILE, PruneReport

    path = runs / f"alps-{n}x{m}-{'t' if transposable else 'o'}" / PRUNE_FILE
    if not path.is_file():
        return {}
    report = PruneReport.from_json(json.loads(path.read_text()), where=str(path))
    per_name: dict[str, list[int]] = defaultdict(list)
    for layer in report.layers:
        if layer.status == "pruned" and layer.iterations:
            per_name[_local_name(layer.name)].append(layer.iterations)
    return {name: statistics.fmean(its) for name, its in per_name.items()}


def _local_name(full_name: str) -> str:
    """ "model.layers.3.mlp.down_proj" → "mlp.down_proj": the part after the block index."""
    parts = full_name.split(".")
    digits = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[digits[0] + 1 :]) if digits else full_name


def _rss_high_water() -> int:
    """The process's resident-set high-water mark in bytes (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _random_tensor(spec: Any, std: float, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """A seeded stand-in for one checkpoint tensor, as transformers initializes a LLaMA: matrices (linears,
    embeddings) normal with `std`, biases zeros, other vectors (the norms) ones; drawn on `device`."""
    tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    if len(spec.shape) >= 2:
        return tensor.normal_(0.0, std, generator=generator)
    return tensor.fill_(0.0 if spec.key.endswith("bias") else 1.0)


def write_random_checkpoint(
    folder: Path, config: Any, tokenizer: Any, device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, Any]:
    """Write the causal LM of `config` with seeded random weights (`_random_tensor`) as a safetensors
    checkpoint with `tokenizer` into `folder`, one tensor at a time through the project's checkpoint
    writer (`models.saving.save_streamed`): each drawn on `device` in `dtype`, moved to the CPU, written
    and dropped, so neither memory ever holds the model. → {"bytes": its weights, "seconds": the write}."""
    from transformers import AutoModelForCausalLM

    from tsenor_cli.models.saving import save_streamed, saved_tensors
    from tsenor_cli.models.streaming import skeleton

    start = time.perf_counter()
    model = skeleton(AutoModelForCausalLM, copy.deepcopy(config), dtype)
    specs = saved_tensors(model)
    std = float(getattr(config, "initializer_range", 0.02))
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = ((spec.key, _random_tensor(spec, std, device, generator)) for spec in specs)
    # The bench's own scratch input, written afresh each run and read back at once: written in place,
    # without atomic_dir's fsync of every file, which would add the disk's write of it to the step.
    shutil.rmtree(folder, ignore_errors=True)
    save_streamed(folder, model, tensors)
    tokenizer.save_pretrained(folder)
    return {"bytes": sum(spec.nbytes for spec in specs), "seconds": time.perf_counter() - start}


def _alps_projection(
    result: RunResult, layer_phases: dict[str, dict[str, float]], iterations: dict[str, int], ref: dict[str, float]
) -> None:
    """Fill result's ALPS fields: per layer iterations and loop seconds (method + solver), the
    cost per iteration, and the run's seconds with each layer's loop at the SmolLM2 iterations."""
    loop_total = projected_loop = 0.0
    its_total = 0
    for name, its in iterations.items():
        phases = layer_phases.get(name, {})
        loop = phases.get("method", 0.0) + phases.get("solver", 0.0)
        ref_its = ref.get(_local_name(name))
        result.alps_layers.append(
            {"name": name, "iterations": its, "loop_seconds": loop, "reference_iterations": ref_its}
        )
        loop_total += loop
        its_total += its
        if ref_its is not None and its:
            projected_loop += loop / its * ref_its
    if not its_total:
        return
    result.alps_iterations_mean = its_total / len(iterations)
    result.alps_seconds_per_iteration = loop_total / its_total
    if ref and all(_local_name(name) in ref for name in iterations):
        result.reference_iterations_mean = statistics.fmean(ref[_local_name(name)] for name in iterations)
        result.seconds_at_reference_iterations = result.seconds - loop_total + projected_loop


def _whole_model(seconds: float, phases: dict[str, float], params_ratio: float, blocks_ratio: float) -> float:
    """The whole model's seconds from a run on its first blocks: fixed phases once, the checkpoint write
    by parameters, the rest by blocks."""
    fixed = sum(phases.get(name, 0.0) for name in FIXED_PHASES)
    write = phases.get("write", 0.0)
    return fixed + write * params_ratio + (seconds - fixed - write) * blocks_ratio


def _check_choices(cfg: E2EConfig) -> None:
    """UsageError for an unknown method, pattern kind or refine mode in `cfg`."""
    unknown = [x for x in cfg.methods if x not in METHODS]
    if unknown:
        raise UsageError(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    bad_kinds = [x for x in cfg.kinds if x not in ("transposable", "ordinary")]
    if bad_kinds:
        raise UsageError(f"--kinds: unknown {', '.join(bad_kinds)}; choose from transposable, ordinary")
    bad_modes = [x for x in cfg.refine if x not in REFINE_MODES]
    if bad_modes or not cfg.refine:
        raise UsageError(f"--refine: unknown {', '.join(bad_modes) or 'empty list'}; choose from none, block")


def check_pattern_fits(config: Any, n: int, m: int, kinds: tuple[str, ...], model: str) -> None:
    """UsageError, before any model is built, when M does not divide the widths the pattern runs along:
    every linear's input width (hidden, intermediate, heads × head_dim), and for transposable its output
    width too (the key/value projections' kv heads × head_dim)."""
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    widths = {int(config.hidden_size), int(config.intermediate_size), int(config.num_attention_heads) * head_dim}
    if "transposable" in kinds:
        widths.add(kv * head_dim)
    bad = sorted(w for w in widths if w % m)
    if bad:
        raise UsageError(
            f"--nm {n}:{m}: M={m} does not divide the linear widths {', '.join(map(str, bad))} of {model}; "
            "choose an M that divides them, e.g. --nm 16:32 or 2:4"
        )


def _tokenizer(cfg: E2EConfig, ctx: RunContext, config: Any) -> Any:
    """The SmolLM2 tokenizer (cfg.tokenizer's folder, or the embedded model's), checked against the vocabulary."""
    from transformers import AutoTokenizer

    from tsenor_cli.models.embedded import materialize

    if cfg.tokenizer is not None and not (cfg.tokenizer / "tokenizer.json").is_file():
        raise InputNotFoundError(
            f"--tokenizer {cfg.tokenizer} holds no tokenizer.json; pass a folder with the SmolLM2 tokenizer files"
        )
    tokenizer_dir = cfg.tokenizer if cfg.tokenizer is not None else materialize("smollm2-135m", ctx.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(tokenizer) > int(config.vocab_size):
        raise BadInputError(
            f"the SmolLM2 tokenizer has {len(tokenizer)} ids, more than the {config.vocab_size} of {cfg.model}; "
            "pass a model shape whose vocabulary is at least that large"
        )
    return tokenizer


def _shape(cfg: E2EConfig, config: Any, layers: int, dtype: torch.dtype, tokenizer: Any) -> dict[str, Any]:
    """What the run's model is: the shape, the built and whole parameter counts, dtype and tokenizer."""
    from tsenor_cli.models.loading import meta_model

    full_config, _ = shape_config(cfg.model, None, cfg.scale_down)
    return {
        "model": cfg.model,
        "config": str(config_path(cfg.model)),
        "layers": layers,
        "blocks_built": int(config.num_hidden_layers),
        "scale_down": cfg.scale_down,
        "hidden": int(config.hidden_size),
        "intermediate": int(config.intermediate_size),
        "vocab": int(config.vocab_size),
        "params": sum(p.numel() for p in meta_model(full_config).parameters()),
        "params_built": sum(p.numel() for p in meta_model(config).parameters()),
        "dtype": str(dtype).removeprefix("torch."),
        "tokenizer": f"SmolLM2's tokenizer, {len(tokenizer)} ids used unchanged as ids < {config.vocab_size}",
        "source": "streamed" if cfg.stream else "held",
    }


def run_e2e(
    cfg: E2EConfig, ctx: RunContext, work_dir: Path | None = None, progress: Progress | None = None
) -> E2EResult:
    """Build the shape, and for each method × kind run `prune_model` on a fresh copy of the random model
    with the phases recorded; verify each checkpoint. work_dir: where the model folder and outputs go
    (a temporary folder when None, removed at the end)."""
    from tsenor_cli.models.loading import default_dtype, parse_dtype, resolve_device

    say = sink(progress)
    _check_choices(cfg)
    device = resolve_device(cfg.device)
    dtype = parse_dtype(cfg.dtype) or default_dtype(device)
    config, layers = shape_config(cfg.model, cfg.blocks, cfg.scale_down)
    check_pattern_fits(config, cfg.n, cfg.m, cfg.kinds, cfg.model)
    tokenizer = _tokenizer(cfg, ctx, config)
    shape = _shape(cfg, config, layers, dtype, tokenizer)
    say(
        f"{cfg.model}: {shape['blocks_built']}/{layers} blocks, "
        f"{shape['params_built'] / 1e9:.3f}B of {shape['params'] / 1e9:.3f}B params"
    )
    say(f"calibration tokens: {shape['tokenizer']}")
    own_dir = work_dir is None
    root = Path(tempfile.mkdtemp(prefix="tsenor-bench-prune-")) if work_dir is None else work_dir
    try:
        folder = root / "model"
        if cfg.stream:
            say(f"writing the random weights to {folder}, one tensor at a time")
            shape["checkpoint"] = write_random_checkpoint(folder, config, tokenizer, device, dtype, cfg.seed)
        else:
            config.save_pretrained(folder)  # the plan and the checkpoint read the shape from here
            tokenizer.save_pretrained(folder)
        runs = [
            _one_run(cfg, ctx, _Target(folder, root, config, tokenizer, device, dtype, shape), run, say)
            for run in itertools.product(cfg.methods, cfg.kinds, cfg.refine)
        ]
    finally:
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
    env = environment(device)
    env["cpu_rss_high_water_bytes"] = _rss_high_water()
    config_dict = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    return E2EResult(config=config_dict, environment=env, shape=shape, runs=runs)


@dataclass(frozen=True)
class _Target:
    """What every run of one `run_e2e` prunes: the saved shape folder, the work root, the transformers
    config, the tokenizer, the compute device and dtype, and the shape record."""

    folder: Path
    root: Path
    config: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    shape: dict[str, Any]


def _one_run(
    cfg: E2EConfig, ctx: RunContext, target: _Target, run: tuple[str, str, str], say: Callable[[str], None]
) -> RunResult:
    """One `prune_model` run of `run`, a method × kind × refine, on a fresh random model (or, streamed, on
    the random checkpoint), timed phase by phase, its checkpoint verified then removed, the ALPS and
    whole-model projections filled in."""
    method, kind, refine = run
    from tsenor_cli.pruning.plan.plan import plan_model
    from tsenor_cli.pruning.run.verify import verify_checkpoint
    from tsenor_cli.pruning.settings.recipe import build_config

    prune_cfg = build_config(
        _recipe(cfg, target, method, kind, refine), force=True, resume=cfg.resume_state, command="tsenor bench prune"
    )
    plan = plan_model(prune_cfg, ctx)
    report, seconds, recorder, (start_rss, peak_rss) = _timed_prune(cfg, ctx, target, prune_cfg, say)
    assert prune_cfg.output is not None
    verified = verify_checkpoint(prune_cfg.output).ok
    shutil.rmtree(prune_cfg.output)
    phases = {name: recorder.seconds.get(name, 0.0) for name in _phase_names(cfg.refine)}
    peak = recorder.peak if target.device.type == "cuda" else None
    host_estimate = plan.host_memory.total
    over, added = None, None
    if start_rss is not None and peak_rss is not None:
        over, added = peak_rss / host_estimate, (peak_rss - start_rss) / host_estimate
    result = RunResult(
        method=method,
        kind=kind,
        pattern=prune_cfg.pattern.label,
        solver=prune_cfg.solver_that_runs(target.device),
        seconds=seconds,
        phases=phases,
        other_seconds=seconds - sum(phases.values()),
        peak_bytes=peak,
        phase_peak_bytes=dict(recorder.peaks),
        estimate_bytes=plan.device_bytes,
        peak_over_estimate=peak / plan.device_bytes if peak is not None else None,
        verified=verified,
        refine=refine,
        host_start_bytes=start_rss,
        host_peak_bytes=peak_rss,
        host_estimate_bytes=host_estimate,
        host_peak_over_estimate=over,
        host_added_over_estimate=added,
        host_phase_peak_bytes=dict(recorder.host_peaks),
    )
    if method == "alps":
        iterations = {r.name: r.iterations for r in report.layers if r.status == "pruned"}
        ref = reference_iterations(cfg.reference_runs, kind == "transposable", cfg.n, cfg.m)
        _alps_projection(result, recorder.layers, iterations, ref)
    _project_whole(result, target.shape, default_tokens() / (cfg.nsamples * cfg.seqlen))
    say(f"{method} {kind} refine {refine}: {seconds:.1f}s, verified {verified}")
    return result


def _recipe(cfg: E2EConfig, target: _Target, method: str, kind: str, refine: str) -> dict[str, Any]:
    """The `tsenor prune` recipe of one run of the benchmark."""
    return {
        "model": str(target.folder),
        "nm": f"{cfg.n}:{cfg.m}",
        "transposable": kind == "transposable",
        "method": method,
        "solver": cfg.solver,
        "nsamples": cfg.nsamples,
        "seqlen": cfg.seqlen,
        "seed": cfg.seed,
        "dtype": str(target.dtype).removeprefix("torch."),
        "device": str(target.device),
        "output": str(target.root / f"out-{method}-{kind}-{refine}"),
        "refine": refine,
        "stream": cfg.stream,  # a held model is planned as held: its host estimate counts the whole model
    }


def _timed_prune(
    cfg: E2EConfig, ctx: RunContext, target: _Target, prune_cfg: Any, say: Callable[[str], None]
) -> tuple[Any, float, Any, tuple[int | None, int | None]]:
    """`prune_model` under the phase recorder: on a fresh random model held in memory, or streamed from
    the random checkpoint in `target.folder` → (its report, its seconds, the recorder, (the resident set
    at its start, its peak), both None where the kernel cannot reset the peak)."""
    from tsenor_cli.models.loading import LoadedModel
    from tsenor_cli.models.streaming import trim_heap
    from tsenor_cli.models.structure import discover_structure
    from tsenor_cli.phases import record_phases
    from tsenor_cli.pruning.run.api import prune_model

    loaded = None
    if not cfg.stream:
        say(f"{prune_cfg.method} {prune_cfg.pattern.label}: building the random model")
        model = build_random_model(target.config, target.device, target.dtype, cfg.seed)
        loaded = LoadedModel(model, target.tokenizer, cfg.model, str(target.folder), discover_structure(model))
        del model
    gc.collect()  # what the last run left, before this one's peak is measured
    trim_heap()
    # The recording resets the high-water mark at its start (the resident set then is its first `host_peak`)
    # and at each phase boundary, and keeps the peak over them.
    with record_phases(target.device) as recorder:
        start_rss = recorder.host_peak
        if start_rss is None:
            say("host peak not measured: this kernel cannot reset the peak resident set (/proc/self/clear_refs)")
        start = time.perf_counter()
        report = prune_model(prune_cfg, ctx, say, built=loaded)
        seconds = time.perf_counter() - start
    return report, seconds, recorder, (start_rss, recorder.host_peak)


def default_tokens() -> int:
    """The calibration tokens of `tsenor prune`'s defaults (--nsamples × --seqlen)."""
    from tsenor_cli.fields import by_name
    from tsenor_cli.pruning.settings.table import PRUNE_FIELDS

    settings = by_name(PRUNE_FIELDS)
    return int(settings["nsamples"].default) * int(settings["seqlen"].default)


def _at_tokens(seconds: float, phases: dict[str, float], ratio: float) -> tuple[float, dict[str, float]]:
    """(seconds, phases) of the run on `ratio` × its calibration tokens: `TOKEN_PHASES` scaled, the rest kept."""
    scaled = {name: value * ratio if name in TOKEN_PHASES else value for name, value in phases.items()}
    return seconds + sum(scaled.values()) - sum(phases.values()), scaled


def _project_whole(result: RunResult, shape: dict[str, Any], tokens_ratio: float = 1.0) -> None:
    """Fill result's whole-model projections when only the first blocks were built; with `tokens_ratio`
    > 1 (the default calibration's tokens over the run's) also the whole model at the default calibration."""
    if shape["blocks_built"] >= shape["layers"]:
        return
    params_ratio, blocks_ratio = shape["params"] / shape["params_built"], shape["layers"] / shape["blocks_built"]
    result.projected_whole_seconds = _whole_model(result.seconds, result.phases, params_ratio, blocks_ratio)
    if result.seconds_at_reference_iterations is not None:
        result.projected_whole_seconds_at_reference_iterations = _whole_model(
            result.seconds_at_reference_iterations, result.phases, params_ratio, blocks_ratio
        )
    if tokens_ratio > 1:
        seconds, phases = _at_tokens(result.seconds, result.phases, tokens_ratio)
        result.projected_whole_seconds_default_calibration = _whole_model(seconds, phases, params_ratio, blocks_ratio)


def _phase_names(refine: Any) -> tuple[str, ...]:
    """The phase columns: PHASES, less REFINE_PHASES unless some run refines (`refine`: the modes run)."""
    refines = any(mode != "none" for mode in refine)
    return tuple(name for name in PHASES if refines or name not in REFINE_PHASES)


def _label(run: RunResult) -> str:
    """The method as the tables name it: "alps", or "alps + refine" for a refined run."""
    return run.method if run.refine == "none" else f"{run.method} + refine"


def _gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.3g}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _alps_lines(runs: list[RunResult]) -> list[str]:
    """The ALPS iterations table (none when no run was ALPS)."""
    alps = [run for run in runs if run.alps_iterations_mean is not None]
    if not alps:
        return []
    lines = [
        "",
        "ALPS: mean iterations per layer on these random weights, loop seconds per iteration (method + "
        "solver), and the run at the mean iterations of the same linear on the real SmolLM2 "
        "(docs/results/runs):",
        "",
        "| pattern | iterations (random) | s / iteration | iterations (SmolLM2) | measured s "
        "| s at SmolLM2 iterations |",
        "|---|---|---|---|---|---|",
    ]
    for run in alps:
        spi = run.alps_seconds_per_iteration
        ref = run.reference_iterations_mean
        lines.append(
            f"| {run.kind} {run.pattern}{' + refine' if run.refine != 'none' else ''} | "
            f"{run.alps_iterations_mean:.1f} | "
            f"{'–' if spi is None else f'{spi:.4f}'} | {'–' if ref is None else f'{ref:.1f}'} | "
            f"{run.seconds:.1f} | {_s(run.seconds_at_reference_iterations)} |"
        )
    return lines


def to_markdown(result: E2EResult) -> str:
    """The run's tables: phases and memory per run, then ALPS iterations and the projections."""
    env, shape = result.environment, result.shape
    device = env.get("gpu", env["device"])
    whole = shape["blocks_built"] == shape["layers"]
    cfg = result.config
    phase_names = _phase_names(cfg.get("refine", ("none",)))
    scaled = (
        f", widths / {shape['scale_down']} (a smoke run, not the published shape)" if shape["scale_down"] > 1 else ""
    )
    lines = [
        f"### {shape['model']} on {device} ({shape['dtype']}, "
        f"{'all' if whole else shape['blocks_built']} of {shape['layers']} blocks{scaled})",
        "",
        f"{cfg['nsamples']} × {cfg['seqlen']} C4 calibration tokens ({shape['tokenizer']}); random weights "
        f"(seed {cfg['seed']}); torch {env['torch']}, transformers {env['transformers']}, {env['date']}. "
        f"Peak device memory: torch.cuda.max_memory_allocated (n/a off CUDA; this process's CPU RSS high-water "
        f"was {_gib(env['cpu_rss_high_water_bytes'])} GiB).",
        "",
        "| method | pattern | solver | "
        + " | ".join(phase_names)
        + " | other | total s | peak GiB | dry-run est. GiB | peak / est. | verified |",
        "|" + "---|" * (len(phase_names) + 9),
    ]
    for run in result.runs:
        ratio = "n/a" if run.peak_over_estimate is None else f"{run.peak_over_estimate:.2f}"
        lines.append(
            f"| {_label(run)} | {run.kind} {run.pattern} | {run.solver or '–'} | "
            + " | ".join(f"{run.phases[name]:.2f}" for name in phase_names)
            + f" | {run.other_seconds:.2f} | {run.seconds:.1f} | {_gib(run.peak_bytes)} | "
            f"{_gib(run.estimate_bytes)} | {ratio} | {'yes' if run.verified else 'NO'} |"
        )
    lines += _alps_lines(result.runs)
    ratios = transposable_ratios(result.runs)
    if ratios:
        lines += ["", "Transposable / ordinary wall time (same run of the benchmark):", ""]
        lines += ["| method | measured | at SmolLM2 iterations |", "|---|---|---|"]
        for method, (measured, at_ref) in ratios.items():
            lines.append(f"| {method} | {measured:.2f} | {'–' if at_ref is None else f'{at_ref:.2f}'} |")
    refined = refine_ratios(result.runs)
    if refined:
        lines += ["", "With / without `--refine block` wall time (same run of the benchmark):", ""]
        lines += ["| method | pattern | plain s | refined s | refined / plain |", "|---|---|---|---|---|"]
        for (method, pattern), (plain, with_refine) in refined.items():
            lines.append(f"| {method} | {pattern} | {plain:.1f} | {with_refine:.1f} | {with_refine / plain:.2f} |")
    lines += _host_lines(result)
    if not whole:
        lines += _projection_lines(result)
    return "\n".join(lines) + "\n"


def _source_line(shape: dict[str, Any]) -> str:
    """How the runs read the weights: held in memory, or streamed from the random checkpoint."""
    written = shape.get("checkpoint")
    if shape.get("source") != "streamed" or written is None:
        return "The random model is held in memory (`prune_model(built=…)`)."
    return (
        f"Streamed: the random weights were written to a safetensors checkpoint of {_gib(written['bytes'])} GiB "
        f"in {written['seconds']:.1f} s (not part of the runs' seconds), then each run pruned it as "
        "`tsenor prune --stream` does, one block read at a time."
    )


def _host_lines(result: E2EResult) -> list[str]:
    """The host memory table: each run's resident set at its start and its peak, against the dry run's
    host estimate (which counts the weights, tokens, activations and work, not Python's own runtime:
    `RunResult`)."""
    lines = [
        "",
        _source_line(result.shape)
        + " Host memory: this process's resident set when the run started (Python, torch, a CUDA context, a "
        "held model) and its peak during the run (VmHWM, reset at the start), against the dry run's host "
        "estimate (`tsenor prune --dry-run`; the memory it is checked against is read by a process whose "
        "runtime is resident already, so (peak − start) / est. is the estimate's own error):",
        "",
        "| method | pattern | at start GiB | peak GiB | dry-run host est. GiB | peak / est. | (peak − start) / est. "
        "| peak in |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in result.runs:
        where = host_peak_phases(run.host_peak_bytes, run.host_phase_peak_bytes)
        lines.append(
            f"| {_label(run)} | {run.kind} {run.pattern} | {_gib(run.host_start_bytes)} | "
            f"{_gib(run.host_peak_bytes)} | {_gib(run.host_estimate_bytes)} | {_ratio(run.host_peak_over_estimate)} | "
            f"{_ratio(run.host_added_over_estimate)} | {where} |"
        )
    return lines


def host_peak_phases(peak: int | None, phase_peaks: dict[str, int]) -> str:
    """The phases whose host peak (`phase_peaks`, `RunResult.host_phase_peak_bytes`) is the run's `peak`
    ("statistics, solver": a phase and one nested in it), "outside the phases" when none reached it, "–"
    where the peak was not measured."""
    if peak is None or not phase_peaks:
        return "–"
    at_peak = [name for name, high in phase_peaks.items() if high == peak]
    order = {name: index for index, name in enumerate(PHASES)}
    return ", ".join(sorted(at_peak, key=lambda name: order.get(name, len(order)))) if at_peak else "outside the phases"


def _projection_lines(result: E2EResult) -> list[str]:
    """The projection of the whole model from its first blocks, labelled a projection."""
    shape, cfg = result.shape, result.config
    tokens = f"{cfg['nsamples']} × {cfg['seqlen']}"
    lines = [
        "",
        f"**Projection** to all {shape['layers']} blocks (not measured): calibration + capture once, the "
        f"checkpoint write × {shape['params']}/{shape['params_built']} parameters, the rest × "
        f"{shape['layers']}/{shape['blocks_built']} blocks. At `tsenor prune`'s default calibration "
        f"({default_tokens()} tokens, where the run had {tokens}): the phases that grow with the tokens "
        f"({', '.join(TOKEN_PHASES)}) scaled by the ratio, the rest as measured.",
        "",
        "| method | pattern | projected whole-model s | projected at SmolLM2 iterations s "
        "| projected at the default calibration s |",
        "|---|---|---|---|---|",
    ]
    for run in result.runs:
        lines.append(
            f"| {_label(run)} | {run.kind} {run.pattern} | {_s(run.projected_whole_seconds)} | "
            f"{_s(run.projected_whole_seconds_at_reference_iterations)} | "
            f"{_s(run.projected_whole_seconds_default_calibration)} |"
        )
    return lines


def transposable_ratios(runs: list[RunResult]) -> dict[str, tuple[float, float | None]]:
    """{method ("alps", or "alps + refine"): (transposable seconds / ordinary seconds, the same at
    SmolLM2's ALPS iterations or None)} for the methods that ran both kinds."""
    by_key = {(_label(run), run.kind): run for run in runs}
    ratios: dict[str, tuple[float, float | None]] = {}
    for method in dict.fromkeys(_label(run) for run in runs):
        t_run, o_run = by_key.get((method, "transposable")), by_key.get((method, "ordinary"))
        if t_run is None or o_run is None:
            continue
        t_ref, o_ref = t_run.seconds_at_reference_iterations, o_run.seconds_at_reference_iterations
        at_ref = t_ref / o_ref if t_ref is not None and o_ref is not None else None
        ratios[method] = (t_run.seconds / o_run.seconds, at_ref)
    return ratios


def refine_ratios(runs: list[RunResult]) -> dict[tuple[str, str], tuple[float, float]]:
    """{(method, "kind pattern"): (plain seconds, refined seconds)} for the method × kind pairs that ran
    both with and without `--refine block`."""
    by_key = {(run.method, run.kind, run.refine): run for run in runs}
    pairs: dict[tuple[str, str], tuple[float, float]] = {}
    for run in runs:
        refined = by_key.get((run.method, run.kind, "block"))
        if run.refine == "none" and refined is not None:
            pairs[(run.method, f"{run.kind} {run.pattern}")] = (run.seconds, refined.seconds)
    return pairs


def section_key(result: E2EResult) -> str:
    """What one section of the Markdown file is for: the shape, blocks, streamed or held, device, methods
    (and the refine modes, when not only "none")."""
    env, shape = result.environment, result.shape
    scaled = f"/scale-{shape['scale_down']}" if shape["scale_down"] > 1 else ""
    methods = ",".join(result.config["methods"])
    modes = list(result.config.get("refine", ["none"]))
    refine = "" if modes == ["none"] else f"/refine-{','.join(modes)}"
    streamed = "/streamed" if shape.get("source") == "streamed" else ""
    return (
        f"{shape['model']}/{shape['blocks_built']}-of-{shape['layers']}{scaled}{streamed}/{env['device']}/"
        f"{methods}{refine}"
    )


def merge_section(existing: str, key: str, table: str) -> str:
    """`existing` Markdown with the section marked for `key` replaced by `table` (appended when absent);
    sections of other shapes and devices, and text before the first section, are kept."""
    mark = MARK.format(key=key)
    begin, end = f"{mark}\n", f"<!-- end {key} -->\n"
    block = f"{begin}{table}{end}"
    if begin in existing and end in existing:
        head, rest = existing.split(begin, 1)
        _, tail = rest.split(end, 1)
        return head + block + tail
    return existing + ("\n" if existing and not existing.endswith("\n\n") else "") + block

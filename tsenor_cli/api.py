"""The Python API in one call each: `from tsenor_cli import prune, evaluate` (docs/guide/python-api.md).

`prune(model, output=..., nm="2:4", method="sparsegpt", recipe=..., **settings)` takes the settings of
`tsenor prune` by their recipe keys (`pruning/settings/table.ALL_FIELDS`, each method's options included), checks
them as the command checks its flags (`validate_recipe`, `build_config`: a bad one is one `UsageError`
naming it and what is allowed, before any work) and runs the same library call, so it writes the same
bytes. `evaluate(model_dir, ppl=..., tasks=..., output=...)` is `tsenor eval`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tsenor_cli.errors import UsageError
from tsenor_cli.pruning.settings.recipe import read_recipe, validate_recipe
from tsenor_cli.pruning.settings.table import FIELDS
from tsenor_cli.settings import RunContext

if TYPE_CHECKING:
    from tsenor_cli.progress import Progress
    from tsenor_cli.runfiles import EvalReport, PruneReport

# What `evaluate` takes besides the datasets and tasks: how the model is loaded, and `EvalConfig`'s fields.
LOAD_OPTIONS = ("dtype", "device", "trust_remote_code", "device_map")
EVAL_OPTIONS = ("num_fewshot", "limit", "batch_size", "seqlen", "max_windows", "stream")


def prune(
    model: str | Path | Any,
    output: str | Path | None = None,
    *,
    recipe: str | Path | Mapping[str, Any] | None = None,
    force: bool = False,
    resume: bool = True,
    ctx: RunContext | None = None,
    tokenizer: Any = None,
    progress: Progress | None = None,
    sinks: Sequence[Any] = (),
    hooks: Sequence[Any] = (),
    **settings: Any,
) -> PruneReport:
    """Prune `model` into `output` → the run's report (what tsenor_report.json holds).

    model: an embedded name (smollm2-135m), a checkpoint folder, a hub id, or a transformers model in
    memory (pruned in place; its config and tokenizer are read from the folder it was loaded from, or
    `tokenizer`). recipe: a YAML recipe file or a mapping of the same keys. settings: any recipe key
    (nm="2:4", method="sparsegpt", nsamples=128, alps_rho0=0.2, …), overriding the recipe as flags
    override `--config`. force / resume: `tsenor prune`'s --force and --resume/--no-resume-state.
    ctx: where calibration data and hub models come from (default: the environment). progress: where
    the run's lines go (default: the `tsenor` logger). sinks / hooks: more sinks and block hooks, run
    after the run's own (`pruning/run/seams.py`: `Sink`, `BlockHook`; docs/guide/python-api.md)."""
    from tsenor_cli.pruning.run import api
    from tsenor_cli.pruning.settings.recipe import build_config

    ctx = ctx if ctx is not None else RunContext.from_environment()
    values = _prune_recipe(model, output, recipe, settings)
    cfg = build_config(values, force=force, resume=resume, command=None)
    _check_calibration_source(cfg.calib_data, ctx)
    # The objects handed to the run as they are (not settings of it).
    if cfg.distill.on:  # the prune, then the distillation into `output` (tsenor_cli/compress.py)
        if not isinstance(model, str | Path) or sinks or hooks:
            raise UsageError(
                "distill_steps runs from a checkpoint path, without extra sinks or hooks; pass the model's folder, "
                "or prune with distill_steps=0 and fine-tune after (tsenor finetune --teacher)"
            )
        from tsenor_cli.compress import compress

        return compress(cfg, ctx, progress=progress).prune
    objects: dict[str, Any] = {"tokenizer": tokenizer, "ctx": ctx, "progress": progress, "sinks": sinks, "hooks": hooks}
    return api.prune(model, cfg, **objects)


def _prune_recipe(
    model: str | Path | Any, output: str | Path | None, recipe: str | Path | Mapping[str, Any] | None, settings: dict
) -> dict[str, Any]:
    """The run's recipe: `recipe`'s keys, then `settings` over them, with the model and output given as
    arguments; every key and value checked (`validate_recipe`), the model given once."""
    if recipe is None:
        base: dict[str, Any] = {}
    elif isinstance(recipe, Mapping):
        base = validate_recipe(recipe, "prune(recipe=...)")
    else:
        base = read_recipe(Path(recipe))
    given = validate_recipe(settings, "prune()")  # `model` is this function's own argument, never a setting
    folder = str(model) if isinstance(model, str | Path) else str(getattr(model, "name_or_path", "") or "")
    if not folder:
        raise UsageError(
            "prune(): a model in memory is pruned with the config and tokenizer of the folder it was loaded from, "
            "and this one's name_or_path is empty; save it (save_pretrained) and pass the folder"
        )
    if base.get("model") not in (None, folder):
        raise UsageError(f"prune(): the model {folder} and the recipe's model {base['model']} differ; give it once")
    values = {**base, **given, "model": folder}
    if output is not None:
        values["output"] = str(output)
    return values


def _check_calibration_source(calib_data: str, ctx: RunContext) -> None:
    """A named calibration text with the hub off and no data folder: said before the model loads."""
    from tsenor_cli.data.sources import NAMED_TEXTS, data_folder

    if calib_data in NAMED_TEXTS:
        data_folder(ctx, calib_data)


def evaluate(
    model: str | Path,
    *,
    ppl: str | Sequence[str] | None = None,
    tasks: str | Sequence[str] | None = None,
    output: str | Path | None = None,
    force: bool = False,
    ctx: RunContext | None = None,
    **options: Any,
) -> EvalReport:
    """Evaluate `model` (an embedded name, checkpoint folder or hub id) → its `EvalReport`, written as
    `output`/eval.json when `output` is given (an existing one only with `force`), as `tsenor eval` does.

    ppl: perplexity datasets ("wikitext2,c4", a list, or "none"; default all three); tasks: zero-shot
    tasks (lm-eval). options: `LOAD_OPTIONS` (dtype, device, trust_remote_code, device_map) and
    `EVAL_OPTIONS` (num_fewshot, limit, batch_size, seqlen, max_windows, stream: None streams where it
    can, True insists, False loads the model whole), as `tsenor eval`'s flags of the same names."""
    from tsenor_cli.evaluation.runner import EvalConfig, EvalModel, evaluate_into
    from tsenor_cli.models.loading import LoadOptions

    unknown = sorted(set(options) - {*LOAD_OPTIONS, *EVAL_OPTIONS})
    if unknown:
        allowed = ", ".join(("ppl", "tasks", "output", "force", "ctx", *LOAD_OPTIONS, *EVAL_OPTIONS))
        raise UsageError(f"evaluate(): unknown option {unknown[0]!r}; known: {allowed}")
    ctx = ctx if ctx is not None else RunContext.from_environment()
    stream = options.get("stream")
    settings: dict[str, Any] = {key: options[key] for key in EVAL_OPTIONS if key in options and key != "stream"}
    if ppl is not None:
        settings["ppl_datasets"] = _names(ppl, "ppl")
    cfg = EvalConfig(**settings, tasks=_tasks(tasks), stream=stream is not False)
    cfg.check(ctx, stream=bool(stream), device_map=options.get("device_map"))
    # The model's dtype and device default as `tsenor prune`'s and `tsenor eval`'s do (one declaration).
    dtype, device = options.get("dtype", FIELDS["dtype"].default), options.get("device", FIELDS["device"].default)
    how = {key: options[key] for key in ("trust_remote_code", "device_map") if key in options}
    load = LoadOptions(**how, check_tokenizer=True)
    target = Path(output) if output is not None else None
    return evaluate_into(EvalModel(str(model), dtype, device, load), cfg, ctx, output=target, force=force)


def _names(value: str | Sequence[str], what: str) -> tuple[str, ...]:
    """A comma-separated string ("a,b"; "" or "none": none) or a sequence of names → the names."""
    if isinstance(value, str):
        if value.strip().lower() in ("", "none"):
            return ()
        value = value.split(",")
    names = tuple(str(item).strip() for item in value)
    if any(not name for name in names):
        raise UsageError(f"{what} {value!r} has an empty name; pass names like ['wikitext2', 'c4']")
    return names


def _tasks(tasks: str | Sequence[str] | None) -> tuple[str, ...]:
    """Zero-shot task names, checked against the offline task definitions (lm-eval) before any model loads."""
    names = _names(tasks, "tasks") if tasks is not None else ()
    if not names:
        return ()
    from tsenor_cli.evaluation.zeroshot import validate_tasks

    return validate_tasks(names)

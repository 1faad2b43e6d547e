"""Sweep files: a grid of prune recipes, the evaluation after each prune, and SLURM options.

A sweep file (YAML) has the top-level keys

- ``base``: a recipe, i.e. the keys `tsenor prune --config` takes (checked by the same validator,
  `tsenor_cli.pruning.settings.recipe.validate_recipe`), except ``output``, which the sweep sets per run;
- ``axes``: recipe key → non-empty list of values; the runs are their cartesian product, the first
  axis outermost;
- ``eval``: ``ppl`` (datasets), ``tasks`` (zero-shot), ``limit``, ``max_windows``, ``seqlen`` (passed
  to `tsenor eval`), ``dense`` (also evaluate each model unpruned: a run named ``dense``, or
  ``dense-MODEL`` when ``model`` is an axis) and ``keep_checkpoint`` (false: delete the pruned
  weights once evaluated, keeping the reports);
- ``name`` (optional): a run-name template such as ``"{method}-{nm}-{transposable:t|o}"``;
- ``slurm`` (optional): executor options (`SlurmOptions`).

`load_sweep` refuses anything else with one line (`UsageError`) before a run is written or
submitted: unknown keys, an empty axis, a wrongly typed value, a recipe `tsenor prune` would refuse,
two runs with the same name.
"""

from __future__ import annotations

import itertools
import math
import re
import string
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tsenor_cli.errors import TsenorError, UsageError
from tsenor_cli.fields import unknown_key
from tsenor_cli.pruning.settings.recipe import build_config, overlay, validate_recipe
from tsenor_cli.yamlfile import read_yaml

TOP_KEYS = ("base", "axes", "eval", "name", "slurm")
# eval key → the types its value may have (a list's items are checked separately).
EVAL_KEYS: dict[str, tuple[type, ...]] = {
    "ppl": (list,),
    "tasks": (list,),
    "limit": (int, float),
    "max_windows": (int,),
    "seqlen": (int,),
    "dense": (bool,),
    "keep_checkpoint": (bool,),
}
SLURM_KEYS: dict[str, tuple[type, ...]] = {
    "partition": (str,),
    "account": (str,),
    "qos": (str,),
    "time": (str, int),
    "gpus_per_task": (int,),
    "cpus_per_task": (int,),
    "mem": (str,),
    "array_parallelism": (int,),
    "sbatch": (dict,),
    "setup": (list,),
}
# Without --time submitit would ask for 5 minutes; an hour fits a SmolLM2 run with evaluation.
DEFAULT_TIME_MIN = 60
# More runs than this is likely a mistake in the axes (two lists of a thousand values); --max-runs raises it.
MAX_RUNS = 10_000
DENSE_NAME = "dense"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]+")


def _is_type(value: Any, types: tuple[type, ...]) -> bool:
    """isinstance, except that a YAML bool is never an int or a float."""
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types)


def name_part(value: Any) -> str:
    """A recipe value as part of a directory name: `16:32` → `16x32`, `True` → `true`, lists joined by `+`.

    Characters other than letters, digits and `_.+-` become `-` (a model path `/a/b` → `a-b`).
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "+".join(name_part(item) for item in value)
    return _UNSAFE.sub("-", str(value).replace(":", "x")).strip("-.") or "-"


class _NameValue:
    """A recipe value inside a name template: `{transposable:t|o}` picks `t` for true, `o` for false;
    any other format spec is Python's (`{seed:03d}`); the result goes through `name_part`."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __format__(self, spec: str) -> str:
        if isinstance(self.value, bool) and "|" in spec:
            yes, no = spec.split("|", 1)
            return yes if self.value else no
        return name_part(format(self.value, spec) if spec else self.value)


@dataclass(frozen=True)
class EvalSpec:
    """What `tsenor eval` runs after each prune; None = that command's default."""

    ppl: tuple[str, ...] | None = None
    tasks: tuple[str, ...] = ()
    limit: int | float | None = None
    max_windows: int | None = None
    seqlen: int | None = None
    dense: bool = False
    keep_checkpoint: bool = True

    def datasets(self) -> tuple[str, ...]:
        """The perplexity datasets evaluated (`tsenor eval`'s default when `ppl` is not given)."""
        from tsenor_cli.data.sources import DATASET_NAMES

        return self.ppl if self.ppl is not None else DATASET_NAMES

    def eval_args(self) -> tuple[str, ...]:
        """`tsenor eval` flags for these settings (only the ones given, so its defaults stay its own)."""
        args: list[str] = []
        if self.ppl is not None:
            args += ["--ppl", ",".join(self.ppl) or "none"]
        if self.tasks:
            args += ["--tasks", ",".join(self.tasks)]
        if self.limit is not None:
            args += ["--limit", str(self.limit)]
        if self.max_windows is not None:
            args += ["--max-windows", str(self.max_windows)]
        if self.seqlen is not None:
            args += ["--seqlen", str(self.seqlen)]
        return tuple(args)

    def covered_by(self, record: Mapping[str, Any]) -> bool:
        """Whether an eval.json payload holds everything asked for: each perplexity dataset with the
        same window cap, and each zero-shot task at the same document limit.

        The window length is not compared: eval.json records it after capping by the model's context,
        so a request of 2048 on a 512-token model would never match. Change the output directory to
        re-evaluate with another --seqlen.
        """
        perplexity = record.get("perplexity") or {}
        if not set(self.datasets()) <= set(perplexity):
            return False
        if self.datasets() and record.get("max_windows") != self.max_windows:
            return False
        if self.tasks:
            zeroshot = record.get("zeroshot") or {}
            if not set(self.tasks) <= set(zeroshot.get("tasks") or {}) or zeroshot.get("limit") != self.limit:
                return False
        return True


def parse_time(value: str | int, where: str) -> int:
    """SLURM's time formats → whole minutes (rounded up): MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    if isinstance(value, int):
        minutes = value
    else:
        match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
        if match is None:
            raise UsageError(f"{where} {value!r} is not a SLURM time; use minutes, HH:MM:SS or D-HH:MM:SS")
        days, a, b, c = match.groups()
        parts = [int(x) for x in (a, b, c) if x is not None]
        if days is not None:
            # D-HH, D-HH:MM, D-HH:MM:SS
            hours, mins, secs = [*parts, 0, 0][:3]
            seconds = ((int(days) * 24 + hours) * 60 + mins) * 60 + secs
        elif len(parts) == 3:
            seconds = (parts[0] * 60 + parts[1]) * 60 + parts[2]
        elif len(parts) == 2:
            seconds = parts[0] * 60 + parts[1]
        else:
            seconds = parts[0] * 60
        minutes = -(-seconds // 60)
    if minutes < 1:
        raise UsageError(f"{where} {value!r} must be at least one minute")
    return minutes


@dataclass(frozen=True)
class SlurmOptions:
    """sbatch options of the job array. time_min: the limit per task; sbatch: extra `--KEY=VALUE`
    options; setup: shell lines run before the task (e.g. `module load cuda`)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = DEFAULT_TIME_MIN
    gpus_per_task: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    array_parallelism: int | None = None
    sbatch: tuple[tuple[str, str], ...] = ()
    setup: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key, least in (("gpus_per_task", 0), ("cpus_per_task", 1), ("array_parallelism", 1)):
            value = getattr(self, key)
            if value is not None and value < least:
                raise UsageError(f"slurm {key} must be at least {least}, got {value}")

    def executor_parameters(self, job_name: str) -> dict[str, Any]:
        """Keyword arguments of submitit's `SlurmExecutor.update_parameters`."""
        params: dict[str, Any] = {"job_name": job_name, "time": self.time_min}
        for key in ("partition", "account", "qos", "gpus_per_task", "cpus_per_task", "mem", "array_parallelism"):
            value = getattr(self, key)
            if value is not None:
                params[key] = value
        if self.sbatch:
            params["additional_parameters"] = dict(self.sbatch)
        if self.setup:
            params["setup"] = list(self.setup)
        return params


@dataclass(frozen=True)
class RunSpec:
    """One point of the grid. recipe: the merged `tsenor prune --config` mapping (for a dense run, the
    model and its load options); values: the axis values that define it."""

    name: str
    recipe: tuple[tuple[str, Any], ...]
    dense: bool = False
    values: tuple[tuple[str, Any], ...] = ()

    def recipe_dict(self) -> dict[str, Any]:
        return dict(self.recipe)


@dataclass(frozen=True)
class SweepSpec:
    """A parsed sweep file; `iter_runs()` is the grid (dense runs first, then the product of the axes)."""

    source: str
    base: tuple[tuple[str, Any], ...] = ()
    axes: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    eval: EvalSpec = field(default_factory=EvalSpec)
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    name: str | None = None

    def count(self) -> int:
        """How many runs `iter_runs` yields, without building them."""
        dense = 0
        if self.eval.dense:
            axis_models = dict(self.axes).get("model")
            dense = len(axis_models) if axis_models is not None else 1
        return dense + math.prod(len(values) for _, values in self.axes)

    def iter_runs(self) -> Iterator[RunSpec]:
        """Every run with its name, one at a time (a grid of millions is never held): the dense runs,
        then the product of the axes, the first axis outermost. Names are checked by `check_names`."""
        base = dict(self.base)
        keys = [key for key, _ in self.axes]
        if self.eval.dense:
            axis_models = dict(self.axes).get("model")
            models = list(axis_models) if axis_models is not None else [base.get("model")]
            load_keys = ("dtype", "device", "trust_remote_code")
            for model in models:
                name = DENSE_NAME if axis_models is None else f"{DENSE_NAME}-{name_part(model)}"
                recipe = {"model": model, **{k: base[k] for k in load_keys if k in base}}
                yield RunSpec(name=name, recipe=tuple(recipe.items()), dense=True)
        for combo in itertools.product(*(values for _, values in self.axes)):
            values = tuple(zip(keys, combo, strict=True))
            recipe = overlay(base, dict(values))
            yield RunSpec(name=self._run_name(recipe, values), recipe=tuple(recipe.items()), values=values)

    def check_names(self) -> None:
        """UsageError when two runs get the same name (one pass keeping only the names)."""
        seen: set[str] = set()
        for run in self.iter_runs():
            if run.name in seen:
                first = next(r for r in self.iter_runs() if r.name == run.name)
                raise UsageError(
                    f"{self.source}: two runs are named {run.name!r} ({_describe(first)} and "
                    f"{_describe(run)}); add the axis that tells them apart to the name template"
                )
            seen.add(run.name)

    def runs(self) -> tuple[RunSpec, ...]:
        """Every run with its name, as a tuple; UsageError when two runs get the same name."""
        self.check_names()
        return tuple(self.iter_runs())

    def _run_name(self, recipe: Mapping[str, Any], values: tuple[tuple[str, Any], ...]) -> str:
        if self.name is None:
            # The axis values only, so adding a key to base keeps every directory name.
            return "_".join(f"{key}-{name_part(value)}" for key, value in values) or "run"
        name = self.name.format_map({key: _NameValue(value) for key, value in recipe.items()})
        return _UNSAFE.sub("-", name).strip("-.") or "run"


def _describe(run: RunSpec) -> str:
    if run.dense:
        return f"dense {dict(run.recipe)['model']}"
    return ", ".join(f"{k}={v}" for k, v in run.values) or "the base recipe"


def load_sweep(path: Path, *, check_runs: bool = True, max_runs: int | None = MAX_RUNS) -> SweepSpec:
    """Read and validate a sweep file. check_runs: also build each run's prune configuration as
    `tsenor prune` would (unknown method or solver, nm and sparsity both set, a missing calibration
    file), which imports the pruning code; `tsenor sweep status` reads its own copy without it.
    max_runs: a grid of more runs is refused before any run is built (None: no limit)."""
    data = read_yaml(path, f"sweep file {path}", "configs/sweeps/table2.yaml")
    spec = parse_sweep(data, str(path))
    count = spec.count()
    if max_runs is not None and count > max_runs:
        raise UsageError(
            f"{path} defines {count} runs, more than --max-runs {max_runs}; shorten its axes, or pass "
            f"--max-runs {count} to run them all"
        )
    spec.check_names()
    if check_runs:
        check_recipes(spec, spec.iter_runs())
    return spec


def parse_sweep(data: Any, source: str) -> SweepSpec:
    """Validate the mapping of a sweep file into a `SweepSpec` (each error: one line naming the key)."""
    if not isinstance(data, dict):
        raise UsageError(f"{source} must hold a mapping with the keys {', '.join(TOP_KEYS)}; fix the file")
    for key in data:
        if key not in TOP_KEYS:
            raise UsageError(f"{source}: unknown top-level key {key!r}; known keys: {', '.join(TOP_KEYS)}")
    raw_base = data.get("base") or {}
    if not isinstance(raw_base, dict):
        raise UsageError(f"{source}: base must be a mapping of recipe keys (those of tsenor prune --config)")
    base = validate_recipe(raw_base, f"{source} base")
    raw_axes = data.get("axes") or {}
    if not isinstance(raw_axes, dict):
        raise UsageError(f"{source}: axes must be a mapping of recipe key → list of values")
    axes: list[tuple[str, tuple[Any, ...]]] = []
    for raw_key, raw_values in raw_axes.items():
        where = f"{source} axes.{raw_key}"
        if not isinstance(raw_values, list):
            raise UsageError(f"{where} must be a list of values, e.g. [alps, wanda]; got {raw_values!r}")
        if not raw_values:
            raise UsageError(f"{where} is empty; give it at least one value or move the key to base")
        checked = [validate_recipe({raw_key: value}, f"{where}[{i}]") for i, value in enumerate(raw_values)]
        key = next(iter(checked[0]))
        if key in base:
            raise UsageError(f"{where} is also set in base; keep it in one of them")
        axes.append((key, tuple(item[key] for item in checked)))
    for key in ("output",):
        if key in base or key in dict(axes):
            raise UsageError(f"{source}: {key} is set by the sweep (DIR/runs/NAME/model); remove it from the file")
    name = data.get("name")
    if name is not None:
        if not isinstance(name, str) or not name.strip():
            raise UsageError(f'{source}: name must be a template string such as "{{method}}-{{nm}}"; got {name!r}')
        _check_template(name, {*base, *dict(axes)}, source)
    return SweepSpec(
        source=source,
        base=tuple(base.items()),
        axes=tuple(axes),
        eval=_parse_eval(data.get("eval"), source),
        slurm=_parse_slurm(data.get("slurm"), source),
        name=name,
    )


def _check_template(template: str, known: set[str], source: str) -> None:
    try:
        fields = [fname for _, fname, _, _ in string.Formatter().parse(template) if fname is not None]
    except ValueError as exc:
        raise UsageError(f"{source}: name template {template!r} is malformed ({exc}); use {{key}} fields") from exc
    for fname in fields:
        if fname not in known:
            raise UsageError(
                f"{source}: name template field {{{fname}}} is not a key of base or axes; "
                f"use one of: {', '.join(sorted(known))}"
            )


def _checked_mapping(raw: Any, keys: Mapping[str, tuple[type, ...]], where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UsageError(f"{where} must be a mapping with the keys {', '.join(keys)}")
    for key, value in raw.items():
        if key not in keys:
            raise unknown_key(where, key, keys)
        if not _is_type(value, keys[key]):
            raise UsageError(f"{where}.{key} must be a {_type_names(keys[key])}, got {value!r}")
    return dict(raw)


def _str_list(values: list[Any], where: str) -> tuple[str, ...]:
    if not all(isinstance(v, str) and v.strip() for v in values):
        raise UsageError(f"{where} must be a list of names, e.g. [piqa, arc_easy]; got {values!r}")
    return tuple(values)


def _parse_eval(raw: Any, source: str) -> EvalSpec:
    from tsenor_cli.evaluation.runner import EvalConfig
    from tsenor_cli.evaluation.zeroshot import validate_tasks

    where = f"{source} eval"
    values = _checked_mapping(raw, EVAL_KEYS, where)
    ppl = _str_list(values["ppl"], f"{where}.ppl") if "ppl" in values else None
    tasks = _str_list(values["tasks"], f"{where}.tasks") if "tasks" in values else ()
    limit = values.get("limit")
    if limit is not None and not (limit >= 1 if isinstance(limit, int) else 0 < limit <= 1):
        raise UsageError(f"{where}.limit {limit!r} must be a document count >= 1 or a fraction in (0, 1]")
    try:
        if tasks:
            validate_tasks(tasks)
        datasets = {} if ppl is None else {"ppl_datasets": ppl}
        config = EvalConfig(
            **datasets,  # type: ignore[arg-type]
            tasks=tasks,
            limit=limit,
            seqlen=values.get("seqlen"),
            max_windows=values.get("max_windows"),
        )
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from exc
    if not config.ppl_datasets and not tasks:
        raise UsageError(f"{where}: nothing to evaluate (ppl is empty and no tasks); add ppl: [wikitext2]")
    return EvalSpec(
        ppl=ppl,
        tasks=tasks,
        limit=limit,
        max_windows=values.get("max_windows"),
        seqlen=values.get("seqlen"),
        dense=values.get("dense", False),
        keep_checkpoint=values.get("keep_checkpoint", True),
    )


def _parse_slurm(raw: Any, source: str) -> SlurmOptions:
    where = f"{source} slurm"
    values = _checked_mapping(raw, SLURM_KEYS, where)
    sbatch = values.pop("sbatch", {})
    if not all(isinstance(k, str) and _is_type(v, (str, int)) for k, v in sbatch.items()):
        raise UsageError(f"{where}.sbatch must map sbatch option names to values, e.g. {{constraint: a100}}")
    setup = _str_list(values.pop("setup", []), f"{where}.setup")
    if "time" in values:
        values["time_min"] = parse_time(values.pop("time"), f"{where}.time")
    try:
        return SlurmOptions(**values, sbatch=tuple((k, str(v)) for k, v in sbatch.items()), setup=setup)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from exc


def check_recipes(spec: SweepSpec, runs: Iterable[RunSpec]) -> None:
    """Build each pruned run's configuration as `tsenor prune --config` would, so a recipe it would
    refuse stops the sweep before anything is written (the model itself is opened only by the run)."""
    for run in runs:
        if run.dense:
            if not run.recipe_dict().get("model"):
                raise UsageError(f"{spec.source}: eval.dense needs a model; set model in base or axes")
            continue
        try:
            build_config(run.recipe_dict(), force=False, resume=True, command="tsenor sweep")
        except TsenorError as exc:
            raise type(exc)(f"{spec.source} run {run.name!r}: {exc}") from exc

"""Recipes: the settings of a pruning run (declared once in `pruning/settings/table.py`) read and frozen.

A recipe is a mapping {key: value} with the keys of `RECIPE_KEYS`. Three places write one:
`tsenor prune`'s flags (generated from the same fields, `cli/options.field_parameters`), its
`--config FILE` and a sweep file's `base` and `axes` (each point of the grid is one recipe). All of them
go through here:

- `validate_recipe`: unknown keys and wrongly typed values are one `UsageError` line;
- `RECIPE_DEFAULTS`: the value of each key left unset (the flags' and `PruneConfig`'s defaults);
- `overlay`: one recipe over another (the flags over `--config`, a sweep's axes over its `base`);
- `build_config`: a validated recipe → the frozen `PruneConfig`, every value checked once there
  (`Field.validate`) and cross-checked (exactly one of nm and sparsity, the method's options, the
  calibration file's contents).

Each method's options are fields too (`option_fields`: `--alps-rho0`, recipe key `alps_rho0`), from the
options class its `PrunerSpec` declares (`pruning/methods/method.py`): those of the built-in and installed
methods in `ALL_FIELDS`, those of a method named `package.module:NAME` added for the recipe naming it.
The benchmarks build their runs' configurations here too, so a recipe means the same run everywhere.
No torch here (`tsenor --help`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tsenor_cli.errors import InputNotFoundError, UsageError
from tsenor_cli.fields import by_name, read_mapping
from tsenor_cli.progress import logger
from tsenor_cli.pruning.methods.registry import get_pruner
from tsenor_cli.pruning.settings.table import (
    DISTILL_KEYS,
    EXAMPLE_RECIPE,
    METHOD_FIELDS,
    RECIPE_DEFAULTS,
    REFINE_KEYS,
    fields_for,
    option_fields,
)
from tsenor_cli.yamlfile import read_yaml

if TYPE_CHECKING:
    from tsenor_cli.pattern import SparsityPattern
    from tsenor_cli.pruning.methods.method import MethodOptions
    from tsenor_cli.pruning.settings.config import PruneConfig


def read_recipe(path: Path) -> dict[str, Any]:
    """A YAML recipe file (`tsenor prune --config`) → {key: value}, validated by `validate_recipe`."""
    where = f"--config {path}"
    data = read_yaml(path, where, EXAMPLE_RECIPE)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{where} must hold a mapping of option: value; fix the file")
    return validate_recipe(data, where)


def validate_recipe(data: Mapping[Any, Any], where: str) -> dict[str, Any]:
    """Check a recipe mapping {option: value} against `RECIPE_KEYS` → {key: value} with `-` spelled `_`.

    `where` starts every error message (e.g. "--config recipe.yaml" or "sweep.yaml base"), so one
    validator serves `tsenor prune --config` and the sweep files' `base` and `axes`. Ints are accepted
    where a float is wanted, and text that reads as a number; bools are never accepted as numbers.
    """
    if "nm" in data and data["nm"] is not None and not isinstance(data["nm"], str):
        raise UsageError(f"{where}: nm must be a pattern N:M such as 16:32, got {data['nm']!r}")
    return read_mapping(data, fields_for(data.get("method")).values(), where)


def overlay(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`top`'s values over `base`'s. A stage `top` switches off (`refine: none`, `distill_steps: 0`) drops
    `base`'s settings of that stage: `--config quality-16x32.yaml --distill-steps 0` (the recipe's own
    advice, and what `--nproc` hands its prune ranks) reads none of them, and warning about settings the
    user did not type would be noise. Settings typed beside a stage turned off still warn (`build_config`)."""
    merged = {**base, **top}
    for keys, off in ((REFINE_KEYS, top.get("refine") == "none"), (DISTILL_KEYS, top.get("distill_steps") == 0)):
        if off:
            for key in set(keys[1:]) & base.keys() - top.keys():
                del merged[key]
    return merged


def method_options(method: str, values: Mapping[str, Any]) -> MethodOptions:
    """The `METHOD_OPTION` values of a recipe → the chosen method's options; an option of another method
    is one UsageError line naming the chosen method's options."""
    spec = get_pruner(method)
    own = by_name(option_fields(spec))
    options = {f.name for f in METHOD_FIELDS} | own.keys()
    given = {k: v for k, v in values.items() if k in options and v is not None}
    stray = [key for key in given if key not in own]
    if stray:
        flags = [f.cli_flag for f in own.values()]
        raise UsageError(
            f"--{stray[0].replace('_', '-')} is not an option of --method {method}; its options: "
            f"{', '.join(flags) if flags else 'none'}"
        )
    return spec.options(**{key.removeprefix(f"{spec.name}_"): value for key, value in given.items()})


def _pattern(values: Mapping[str, Any]) -> SparsityPattern:
    from tsenor_cli.pattern import SparsityPattern

    nm, sparsity = values["nm"], values["sparsity"]
    if (nm is None) == (sparsity is None):
        raise UsageError("pass exactly one of --nm N:M (e.g. --nm 16:32) or --sparsity S (e.g. --sparsity 0.5)")
    if nm is not None:
        return SparsityPattern.parse(str(nm), transposable=bool(values["transposable"]))
    if not values["transposable"]:
        raise UsageError("--no-transposable applies to --nm patterns only; drop it when using --sparsity")
    return SparsityPattern.unstructured(float(sparsity))


def _check_calibration(calib: str) -> None:
    from tsenor_cli.data.sources import NAMED_TEXTS, read_text_records

    if calib in NAMED_TEXTS:
        return
    path = Path(calib).expanduser()
    if not path.is_file():
        raise InputNotFoundError(
            f"--data {calib} is not a readable file nor one of {', '.join(NAMED_TEXTS)}; "
            "pass c4, wikitext2, ptb or an existing .txt/.jsonl/.json.gz/.parquet file"
        )
    read_text_records(path)  # its contents too (format, `text` fields, not empty), before the model loads


def build_config(recipe: Mapping[str, Any], *, force: bool, resume: bool, command: str | None) -> PruneConfig:
    """Cross-check a validated recipe (unset keys take `RECIPE_DEFAULTS`) and freeze it into a `PruneConfig`:
    the one place a run's settings are checked (each field's `validate`, then the cross-checks)."""
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig
    from tsenor_cli.pruning.settings.config import DistillConfig, PruneConfig, RefineConfig

    values = {**RECIPE_DEFAULTS, **recipe}
    table = fields_for(values["method"])
    if not values["model"]:
        raise UsageError(
            "a model is required; pass MODEL (smollm2-135m, a checkpoint folder or a hub id) or model: in the recipe"
        )
    carried = {f.name for f in dataclasses.fields(PruneConfig) if "setting" in f.metadata}
    # PruneConfig checks its own fields when it is built, RefineConfig the refine settings.
    for key in [k for k in values if k not in carried | set(REFINE_KEYS)]:
        table[key].validate(values[key])
    pattern = _pattern(values)
    options = method_options(str(values["method"]), values)
    _check_calibration(str(values["calib_data"]))
    if values["refine"] == "none" and set(REFINE_KEYS[1:]) & recipe.keys():
        given = " and ".join(f"--{k.replace('_', '-')}" for k in REFINE_KEYS[1:] if k in recipe)
        logger.warning("ignoring %s: only --refine block reads it; add --refine block or drop it", given)
    if not values["distill_steps"] and set(DISTILL_KEYS[1:]) & recipe.keys():
        given = " and ".join(f"--{k.replace('_', '-')}" for k in DISTILL_KEYS[1:] if k in recipe)
        logger.warning("ignoring %s: only --distill-steps N > 0 reads it; add --distill-steps or drop it", given)
    output = values["output"]
    plain = {name: values[name] for name in carried} | {
        "model": str(values["model"]),
        "ignore": tuple(values["ignore"] or ()),
        "targets": tuple(values["targets"] or ()),
        "dtype": None if values["dtype"] in (None, "auto") else str(values["dtype"]),
        "output": Path(output).expanduser() if output else None,
    }
    return PruneConfig(
        **plain,
        matrix=MatrixPruneConfig(pattern=pattern, solver=str(values["solver"]), options=options),
        force=force,
        resume=resume,
        command=command,
        # RefineConfig checks the mode, epochs and learning rate (one UsageError line each).
        refine=RefineConfig(
            str(values["refine"]),
            values["refine_epochs"],
            values["refine_lr"],
            values["refine_mask_every"],
            str(values["refine_regions"]),
            values["refine_samples_per_step"],
            str(values["refine_schedule"]),
            str(values["refine_dtype"]),
            pattern=pattern,
            solver=str(values["solver"]),
        ),
        distill=DistillConfig(**{key.removeprefix("distill_"): values[key] for key in DISTILL_KEYS}),
    )

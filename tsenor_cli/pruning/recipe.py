"""Recipes: the keys of a pruning run as a user writes them, defined once.

A recipe is a mapping {key: value} with the keys of `RECIPE_KEYS` (the `tsenor prune` flags that decide
a run, spelled with `_`). Three places write one: `tsenor prune`'s flags, its `--config FILE` and a sweep
file's `base` and `axes` (each point of the grid is one recipe). All of them go through here:

- `validate_recipe`: unknown keys and wrongly typed values are one `UsageError` line;
- `RECIPE_DEFAULTS`: the value of each key left unset (the flags' defaults are these);
- `build_config`: a validated recipe → the frozen `PruneConfig` (cross-checks: exactly one of nm and
  sparsity, the calibration file's contents).

The benchmarks build their runs' configurations here too, so a recipe means the same run everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tsenor_cli.errors import InputNotFoundError, UsageError
from tsenor_cli.pruning.output import MAX_SHARD_SIZE
from tsenor_cli.pruning.refine import DEFAULT_EPOCHS, DEFAULT_LR, RefineConfig
from tsenor_cli.yamlfile import read_yaml

if TYPE_CHECKING:
    from tsenor_cli.pruning.config import PruneConfig

DEFAULT_DEVICE = "cpu"
DEFAULT_DTYPE = "auto"
# Every recipe key and the type its value must have; anything else in a recipe is refused.
RECIPE_KEYS: dict[str, type] = {
    "model": str,
    "nm": str,
    "sparsity": float,
    "transposable": bool,
    "method": str,
    "solver": str,
    "calib_data": str,
    "nsamples": int,
    "seqlen": int,
    "seed": int,
    "dtype": str,
    "device": str,
    "trust_remote_code": bool,
    "sequential": bool,
    "skip_incompatible": bool,
    "ignore": list,
    "targets": list,
    "output": str,
    "offload_activations": bool,
    "moe_calibration": str,
    "moe_min_tokens": int,
    "stream": bool,
    "max_shard_size": str,
    "refine": str,
    "refine_epochs": int,
    "refine_lr": float,
}
# The value of each key a recipe leaves unset (None: no default; model and one of nm/sparsity are required).
RECIPE_DEFAULTS: dict[str, Any] = {
    "model": None,
    "nm": None,
    "sparsity": None,
    "transposable": True,
    "method": "alps",
    "solver": "auto",
    "calib_data": "c4",
    "nsamples": 128,
    "seqlen": 2048,
    "seed": 0,
    "dtype": DEFAULT_DTYPE,
    "device": DEFAULT_DEVICE,
    "trust_remote_code": False,
    "sequential": True,
    "skip_incompatible": False,
    "ignore": None,
    "targets": None,
    "output": None,
    "offload_activations": False,
    "moe_calibration": "routed",
    "moe_min_tokens": None,
    "stream": False,
    "max_shard_size": MAX_SHARD_SIZE,
    "refine": "none",
    "refine_epochs": DEFAULT_EPOCHS,
    "refine_lr": DEFAULT_LR,
}
EXAMPLE_RECIPE = "configs/smollm2-alps-16x32.yaml"


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
    where a float is wanted; bools are never accepted as ints.
    """
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in RECIPE_KEYS:
            raise UsageError(f"{where}: unknown key {raw_key!r}; known keys: {', '.join(RECIPE_KEYS)}")
        want = RECIPE_KEYS[key]
        if key == "nm" and not isinstance(value, str):
            raise UsageError(
                f'{where}: nm must be a quoted string like "16:32" (unquoted YAML reads 16:32 as a base-60 number)'
            )
        if want is list:
            values[key] = _pattern_list(where, key, value)
            continue
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise UsageError(f"{where}: {key} must be a {want.__name__}, got {value!r}")
        values[key] = value
    return values


def _pattern_list(where: str, key: str, value: Any) -> list[str]:
    """A recipe's ignore/targets: one pattern string or a list of them."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    raise UsageError(
        f"{where}: {key} must be a pattern string or a list of them (e.g. ['*.mlp.down_proj']), got {value!r}"
    )


def build_config(recipe: Mapping[str, Any], *, force: bool, resume: bool, command: str) -> PruneConfig:
    """Cross-check a validated recipe (unset keys take `RECIPE_DEFAULTS`) and freeze it into a `PruneConfig`."""
    from tsenor_cli.data.sources import NAMED_TEXTS, read_text_records
    from tsenor_cli.pattern import SparsityPattern
    from tsenor_cli.pruning.config import PruneConfig
    from tsenor_cli.pruning.types import LayerPruneConfig

    values = {**RECIPE_DEFAULTS, **recipe}
    if not values["model"]:
        raise UsageError("--model is required; pass a checkpoint directory, a hub id or smollm2-135m")
    nm, sparsity = values["nm"], values["sparsity"]
    if (nm is None) == (sparsity is None):
        raise UsageError("pass exactly one of --nm N:M (e.g. --nm 16:32) or --sparsity S (e.g. --sparsity 0.5)")
    if nm is not None:
        pattern = SparsityPattern.parse(str(nm), transposable=bool(values["transposable"]))
    else:
        if not values["transposable"]:
            raise UsageError("--no-transposable applies to --nm patterns only; drop it when using --sparsity")
        pattern = SparsityPattern.unstructured(float(sparsity))
    calib = str(values["calib_data"])
    if calib not in NAMED_TEXTS:
        path = Path(calib).expanduser()
        if not path.is_file():
            raise InputNotFoundError(
                f"--calib-data {calib} is not a readable file nor one of {', '.join(NAMED_TEXTS)}; "
                "pass c4, wikitext2, ptb or an existing .txt/.jsonl/.json.gz/.parquet file"
            )
        read_text_records(path)  # its contents too (format, `text` fields, not empty), before the model loads
    output = values["output"]
    return PruneConfig(
        model=str(values["model"]),
        layer=LayerPruneConfig(pattern=pattern, solver=str(values["solver"])),
        method=str(values["method"]),
        calib_data=calib,
        nsamples=int(values["nsamples"]),
        seqlen=int(values["seqlen"]),
        seed=int(values["seed"]),
        dtype=None if values["dtype"] in (None, "auto") else str(values["dtype"]),
        device=str(values["device"]),
        trust_remote_code=bool(values["trust_remote_code"]),
        sequential=bool(values["sequential"]),
        skip_incompatible=bool(values["skip_incompatible"]),
        ignore=tuple(values["ignore"] or ()),
        targets=tuple(values["targets"] or ()),
        output=Path(output).expanduser() if output else None,
        force=force,
        resume=resume,
        command=command,
        offload_activations=bool(values["offload_activations"]),
        moe_calibration=str(values["moe_calibration"] or "routed"),
        moe_min_tokens=None if values["moe_min_tokens"] is None else int(values["moe_min_tokens"]),
        stream=bool(values["stream"]),
        max_shard_size=str(values["max_shard_size"]),
        # RefineConfig checks the mode, epochs and learning rate (one UsageError line each).
        refine=RefineConfig(str(values["refine"]), values["refine_epochs"], values["refine_lr"]),
    )

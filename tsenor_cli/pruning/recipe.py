"""Recipes: the settings of a pruning run, each declared once in `PRUNE_FIELDS`.

A recipe is a mapping {key: value} with the keys of `RECIPE_KEYS`. Three places write one:
`tsenor prune`'s flags (generated from the same fields, `cli/options.field_parameters`), its
`--config FILE` and a sweep file's `base` and `axes` (each point of the grid is one recipe). All of them
go through here:

- `validate_recipe`: unknown keys and wrongly typed values are one `UsageError` line;
- `RECIPE_DEFAULTS`: the value of each key left unset (the flags' and `PruneConfig`'s defaults);
- `build_config`: a validated recipe → the frozen `PruneConfig`, every value checked once there
  (`Field.validate`) and cross-checked (exactly one of nm and sparsity, the method's options, the
  calibration file's contents).

Each method's options are fields too (`method_fields`: `--alps-rho0`, recipe key `alps_rho0`), from the
options dataclass registered with the method (`pruning/registry.py`). The benchmarks build their runs'
configurations here too, so a recipe means the same run everywhere. No torch here (`tsenor --help`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tsenor_cli.errors import InputNotFoundError, UsageError
from tsenor_cli.fields import Field, by_name, read_mapping
from tsenor_cli.progress import logger
from tsenor_cli.pruning.registry import PRUNERS, get_pruner
from tsenor_cli.yamlfile import read_yaml

if TYPE_CHECKING:
    from tsenor_cli.pattern import SparsityPattern
    from tsenor_cli.pruning.config import PruneConfig
    from tsenor_cli.pruning.method_options import MethodOptions

EXAMPLE_RECIPE = "configs/smollm2-alps-16x32.yaml"


def _solvers() -> tuple[str, ...]:
    from tsenor_cli.solver import METHODS

    return tuple(METHODS)


def _check_dtype(value: str) -> None:
    """auto or a dtype name `models.loading.parse_dtype` reads (fp32, bf16, fp16, or float32 … as torch spells them)."""
    from tsenor_cli.models.loading import parse_dtype

    parse_dtype(value)


def _check_shard_size(value: str) -> None:
    from tsenor_cli.models.saving import parse_size

    parse_size(value)


def _check_patterns(option: str) -> Any:
    def check(value: Sequence[str]) -> None:
        from tsenor_cli.pruning.selection import check_patterns

        check_patterns(tuple(value), option)

    return check


MODEL, PATTERN, DATA, SELECT, OUT, MEMORY, REFINE, MOE = (
    "Model",
    "Pattern and method",
    "Calibration",
    "Which weights",
    "Output",
    "Memory",
    "Refinement (--refine block)",
    "Mixture of experts",
)
# Every setting of a pruning run; anything else in a recipe is refused.
PRUNE_FIELDS: tuple[Field, ...] = (
    Field("model", str, None, "Embedded name (smollm2-135m), checkpoint folder or hub id (here or in --config).",
          MODEL, positional=True, aliases=("--model",), metavar="MODEL"),
    Field("dtype", str, "auto", "Weights' dtype: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16.", MODEL,
          metavar="<auto|fp32|bf16|fp16>", check=_check_dtype),
    Field("device", str, "cpu", "Compute device: cpu, cuda or cuda:N.", MODEL,
          metavar="[cpu|cuda|cuda:N]", result=False),
    Field("trust_remote_code", bool, False, "Allow the checkpoint's own model code (off by default).", MODEL,
          result=False),
    Field("nm", str, None, "N:M pattern, e.g. 16:32 (transposable unless --no-transposable).", PATTERN,
          metavar="N:M"),
    Field("sparsity", float, None, "Unstructured sparsity instead of N:M, e.g. 0.5.", PATTERN),
    Field("transposable", bool, True, "Transposable N:M tiles.", PATTERN, negation="--no-transposable"),
    Field("method", str, "alps", "Pruning method.", PATTERN, choices=tuple(PRUNERS)),
    Field("solver", str, "auto",
          "Transposable mask solver (auto: exact flow on CPU and for few tiles on CUDA, tsenor on CUDA).", PATTERN,
          choices=_solvers),
    Field("calib_data", str, "c4", "Calibration text: c4, wikitext2, ptb or a text/jsonl file.", DATA,
          flag="--data", aliases=("--calib-data",)),
    Field("nsamples", int, 128, "Calibration sequences.", DATA, minimum=1),
    Field("seqlen", int, 2048, "Calibration sequence length (capped by the model).", DATA, minimum=1),
    Field("seed", int, 0, "Seed of the calibration sampling.", DATA),
    Field("sequential", bool, True, "Prune the linears that read the same input together, group after group "
          "(LLaMA: (q,k,v), (o), (gate,up), (down)), re-running the block between groups.", DATA,
          negation="--no-sequential"),
    Field("ignore", list, (), "Leave matching linears dense (repeatable): glob on full names ('*.mlp.down_proj') "
          "or 're:REGEX'.", SELECT, metavar="<pattern>", check=_check_patterns("--ignore")),
    Field("targets", list, (), "Prune only matching linears (repeatable): glob on full names or 're:REGEX'.",
          SELECT, metavar="<pattern>", check=_check_patterns("--targets")),
    Field("skip_incompatible", bool, False, "Leave layers M does not divide dense.", SELECT),
    Field("output", str, None, "Output folder; what tsenor wrote there before is replaced only with --force.",
          OUT, flag="--output", short="-o", metavar="<path>", result=False),
    Field("max_shard_size", str, "2GB", "Largest safetensors shard of the output, e.g. 2GB, 500MB.", OUT,
          result=False, check=_check_shard_size),
    Field("stream", bool, True, "Read each decoder block from the safetensors checkpoint when it is pruned and "
          "write the output from the pruned blocks' files: host memory of one block, not one model (same output, "
          "bit for bit); --no-stream loads the whole model.", MEMORY, negation="--no-stream", result=False),
    Field("offload_activations", bool, False, "Keep the calibration activations on the CPU and move one sample "
          "at a time to the device (same result, device memory for one block and one sample).", MEMORY,
          result=False),
    Field("refine", str, "none", "After each block is pruned: none or block. 'block' trains the block's remaining "
          "weights (the mask fixed) so that its output matches the dense block's on the calibration samples.",
          REFINE, choices=("none", "block")),
    # RefineConfig (pruning/refine.py) checks the mode, epochs and learning rate when the config is built.
    Field("refine_epochs", int, 2, "Passes over the calibration samples per block.", REFINE),
    Field("refine_lr", float, 1e-3, "Adam's learning rate.", REFINE),
    Field("refine_mask_every", int, 0, "Re-solve the pruned matrices' masks every this many Adam steps from "
          "dense shadows of the weights (0: the mask fixed); N:M patterns.", REFINE),
    Field("moe_calibration", str, "routed", "Statistics of expert matrices: 'routed' (the tokens the router "
          "sends each expert) or 'all' (every calibration token through every expert, for the statistics only).",
          MOE, choices=("routed", "all")),
    Field("moe_min_tokens", int, None, "With routed statistics, an expert that received fewer tokens takes "
          "every-token statistics (default: its input dimension); the report names each such expert.", MOE,
          minimum=1),
)  # fmt: skip


def method_fields() -> tuple[Field, ...]:
    """Each registered method's options as settings named `METHOD_OPTION` (`--alps-rho0`, `alps_rho0`),
    from the method's options dataclass: its defaults, types and help lines."""
    found: list[Field] = []
    for spec in PRUNERS.values():
        for item in dataclasses.fields(spec.options):
            kind = float if item.type in ("float", float) else int
            found.append(
                Field(
                    f"{spec.name}_{item.name}",
                    kind,
                    None,
                    f"{item.metadata['help']} Default {item.default}; with --method {spec.name} only.",
                    f"{spec.name} options",
                    minimum=item.metadata.get("minimum"),
                )
            )
    return tuple(found)


METHOD_FIELDS: tuple[Field, ...] = method_fields()
ALL_FIELDS: tuple[Field, ...] = PRUNE_FIELDS + METHOD_FIELDS
FIELDS: dict[str, Field] = by_name(ALL_FIELDS)
# Every recipe key and the type of its value, and the value of each key a recipe leaves unset (None: no
# default; model and one of nm/sparsity are required; a method option unset takes the method's default).
RECIPE_KEYS: dict[str, type] = {f.name: f.kind for f in ALL_FIELDS}
RECIPE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in ALL_FIELDS}
# The settings RefineConfig checks; every one after the mode is read only with --refine block.
REFINE_KEYS: tuple[str, ...] = ("refine", "refine_epochs", "refine_lr", "refine_mask_every")


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
        raise UsageError(
            f'{where}: nm must be a quoted string like "16:32" (unquoted YAML reads 16:32 as a base-60 number)'
        )
    return read_mapping(data, ALL_FIELDS, where)


def method_options(method: str, values: Mapping[str, Any]) -> MethodOptions:
    """The `METHOD_OPTION` values of a recipe → the chosen method's options; an option of another method
    is one UsageError line naming the chosen method's options."""
    spec = get_pruner(method)
    options = {f.name for f in METHOD_FIELDS}
    given = {k: v for k, v in values.items() if k in options and v is not None}
    prefix = f"{method}_"
    stray = [key for key in given if not key.startswith(prefix)]
    if stray:
        own = [f.cli_flag for f in METHOD_FIELDS if f.name.startswith(prefix)]
        raise UsageError(
            f"--{stray[0].replace('_', '-')} is not an option of --method {method}; its options: "
            f"{', '.join(own) if own else 'none'}"
        )
    return spec.options(**{key.removeprefix(prefix): value for key, value in given.items()})


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


def build_config(recipe: Mapping[str, Any], *, force: bool, resume: bool, command: str) -> PruneConfig:
    """Cross-check a validated recipe (unset keys take `RECIPE_DEFAULTS`) and freeze it into a `PruneConfig`:
    the one place a run's settings are checked (each field's `validate`, then the cross-checks)."""
    from tsenor_cli.pruning.config import PruneConfig
    from tsenor_cli.pruning.refine import RefineConfig
    from tsenor_cli.pruning.types import LayerPruneConfig

    values = {**RECIPE_DEFAULTS, **recipe}
    if not values["model"]:
        raise UsageError(
            "a model is required; pass MODEL (smollm2-135m, a checkpoint folder or a hub id) or model: in the recipe"
        )
    carried = {f.name for f in dataclasses.fields(PruneConfig) if "setting" in f.metadata}
    # PruneConfig checks its own fields when it is built, RefineConfig the refine settings.
    for key in [k for k in values if k not in carried | set(REFINE_KEYS)]:
        FIELDS[key].validate(values[key])
    pattern = _pattern(values)
    options = method_options(str(values["method"]), values)
    _check_calibration(str(values["calib_data"]))
    if values["refine"] == "none" and set(REFINE_KEYS[1:]) & recipe.keys():
        given = " and ".join(f"--{k.replace('_', '-')}" for k in REFINE_KEYS[1:] if k in recipe)
        logger.warning("ignoring %s: only --refine block reads it; add --refine block or drop it", given)
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
        layer=LayerPruneConfig(pattern=pattern, solver=str(values["solver"]), options=options),
        force=force,
        resume=resume,
        command=command,
        # RefineConfig checks the mode, epochs and learning rate (one UsageError line each).
        refine=RefineConfig(
            str(values["refine"]),
            values["refine_epochs"],
            values["refine_lr"],
            values["refine_mask_every"],
            pattern=pattern,
            solver=str(values["solver"]),
        ),
    )

"""Flags generated from a settings table, the options several commands share (`Annotated` aliases, as
the `hf` CLI does), and the parsers of the evaluation options `eval`, `prune --eval` and `finetune` share.

`with_fields(TABLE)` gives a command taking `**settings` one flag per `Field` (name, help, panel, shown
choices, default) plus a hidden option per old name; `given_values` returns the settings typed on the
command line. A command declares a shared option as ``device: DeviceOpt = DEVICE``: the flag, its help
and its default come from here (the device, dtype and trust-remote-code ones from prune's fields, the
kernels one from `kernels.KERNELS`), so
`prune`, `eval`, `finetune` and `bench` cannot drift apart (tests/test_cli_options.py, tests/test_fields.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from copy import copy
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast, get_args

import typer

from tsenor_cli.data.sources import DATASET_NAMES, DatasetName
from tsenor_cli.errors import UsageError
from tsenor_cli.fields import Field
from tsenor_cli.kernels import KERNELS
from tsenor_cli.pruning.settings.table import FIELDS

# ---------------------------------------------------------------- flags generated from a settings table

# Fields whose choices are listed by the library (the solvers): `cli.Command` fills in their metavar
# when help is shown, so that building the commands (`tsenor --help`) imports no torch.
LAZY_CHOICES: dict[str, Field] = {}
ALIAS_SUFFIX = "__alias"
F = TypeVar("F", bound=Callable[..., Any])


def _metavar(field: Field) -> str | None:
    if field.metavar is not None:
        return field.metavar
    if callable(field.choices):
        LAZY_CHOICES[f"<{field.name}>"] = field
        return f"<{field.name}>"
    if field.choices is not None:
        return "<" + "|".join(field.choices) + ">"
    return None


def field_annotation(field: Field, *, panel: bool = True) -> Any:
    """`Annotated[type, typer.Option(...)]` (or `typer.Argument`) of a setting: flag, help, panel, choices."""
    kind: Any = list[str] if field.kind is list else field.kind
    if field.default is None or field.kind is list:
        kind = kind | None
    common: dict[str, Any] = {"help": field.help, "metavar": _metavar(field)}
    if panel:
        common["rich_help_panel"] = field.panel
    if field.positional:
        return Annotated[kind, typer.Argument(show_default=False, **common)]
    names = [field.cli_flag + (f"/{field.negation}" if field.negation else "")]
    names += [field.short] if field.short else []
    return Annotated[kind, typer.Option(*names, show_default=field.default not in (None, ()), **common)]


def field_parameters(fields: Iterable[Field]) -> list[inspect.Parameter]:
    """The command parameters of `fields`: one per setting (its default the table's), then one hidden
    option per old flag name (accepted for one release; `given_values` folds it into the setting)."""
    main: list[inspect.Parameter] = []
    hidden: list[inspect.Parameter] = []
    keyword = inspect.Parameter.KEYWORD_ONLY
    for field in fields:
        default = None if field.kind is list else field.default
        main.append(inspect.Parameter(field.name, keyword, default=default, annotation=field_annotation(field)))
        for i, alias in enumerate(field.aliases):
            kind: Any = list[str] | None if field.kind is list else field.kind | None
            current = field.metavar if field.positional else field.cli_flag
            option = typer.Option(alias, hidden=True, help=f"Old name of {current}, accepted for one release.")
            name = f"{field.name}{ALIAS_SUFFIX}{i}"
            hidden.append(inspect.Parameter(name, keyword, default=None, annotation=Annotated[kind, option]))
    return main + hidden


def with_fields(fields: Iterable[Field]) -> Callable[[F], F]:
    """Decorate a command taking `**settings`: its signature (what typer reads) gains the settings' flags,
    generated from the table after the command's own parameters."""
    table = tuple(fields)

    def wrap(func: F) -> F:
        own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD]
        positional = [p.replace(kind=p.KEYWORD_ONLY) for p in own]
        func.__signature__ = inspect.Signature([*positional, *field_parameters(table)])  # type: ignore[attr-defined]
        return func

    return wrap


def in_panel(option: Any, panel: str) -> Any:
    """A shared `Annotated` option shown in `panel` of one command's help (same flag, default and help)."""
    kind, info = get_args(option)
    moved = copy(info)
    moved.rich_help_panel = panel
    return Annotated[kind, moved]


def typed_on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether parameter `name` was typed on the command line (not its default, nor the environment).

    Compared by the enum member's name: the enum lives in typer's vendored click, which is not public.
    """
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def given_values(ctx: typer.Context, fields: Iterable[Field]) -> dict[str, Any]:
    """{setting: value} of the settings typed on the command line (an old flag name counts as its setting;
    both spellings at once is one UsageError line). Settings left out take the recipe's or the default."""
    values: dict[str, Any] = {}
    for field in fields:
        spellings = [(field.name, field.cli_flag)]
        spellings += [(f"{field.name}{ALIAS_SUFFIX}{i}", alias) for i, alias in enumerate(field.aliases)]
        typed = [(name, flag) for name, flag in spellings if typed_on_command_line(ctx, name)]
        if len(typed) > 1:
            raise UsageError(f"{typed[0][1]} and {typed[1][1]} name the same setting; pass one of them")
        if typed:
            value = ctx.params[typed[0][0]]
            values[field.name] = list(value) if field.kind is list else value
    return values


# ---------------------------------------------------------------- options several commands share

# The paper's perplexity protocol evaluates all three datasets (SparseGPT's WikiText2, PTB, C4).
PPL = ",".join(DATASET_NAMES)
DEVICE = FIELDS["device"].default
DTYPE = FIELDS["dtype"].default
MAX_SHARD_SIZE = FIELDS["max_shard_size"].default
KERNELS_DEFAULT = KERNELS.default

DeviceOpt = field_annotation(FIELDS["device"], panel=False)
DtypeOpt = field_annotation(FIELDS["dtype"], panel=False)
TrustRemoteCodeOpt = field_annotation(FIELDS["trust_remote_code"], panel=False)
MaxShardSizeOpt = field_annotation(FIELDS["max_shard_size"], panel=False)
# `tsenor eval --kernels`; finetune takes the same field through FINETUNE_FIELDS.
KernelsOpt = field_annotation(KERNELS, panel=False)
OutputDirOpt = Annotated[
    Path | None,
    typer.Option("--output", "-o", help=FIELDS["output"].help),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace existing output: prune, finetune: a tsenor run (never other files); eval: eval.json; "
        "report: the folder; bench: its result files; sweep: take over a folder made from another sweep file.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Print the plan (what runs, its memory); read no weight, write nothing.")
]
PplOpt = Annotated[
    str, typer.Option("--ppl", help=f"Perplexity datasets, a comma list of {','.join(DATASET_NAMES)}, or none.")
]
MaxWindowsOpt = Annotated[
    int | None, typer.Option("--max-windows", min=1, help="Perplexity: only the first N windows of each dataset.")
]
TasksOpt = Annotated[str | None, typer.Option("--tasks", help="Zero-shot tasks (comma list), e.g. piqa,arc_easy.")]
LimitOpt = Annotated[str | None, typer.Option("--limit", help="Zero-shot documents per task (count or fraction).")]
ModelArg = Annotated[
    str | None,
    typer.Argument(
        metavar="MODEL", show_default=False, help="Embedded name (smollm2-135m), checkpoint folder or hub id."
    ),
]
# `--model X`: the model's flag before it became the first argument; hidden, accepted for one release.
ModelAliasOpt = Annotated[
    str | None, typer.Option("--model", hidden=True, help="Old name of MODEL, accepted for one release.")
]
DataDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        help="Offline data folder (layout of shared/data); every dataset is read from it. Default: $TSENOR_DATA_DIR.",
    ),
]
OfflineOpt = Annotated[
    bool,
    typer.Option(
        "--offline",
        help="Never contact the HF hub (hub model ids from the local HF cache only). Default: HF_HUB_OFFLINE.",
    ),
]


def pick_model(model: str | None, model_option: str | None) -> str:
    """The MODEL argument or the old `--model` flag: exactly one of them."""
    if model is not None and model_option is not None:
        raise UsageError(f"MODEL {model} and --model {model_option} both given; pass the model once, as MODEL")
    chosen = model if model is not None else model_option
    if not chosen:
        raise UsageError(
            "a model is required; pass MODEL: an embedded name (smollm2-135m), checkpoint folder or hub id"
        )
    return chosen


# ---------------------------------------------------------------- parsing the evaluation options


def parse_list(text: str | None, option: str) -> tuple[str, ...]:
    """ "a,b , c" → ("a", "b", "c"); "" or "none" → (); empty items are refused."""
    if text is None or text.strip().lower() in ("", "none"):
        return ()
    items = tuple(item.strip() for item in text.split(","))
    if any(not item for item in items):
        raise UsageError(f"{option} {text!r} has an empty item; pass a comma-separated list like a,b")
    return items


def parse_ppl_datasets(text: str | None) -> tuple[DatasetName, ...]:
    items = parse_list(text, "--ppl")
    unknown = [item for item in items if item not in DATASET_NAMES]
    if unknown:
        raise UsageError(
            f"unknown --ppl dataset(s) {', '.join(unknown)}; use a subset of {','.join(DATASET_NAMES)} or none"
        )
    return cast(tuple[DatasetName, ...], items)


def parse_tasks(text: str | None) -> tuple[str, ...]:
    """--tasks "a,b" → ("a", "b"), refusing unknown or repeated names (before any model is loaded)."""
    tasks = parse_list(text, "--tasks")
    if not tasks:
        return ()
    _check_zeroshot_available()
    from tsenor_cli.evaluation.zeroshot import validate_tasks

    return validate_tasks(tasks)


def parse_batch_size(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError as exc:
        raise UsageError(f"--batch-size {text!r} must be a positive integer or 'auto'") from exc
    if value < 1:
        raise UsageError(f"--batch-size {value} must be a positive integer or 'auto'")
    return value


def parse_limit(text: str | None) -> int | float | None:
    """lm-eval's limit: an integer document count, or a fraction in (0, 1]."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError as exc:
        raise UsageError(f"--limit {text!r} must be a document count or a fraction in (0, 1]") from exc


def _check_zeroshot_available() -> None:
    try:
        import tsenor_cli.evaluation.zeroshot  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "tsenor_cli.evaluation.zeroshot":
            raise
        raise UsageError("zero-shot evaluation is not available in this build; omit --tasks") from exc

"""One declaration per setting (issue 40): the recipe keys, defaults, checks, CLI flags and config fields
of `tsenor prune` and `tsenor finetune` all come from one field list, and no other copy exists."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from tests.helpers_cli import invoke
from tsenor_cli.cli import app, reference
from tsenor_cli.errors import UsageError
from tsenor_cli.fields import Field
from tsenor_cli.finetune.config import FINETUNE_FIELDS, FinetuneConfig
from tsenor_cli.pruning.methods.method_options import ALPSOptions
from tsenor_cli.pruning.methods.registry import PRUNERS
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.pruning.settings.recipe import build_config
from tsenor_cli.pruning.settings.table import ALL_FIELDS, PRUNE_FIELDS, RECIPE_DEFAULTS, RECIPE_KEYS

PACKAGE = Path(__file__).resolve().parents[1] / "tsenor_cli"
# `tsenor prune`'s options that are not settings of the run: what to do with it.
PRUNE_RUN_OPTIONS = {
    "--force", "--resume", "--no-resume-state", "--nproc", "--config", "--dry-run", "--eval", "--ppl", "--tasks",
    "--max-windows", "--json", "--data-dir", "--offline", "--help",
}  # fmt: skip
FINETUNE_RUN_OPTIONS = {
    "--output", "--force", "--resume", "--ppl", "--max-windows", "--tasks", "--limit", "--dry-run", "--json",
    "--data-dir", "--offline", "--help",
}  # fmt: skip
# PruneConfig attributes that a setting reaches converted (model: required; dtype "auto" → None; output → Path)
# or through another object (layer: pattern, solver, method options; refine: RefineConfig; distill: DistillConfig),
# and the run's own inputs; every other attribute must take its default from the table.
PRUNE_CONVERTED = {"model", "matrix", "dtype", "output", "refine", "distill", "force", "resume", "command"}
FINETUNE_OWN = {"run_dir", "output", "ppl_datasets", "max_windows", "tasks", "limit", "force", "resume", "command"}


def _command(name: str) -> Any:
    return dict(reference.commands(typer.main.get_command(app)))[f"tsenor {name}"]


def _flags(command: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """{flag: param} of the visible options and of the hidden ones."""
    shown: dict[str, Any] = {}
    hidden: dict[str, Any] = {}
    for param in command.params:
        for flag in [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]:
            if flag.startswith("-"):
                (hidden if getattr(param, "hidden", False) else shown)[flag] = param
    return shown, hidden


def _field_flags(fields: tuple[Field, ...]) -> dict[str, Field]:
    flags: dict[str, Field] = {}
    for field in fields:
        if not field.positional:
            flags[field.cli_flag] = field
        flags |= dict.fromkeys(field.aliases, field) | ({field.short: field} if field.short else {})
        flags |= {field.negation: field} if field.negation else {}
    return flags


@pytest.mark.parametrize(
    ("command", "fields", "own"),
    [("prune", ALL_FIELDS, PRUNE_RUN_OPTIONS), ("finetune", FINETUNE_FIELDS, FINETUNE_RUN_OPTIONS | {"--bf16"})],
)
def test_every_flag_maps_to_a_field_and_every_field_to_a_flag(
    command: str, fields: tuple[Field, ...], own: set[str]
) -> None:
    shown, hidden = _flags(_command(command))
    declared = _field_flags(fields)
    stray = set(shown) | set(hidden)
    stray -= set(declared) | own | {"-o"}
    assert stray == set(), f"flags of tsenor {command} declared outside the field list: {stray}"
    assert set(declared) <= set(shown) | set(hidden), set(declared) - set(shown) - set(hidden)
    for flag, field in declared.items():
        param = shown.get(flag) or hidden[flag]
        assert param.hidden == (flag in field.aliases), flag  # old names are hidden, the others shown
        if flag not in field.aliases:
            assert param.name == field.name and param.help == field.help, flag
            want = None if field.kind is list else field.default
            assert param.default == want, f"{flag} defaults to {param.default!r}, the field to {want!r}"


def test_the_recipe_keys_are_the_field_names_with_their_defaults() -> None:
    assert list(RECIPE_KEYS) == [f.name for f in ALL_FIELDS]
    assert {f.name: f.default for f in ALL_FIELDS} == RECIPE_DEFAULTS
    # Each method option is a field named METHOD_OPTION, from the options dataclass on the method's spec.
    options = {f"{spec.name}_{item.name}" for spec in PRUNERS.values() for item in dataclasses.fields(spec.options)}
    assert options == set(RECIPE_KEYS) - {f.name for f in PRUNE_FIELDS}
    assert "alps_rho0" in options and "sparsegpt_blocksize" in options


@pytest.mark.parametrize(
    ("config", "fields", "converted"),
    [(PruneConfig, PRUNE_FIELDS, PRUNE_CONVERTED), (FinetuneConfig, FINETUNE_FIELDS, FINETUNE_OWN)],
)
def test_config_fields_take_their_defaults_from_the_table(
    config: Any, fields: tuple[Field, ...], converted: set[str]
) -> None:
    table = {f.name: f for f in fields}
    for item in dataclasses.fields(config):
        if item.name in converted:
            assert "setting" not in item.metadata, item.name
            continue
        assert item.metadata.get("setting") is table[item.name], f"{config.__name__}.{item.name} is not from the table"
        assert item.default == table[item.name].default


def _literals(path: Path) -> list[Any]:
    return [
        node.value for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.Constant)
    ]


def test_no_flag_or_default_is_written_a_second_time() -> None:
    """The command modules and the config modules spell no setting's flag, and the config dataclasses
    write no setting's default, themselves: both come from the field lists."""
    for path in ("cli/prune.py", "cli/finetune.py"):
        flags = {lit for lit in _literals(PACKAGE / path) if isinstance(lit, str) and lit.startswith("--")}
        declared = set(_field_flags(ALL_FIELDS if "prune" in path else FINETUNE_FIELDS))
        allowed = {"--bf16"}  # finetune's old flag, mapped to --dtype bf16 by hand (a bool for a str setting)
        assert not (flags & declared) - allowed, f"{path} declares {flags & declared}"
    configs = (
        ("pruning/settings/config.py", PRUNE_FIELDS, PRUNE_CONVERTED),
        ("pruning/methods/types.py", PRUNE_FIELDS, set()),
        ("finetune/config.py", FINETUNE_FIELDS, FINETUNE_OWN),
    )
    for path, fields, converted in configs:
        tree = ast.parse((PACKAGE / path).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
                for stmt in node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.value, ast.Constant):
                        name = stmt.target.id  # type: ignore[attr-defined]
                        assert name not in {f.name for f in fields} - converted, (
                            f"{path}: {name} writes its default again"
                        )


def test_help_and_version_import_no_torch_transformers_or_lm_eval() -> None:
    """`tsenor --help` / `--version` build every command (their flags from the field lists) without the
    heavy libraries, which the commands import when they run."""
    code = (
        "import sys\n"
        "from tsenor_cli.cli import main\n"
        "for args in (['--help'], ['--version'], ['prune', '--help'], ['finetune', '--help']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code in (0, None), (args, exc.code)\n"
        "heavy = [m for m in ('torch', 'transformers', 'lm_eval', 'datasets') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    # prune --help lists the solvers, which are registered by the solver package (torch): only --help/--version
    # and finetune's help are held to no import; prune's help is checked below for its shown choices.
    code = code.replace("['prune', '--help'], ", "")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "HEAVY []" in done.stdout, done.stdout + done.stderr


def test_every_enumerated_option_shows_its_choices() -> None:
    text = " ".join(invoke(["prune", "--help"]).output.split())
    for flag, choices in (
        ("--solver", ("auto", "flow", "tsenor")),
        ("--dtype", ("auto", "bf16")),
        ("--method", tuple(PRUNERS)),
    ):
        shown = text.split(flag + " <", 1)[1].split(">", 1)[0].split("|")
        assert set(choices) <= set(shown), (flag, shown)
    assert "--device [cpu|cuda|cuda:N]" in text
    assert "<str>" not in text.split("Model:")[1].split("Pattern and method:")[0]  # --dtype, --device


class _Built(Exception):
    """Raised by the stand-in `build_config` to end the command with the recipe it was given."""


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run `tsenor prune ARGS` up to the config: the recipe the command hands to `build_config` and the
    config it builds (or the UsageError it raises)."""
    from tsenor_cli.cli import prune

    def run(args: list[str]) -> tuple[dict[str, Any], Any]:
        seen: dict[str, Any] = {}

        def fake(recipe: dict[str, Any], **kwargs: Any) -> PruneConfig:
            seen.update(recipe)
            try:
                seen["__config__"] = build_config(recipe, **kwargs)
            except UsageError as exc:
                seen["__config__"] = exc
            raise _Built

        monkeypatch.setattr(prune, "build_config", fake)
        result = invoke(["prune", *args])
        assert isinstance(result.exception, _Built), result.output
        config = seen.pop("__config__")
        return seen, config

    return run


def test_method_options_from_flags_and_recipes_build_the_same_config(built: Any, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": "m", "nm": "2:4", "alps_rho0": 0.2, "alps_max_iter": 50}))
    _, from_file = built(["--config", str(recipe)])
    _, from_flags = built(["m", "--nm", "2:4", "--alps-rho0", "0.2", "--alps-max-iter", "50"])
    # The same config, but for the command line each records (`tsenor prune --config r.yaml`, the flags).
    assert dataclasses.replace(from_file, command=None) == dataclasses.replace(from_flags, command=None)
    assert from_file.result_hash() == from_flags.result_hash()
    assert from_flags.matrix.options == ALPSOptions(rho0=0.2, max_iter=50)
    assert from_flags.result_hash() != built(["m", "--nm", "2:4"])[1].result_hash()  # they decide the weights


def test_an_option_of_another_method_is_one_line_naming_the_valid_ones(built: Any) -> None:
    _, error = built(["m", "--nm", "2:4", "--method", "sparsegpt", "--alps-rho0", "0.2"])
    assert isinstance(error, UsageError)
    assert str(error) == (
        "--alps-rho0 is not an option of --method sparsegpt; its options: --sparsegpt-percdamp, --sparsegpt-blocksize"
    )
    _, error = built(["m", "--nm", "2:4", "--method", "alps", "--alps-max-iter", "0"])
    assert isinstance(error, UsageError) and "--alps-max-iter 0 must be >= 1" in str(error)


def test_old_flag_names_still_work_and_both_spellings_are_refused(built: Any, tmp_path: Path) -> None:
    text = tmp_path / "calib.txt"
    text.write_text("some calibration text\n")
    recipe, cfg = built(["--model", "m", "--nm", "2:4", "--calib-data", str(text)])
    assert recipe == {"model": "m", "nm": "2:4", "calib_data": str(text)}
    assert cfg.calib_data == str(text)
    result = invoke(["prune", "m", "--nm", "2:4", "--data", "c4", "--calib-data", str(text)])
    assert result.exit_code == 2 and "--data and --calib-data name the same setting" in str(result.exception)


def test_flags_typed_override_the_recipe_and_no_stream_turns_streaming_off(built: Any, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": "m", "nm": "2:4", "stream": True, "nsamples": 8}))
    _, cfg = built(["--config", str(recipe), "--no-stream", "--nsamples", "4"])
    assert (cfg.stream, cfg.nsamples) == (False, 4)
    assert built(["--config", str(recipe)])[1].stream is True
    assert built(["m", "--nm", "2:4"])[1].stream is True  # the default


def test_a_recipe_refine_lr_written_1e_3_is_a_float(built: Any, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: m\nnm: '2:4'\nrefine: block\nrefine_lr: 1e-3\n")
    assert yaml.safe_load(recipe.read_text())["refine_lr"] == "1e-3"  # YAML 1.1 reads it as text
    assert built(["--config", str(recipe)])[1].refine.lr == 0.001
    recipe.write_text("model: m\nnm: '2:4'\nrefine_lr: fast\n")
    result = invoke(["prune", "--config", str(recipe)])
    assert result.exit_code == 2 and "refine_lr must be a float, got 'fast'" in str(result.exception)


def test_refine_settings_without_refine_block_warn(built: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="tsenor"):
        built(["m", "--nm", "2:4", "--refine-epochs", "3"])
    assert "ignoring --refine-epochs: only --refine block reads it" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tsenor"):
        built(["m", "--nm", "2:4", "--refine", "block", "--refine-epochs", "3"])
    assert "ignoring" not in caplog.text


def test_config_on_a_folder_says_it_is_a_folder(tmp_path: Path) -> None:
    result = invoke(["prune", "--config", str(tmp_path)])
    assert result.exit_code == 2
    assert (
        str(result.exception)
        == f"--config {tmp_path} is a folder; pass a YAML file such as configs/smollm2-alps-16x32.yaml"
    )


@pytest.mark.parametrize("position", ["before", "after"])
def test_quiet_and_verbose_go_before_or_after_the_command(position: str) -> None:
    from tsenor_cli.progress import logger

    for flag, level in (("-q", 30), ("-v", 10), ("--quiet", 30)):
        args = [flag, "model", "list"] if position == "before" else ["model", "list", flag]
        result = invoke(args)
        assert result.exit_code == 0, result.output
        assert logger.level == level


def test_finetune_dtype_and_its_old_bf16_flag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tsenor_cli.cli import finetune as command

    seen: list[FinetuneConfig] = []

    def fake(cfg: FinetuneConfig, ctx: Any, stop: Any) -> None:
        seen.append(cfg)
        raise _Built

    monkeypatch.setattr("tsenor_cli.finetune.run.finetune", fake)
    base = [str(tmp_path), "-o", str(tmp_path / "out"), "--data", "wikitext2"]
    for extra, bf16 in (([], False), (["--dtype", "bf16"], True), (["--bf16"], True)):
        result = invoke(["finetune", *base, *extra])
        assert isinstance(result.exception, _Built), result.output
        assert seen[-1].bf16 is bf16 and seen[-1].lr == FINETUNE_FIELDS[3].default
    result = invoke(["finetune", *base, "--bf16", "--dtype", "fp32"])
    assert result.exit_code == 2 and "--bf16 and --dtype fp32 disagree" in str(result.exception)
    assert command.FinetuneConfig is FinetuneConfig
    assert json.dumps(seen[0].result_fields())  # the resume key still records bf16


def test_sweep_axes_take_method_options_and_torch_dtype_names() -> None:
    """A sweep file's base and axes are recipes: a method option is an axis like any other setting."""
    from tsenor_cli.sweep.spec import check_recipes, parse_sweep

    grid = {"base": {"model": "m", "nm": "2:4", "dtype": "float32"}, "axes": {"alps_rho0": [0.1, 0.2]}}
    spec = parse_sweep(grid, "s.yaml")
    runs = spec.runs()
    assert [run.name for run in runs] == ["alps_rho0-0.1", "alps_rho0-0.2"]
    check_recipes(spec, runs)
    options = [build_config(run.recipe_dict(), force=False, resume=True, command="x").matrix.options for run in runs]
    assert options == [ALPSOptions(rho0=0.1), ALPSOptions(rho0=0.2)]
    bad = parse_sweep({"base": {"model": "m", "nm": "2:4", "method": "wanda"}, "axes": {"alps_rho0": [0.2]}}, "s.yaml")
    with pytest.raises(UsageError, match=r"--alps-rho0 is not an option of --method wanda; its options: none"):
        check_recipes(bad, bad.runs())


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["prune", "m", "--nm", "2:4", "--nsamples", "0"], "--nsamples 0 must be >= 1; pass 1 or more (default 128)"),
        (["prune", "--nm", "2:4"], "a model is required; pass MODEL"),
        (["eval"], "a model is required; pass MODEL"),
        (["eval", "a", "--model", "b"], "MODEL a and --model b both given"),
    ],
)
def test_settings_are_checked_once_at_config_build_with_one_line(argv: list[str], expected: str) -> None:
    result = invoke(argv)
    assert result.exit_code == 2 and isinstance(result.exception, UsageError), result.output
    assert str(result.exception).startswith(expected) and "\n" not in str(result.exception)

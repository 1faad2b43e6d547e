"""The CLI reference page (docs/reference/cli.md), generated from the commands themselves.

`python -m tsenor_cli.cli.reference` rewrites the page; tests/test_cli_options.py fails when the
committed page differs from what the commands say, so the reference cannot drift from `--help`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from tsenor_cli import atomic

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"


def commands(group: Any, prefix: str = "tsenor") -> list[tuple[str, Any]]:
    """(full name, command) of every leaf command under `group`, sorted by name.

    Duck-typed (groups have ``commands``): typer builds on its own vendored click, whose classes are
    not public.
    """
    found: list[tuple[str, Any]] = []
    for name in sorted(group.commands):
        command = group.commands[name]
        if hasattr(command, "commands"):
            found += commands(command, f"{prefix} {name}")
        else:
            found.append((f"{prefix} {name}", command))
    return found


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(param: Any) -> str:
    if param.required:
        return "required"
    value = param.default
    if value is None or value == () or (getattr(param, "is_flag", False) and value is False):
        return ""
    return f"`{value}`" if not isinstance(value, bool) else f"`{str(value).lower()}`"


def _choices(param: Any) -> str:
    """The choices a setting's help shows (`<a|b|c>`), as `a`, `b`, `c`."""
    from tsenor_cli.cli.options import LAZY_CHOICES

    metavar = param.metavar or ""
    if metavar in LAZY_CHOICES:
        return ", ".join(f"`{c}`" for c in LAZY_CHOICES[metavar].choice_list() or ())
    if "|" in metavar:
        return ", ".join(f"`{c}`" for c in metavar.strip("<>[]").split("|"))
    return ""


def render() -> str:
    """The Markdown page: one section per command, its arguments and options as a table."""
    from tsenor_cli.cli import app

    root = typer.main.get_command(app)
    lines = [
        "# Command-line reference",
        "",
        "Generated from the commands by `python -m tsenor_cli.cli.reference`; the test suite checks it is current.",
        "Options shared by several commands are defined once (`tsenor_cli/cli/options.py`), the settings of",
        "prune and finetune in their field lists (`pruning/settings/table.py`, `finetune/config.py`); (hidden)",
        "marks an old name kept for one release. Errors are one line (`error: …`) with the exit codes listed in",
        "`docs/reliability.md`.",
        "",
    ]
    for name, command in commands(root):
        lines += [f"## `{name}`", "", _cell(command.help or ""), "", "| argument / option | default | meaning |"]
        lines.append("|---|---|---|")
        for param in command.params:
            if param.param_type_name == "argument":
                label = f"`{(param.name or '').upper()}`"
                help_text = getattr(param, "help", None) or ""
            elif param.param_type_name == "option":
                flags = [*param.opts, *param.secondary_opts]
                label = ", ".join(f"`{f}`" for f in flags)
                help_text = ("(hidden) " if param.hidden else "") + (param.help or "")
                choices = _choices(param)
                help_text += f" Choices: {choices}." if choices else ""
            else:
                continue
            lines.append(f"| {label} | {_default(param)} | {_cell(help_text)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    atomic.write_text(PAGE, render())
    sys.stdout.write(f"wrote {PAGE}\n")


if __name__ == "__main__":
    main()

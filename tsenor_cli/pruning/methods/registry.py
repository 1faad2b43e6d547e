"""The pruning methods a run can name: the four built in (`PRUNERS`), those a package installs under the
`tsenor.methods` entry-point group, and any `PrunerSpec` named as `package.module:NAME` (`get_pruner`).

Each method is declared once, by the `PrunerSpec` its module ends with (`pruning/methods/method.py`). Torch-free:
`tsenor --help` lists the methods and their options without loading torch (a method imports torch
inside the functions that run it).
"""

from __future__ import annotations

import importlib
from functools import cache
from importlib.metadata import entry_points

from tsenor_cli.errors import UsageError
from tsenor_cli.pruning.methods import alps, magnitude, sparsegpt, wanda
from tsenor_cli.pruning.methods.method import PrunerSpec as PrunerSpec

# The entry-point group a package names its methods in (pyproject.toml:
# [project.entry-points."tsenor.methods"] NAME = "package.module:ATTRIBUTE", the attribute a PrunerSpec).
ENTRY_POINT_GROUP = "tsenor.methods"

PRUNERS: dict[str, PrunerSpec] = {module.METHOD.name: module.METHOD for module in (magnitude, wanda, sparsegpt, alps)}


def installed_names() -> tuple[str, ...]:
    """The names of the methods installed under `ENTRY_POINT_GROUP` (read from the packages' metadata,
    nothing imported), built-in names excluded."""
    return tuple(sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} - PRUNERS.keys()))


@cache
def installed() -> dict[str, PrunerSpec | UsageError]:
    """{name: its `PrunerSpec`, or the line saying why it could not be loaded} of every installed method.
    A broken package must not stop `tsenor --help` or another method's run: its error is raised when
    its method is named (`get_pruner`)."""
    found: dict[str, PrunerSpec | UsageError] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in PRUNERS or ep.name in found:
            continue
        try:
            found[ep.name] = _declared(ep.value, f"the {ENTRY_POINT_GROUP} entry point {ep.name} = {ep.value}")
        except UsageError as exc:
            found[ep.name] = exc
        if isinstance(spec := found[ep.name], PrunerSpec) and spec.name != ep.name:
            found[ep.name] = UsageError(
                f"the {ENTRY_POINT_GROUP} entry point {ep.name} = {ep.value} declares the method {spec.name!r}; "
                f"name the entry point {spec.name}"
            )
    return found


def method_names() -> tuple[str, ...]:
    """Every name `--method` takes besides a `package.module:NAME`: the built-in and installed methods."""
    return (*PRUNERS, *installed_names())


def all_methods() -> tuple[PrunerSpec, ...]:
    """The built-in methods and the installed ones that load (those whose options are flags and keys)."""
    return (*PRUNERS.values(), *(spec for spec in installed().values() if isinstance(spec, PrunerSpec)))


def is_reference(name: str) -> bool:
    """Whether a --method value names a method by `package.module:NAME`."""
    return ":" in name


def get_pruner(name: str) -> PrunerSpec:
    """The method a --method value names: a built-in or installed name, or `package.module:NAME` (that
    module's attribute, a `PrunerSpec`). An unknown or broken one is one UsageError line (exit 2)."""
    if name in PRUNERS:
        return PRUNERS[name]
    if is_reference(name):
        return _declared(name, f"--method {name}")
    spec = installed().get(name)
    if spec is None:
        raise UsageError(
            f"unknown pruning method {name!r}; choose one of: {', '.join(method_names())}, "
            "or name one as package.module:NAME"
        )
    if isinstance(spec, UsageError):
        raise spec
    return spec


def _declared(reference: str, where: str) -> PrunerSpec:
    """`package.module:NAME` → that attribute, which must be a `PrunerSpec`; every failure one line."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute.isidentifier():
        raise UsageError(f"{where}: name a method as package.module:NAME (e.g. mypkg.methods:METHOD)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UsageError(f"{where}: no module named {exc.name!r}; install it or add its folder to PYTHONPATH") from exc
    except Exception as exc:
        # The module is someone else's code: whatever it raises while importing is reported in one line.
        raise UsageError(f"{where}: importing {module_name} failed: {type(exc).__name__}: {exc}") from exc
    spec = getattr(module, attribute, None)
    if not isinstance(spec, PrunerSpec):
        found = "nothing" if spec is None else f"a {type(spec).__name__}"
        raise UsageError(
            f"{where}: {module_name}.{attribute} is {found}, not a PrunerSpec (tsenor_cli.pruning.methods.method); "
            "see docs/architecture.md, How to add a pruning method"
        )
    return spec

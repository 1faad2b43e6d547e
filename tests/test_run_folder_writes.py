"""One package writes into a run folder: `runfiles/` (the run folder's and the sweep folder's file names,
schemas and writers). Any other module of the library that writes a file, makes or removes a folder is
listed in `ELSEWHERE` with what it writes, none of it a run folder or a sweep folder; a new writer
elsewhere fails here until it moves into `runfiles/` or is listed with its reason.

A write is found in the source (`writes`): a call of `tsenor_cli.atomic`'s writers, Path's and shutil's
writing and removing calls, `open` or `Path.open` for writing, os' renames and removals, safetensors'
`save_file`, `torch.save`, `save_pretrained`, tempfile's folders and files."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tsenor_cli

PACKAGE = Path(tsenor_cli.__file__).parent
OWNER = "runfiles"

ATOMIC_WRITERS = {"write_bytes", "write_text", "write_json", "save_safetensors", "atomic_dir", "recover"}
# Methods that write or remove whatever object they are called on (Path's, a model's, a tokenizer's).
WRITING_METHODS = {
    "write_text", "write_bytes", "save_pretrained", "mkdir", "rmdir", "unlink", "touch", "symlink_to",
    "hardlink_to", "chmod", "rename",
}  # fmt: skip
MODULE_WRITERS = {
    "shutil": {"copy", "copy2", "copyfile", "copytree", "move", "rmtree", "copyfileobj"},
    "os": {"replace", "rename", "remove", "unlink", "rmdir", "makedirs", "mkdir", "symlink", "link"},
    "tempfile": {"mkdtemp", "mkstemp", "NamedTemporaryFile", "TemporaryDirectory"},
    "torch": {"save"},
    "atomic": ATOMIC_WRITERS,
}
IMPORTED_WRITERS = {"save_file", *ATOMIC_WRITERS, "copy2", "copytree", "rmtree", "mkdtemp", "mkstemp"}

# Modules outside runfiles/ that write, and what: none of it is a run folder or a sweep folder.
ELSEWHERE = {
    "atomic.py": "the atomic writers themselves, which runfiles/ calls",
    "tensorfile.py": "one safetensors file, into the temporary file atomic.save_safetensors opens",
    "outputs.py": "a probe file made and removed beside --output to see that it can be written",
    "locks.py": "the lock file beside a locked folder",
    "models/embedded.py": "the embedded model's folder in the cache",
    "models/saving.py": "a checkpoint's files, into the temporary folder runfiles/write.py opens",
    "packed/files.py": "the packed weight files, into the temporary folder runfiles/write.py opens",
    "report/__init__.py": "`tsenor report --output`: a comparison of runs, not a run",
    "cli/reference.py": "docs/reference/cli.md",
    "cli/bench.py": "`tsenor bench --output`: a benchmark's result files",
    "bench/prune.py": "the benchmark's generated checkpoints and outputs in a scratch folder",
    "bench/memory.py": "the benchmark's generated checkpoints, texts and outputs in a scratch folder",
    "bench/checkpoint.py": "the benchmark's dense and packed checkpoints in a scratch folder",
    "phases.py": "/proc/self/clear_refs, to reset the process's peak resident set between phases",
}


def _is_write_mode(call: ast.Call, position: int) -> bool:
    """Whether an open call's mode (positional at `position`, or mode=) writes: w, a, x or +."""
    modes = [kw.value for kw in call.keywords if kw.arg == "mode"]
    if len(call.args) > position:
        modes.append(call.args[position])
    return any(isinstance(m, ast.Constant) and isinstance(m.value, str) and set(m.value) & set("wax+") for m in modes)


def _write_of(node: ast.AST) -> str | None:
    """What `node` writes, None when it writes nothing: a module's writer named (called or handed on, as
    ``partial(atomic.save_safetensors, …)``), an imported writer named, a writing method or open called."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in MODULE_WRITERS:
        return f"{node.value.id}.{node.attr}" if node.attr in MODULE_WRITERS[node.value.id] else None
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in IMPORTED_WRITERS:
        return f"{node.id}()"
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and not (isinstance(func.value, ast.Name) and func.value.id in MODULE_WRITERS):
        if func.attr in WRITING_METHODS:
            return f".{func.attr}()"
        if func.attr == "open" and _is_write_mode(node, 0):
            return ".open() for writing"
    if isinstance(func, ast.Name) and func.id == "open" and _is_write_mode(node, 1):
        return "open() for writing"
    return None


def writes(source: str) -> list[str]:
    """The writes of one module's source: "line: what" for each call or writer named that writes or removes
    a file or folder."""
    found = [(n.lineno, n.col_offset, what) for n in ast.walk(ast.parse(source)) if (what := _write_of(n)) is not None]
    return [f"{line}: {what}" for line, _, what in sorted(found)]


def _modules() -> dict[str, str]:
    """{path relative to tsenor_cli/: source} of every module outside runfiles/."""
    return {
        path.relative_to(PACKAGE).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != OWNER
    }


def test_only_runfiles_writes_into_a_run_folder() -> None:
    """Every module outside runfiles/ that writes is one of `ELSEWHERE`."""
    offenders = {name: found for name, source in _modules().items() if (found := writes(source))}
    assert {name: found for name, found in offenders.items() if name not in ELSEWHERE} == {}


def test_every_module_listed_elsewhere_still_writes() -> None:
    """The list holds no module that stopped writing (it would let a new write there pass unseen)."""
    modules = _modules()
    assert sorted(name for name in ELSEWHERE if name not in modules or not writes(modules[name])) == []


def test_runfiles_writes_through_atomic() -> None:
    """The run folder's own writers are found by the same check (it sees the writes it is meant to)."""
    sources = [p.read_text(encoding="utf-8") for p in (PACKAGE / OWNER).glob("*.py")]
    seen = {what.split(": ", 1)[1] for source in sources for what in writes(source)}
    assert {"atomic.write_json", "atomic.save_safetensors", "atomic.atomic_dir", "atomic.write_text"} <= seen


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from tsenor_cli import atomic\natomic.write_json(out / 'eval.json', {})\n", ["2: atomic.write_json"]),
        ("from tsenor_cli.atomic import write_text\nwrite_text(out / 'x', 'y')\n", ["2: write_text()"]),
        ("with atomic.atomic_dir(out) as tmp:\n    pass\n", ["1: atomic.atomic_dir"]),
        ("(folder / 'README.md').write_text(text)\n", ["1: .write_text()"]),
        ("with open(path, 'wb') as f:\n    f.write(b'')\n", ["1: open() for writing"]),
        ("with (folder / name).open(mode='a') as f:\n    pass\n", ["1: .open() for writing"]),
        ("import shutil\nshutil.copy2(a, b)\nshutil.rmtree(c)\n", ["2: shutil.copy2", "3: shutil.rmtree"]),
        ("from safetensors.torch import save_file\nsave_file(t, str(p))\n", ["2: save_file()"]),
        ("model.save_pretrained(folder)\nos.replace(a, b)\n", ["1: .save_pretrained()", "2: os.replace"]),
        ("writer.submit(get, partial(atomic.save_safetensors, path=p))\n", ["1: atomic.save_safetensors"]),
    ],
)
def test_a_hand_made_write_is_found(source: str, expected: list[str]) -> None:
    assert writes(source) == expected


@pytest.mark.parametrize(
    "source",
    [
        "text = (folder / 'eval.json').read_text()\n",
        "with open(path) as f:\n    f.read()\n",
        "with open(path, 'rb') as f:\n    f.read()\n",
        "name = key.replace('_', '-')\n",
        "atomic.temp_prefix(out)\n",
    ],
)
def test_a_read_is_not_a_write(source: str) -> None:
    assert writes(source) == []

"""`source_revision`: the commit of the checkout that runs, and nothing outside a git checkout."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tsenor_cli.provenance import source_revision

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git executable")


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _repo(tmp_path: Path) -> Path:
    pkg = tmp_path / "repo" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    root = pkg.parent
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return pkg


def test_clean_checkout_gives_head_and_an_edit_marks_it_dirty(tmp_path: Path) -> None:
    pkg = _repo(tmp_path)
    head = _git(pkg, "rev-parse", "--short=12", "HEAD")
    assert source_revision(pkg) == head
    (pkg / "__init__.py").write_text("x = 2\n")
    assert source_revision(pkg) == head + "+dirty"
    (pkg / "notes.txt").write_text("untracked files do not count\n")
    (pkg / "__init__.py").write_text("x = 1\n")
    assert source_revision(pkg) == head


def test_outside_git_or_untracked_package_gives_none(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "__init__.py").write_text("")
    assert source_revision(plain) is None
    assert capfd.readouterr() == ("", "")  # git's "fatal: not a git repository" stays in the pipe
    # A package directory inside some repository that does not track it (a venv's site-packages).
    pkg = _repo(tmp_path)
    inner = pkg.parent / "venv" / "site-packages" / "tsenor_cli"
    inner.mkdir(parents=True)
    (inner / "__init__.py").write_text("")
    assert source_revision(inner) is None

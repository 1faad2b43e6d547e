"""Which code produced a result: the package version and, for a git checkout, the commit.

Results made over several days while the code changes (docs/results.md) can only be compared when each
report says which code made it; `__version__` alone does not move between releases.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent


def source_revision(root: Path = PACKAGE_ROOT) -> str | None:
    """→ the short commit of the git checkout holding `root`, with "+dirty" when tracked files under
    `root` differ from it; None for an installed wheel, a tree outside git or no git executable."""
    git = shutil.which("git")
    if git is None:
        return None

    def run(*args: str) -> str | None:
        try:
            done = subprocess.run(
                [git, "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    # A wheel installed into a virtual environment inside some unrelated repository would otherwise
    # report that repository's commit: the package directory itself must be tracked.
    if run("ls-files", "--error-unmatch", "--", "__init__.py") is None:
        return None
    commit = run("rev-parse", "--short=12", "HEAD")
    if commit is None:
        return None
    status = run("status", "--porcelain", "--untracked-files=no", "--", ".")
    return commit + ("+dirty" if status else "")


def tsenor_versions() -> dict[str, str]:
    """→ {"tsenor": version} plus "tsenor_source" (the commit) when running from a git checkout; the
    shared head of every report's `versions`."""
    from tsenor_cli.version import __version__

    out = {"tsenor": __version__}
    revision = source_revision()
    if revision is not None:
        out["tsenor_source"] = revision
    return out

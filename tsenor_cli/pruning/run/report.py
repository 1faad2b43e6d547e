"""The library versions a pruning report records (the report itself: `tsenor_cli.runfiles.PruneReport`)."""

from __future__ import annotations

import platform


def versions() -> dict[str, str]:
    import torch
    import transformers

    from tsenor_cli.precision import machine_versions
    from tsenor_cli.provenance import tsenor_versions

    return {
        **tsenor_versions(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        **machine_versions(),
    }

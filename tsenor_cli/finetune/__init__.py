"""Fine-tuning a pruned checkpoint with its sparsity pattern fixed (`tsenor finetune`).

`finetune(cfg, data_dir) -> FinetuneReport` (run.py) reads the mask from the checkpoint's zeros
(masks.py, checked against the recorded pattern), trains with transformers' Trainer and the mask
callback (callback.py) on packed windows of the calibration text (data.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tsenor_cli.finetune.config import FinetuneConfig
from tsenor_cli.runfiles import FinetuneReport

if TYPE_CHECKING:
    from tsenor_cli.finetune.run import finetune as finetune

__all__ = ["FinetuneConfig", "FinetuneReport", "finetune"]


def __getattr__(name: str) -> Any:
    # `finetune` loads transformers' Trainer: imported when first used, so `tsenor --help` does not (PEP 562).
    if name == "finetune":
        from tsenor_cli.finetune.run import finetune

        return finetune
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Fine-tuning a pruned checkpoint with its sparsity pattern fixed (`tsenor finetune`).

`finetune(cfg, data_dir) -> FinetuneReport` (run.py) reads the mask from the checkpoint's zeros
(masks.py, checked against the recorded pattern), trains with transformers' Trainer and the mask
callback (callback.py) on packed windows of the calibration text (data.py).
"""

from tsenor_cli.finetune.run import FinetuneConfig, finetune
from tsenor_cli.runfiles import FinetuneReport

__all__ = ["FinetuneConfig", "FinetuneReport", "finetune"]

"""`--kernels sparse|dense`: the pruned linears of a model on the GPU's 2:4 sparse tensor cores.

This module declares the setting once (torch-free: `tsenor --help` reads it); `kernels/sparse.py` holds
the kernels, the choice of linears and their installation. `tsenor eval` takes the flag through
`cli/options.KernelsOpt`, `tsenor finetune` through `finetune/config.FINETUNE_FIELDS`.
"""

from __future__ import annotations

from tsenor_cli.fields import Field

KERNEL_CHOICES = ("dense", "sparse")
KERNELS = Field(
    "kernels",
    str,
    "dense",
    "Linear kernels: sparse runs each 2:4-pruned linear on CUDA's 2:4 sparse tensor cores (cuSPARSELt), "
    "its backward too when the mask is transposable; other patterns, devices and dtypes run dense, with one "
    "line saying why.",
    "Model",
    choices=KERNEL_CHOICES,
    result=False,
)

"""What a benchmark's numbers belong to: the machine, the device and the versions, defined once for every
`tsenor bench` subcommand and written beside its results (JSON) and on its page (Markdown).

The benchmarks run on shared machines (CI and development VMs of 2 cores), where other processes slow
both sides of a ratio, not always equally: the one-minute load average at the start says how busy the
machine was. `bf16_products` says whether the device multiplies bf16 matrices on instructions of its own
(`precision.py`): a CPU without them runs every bf16 timing tens of times slower, which no other field shows.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import torch

from tsenor_cli.precision import machine_versions, native_products
from tsenor_cli.version import __version__

BF16_PRODUCTS = {True: "native", False: "generic", None: "unknown"}


def environment(device: torch.device | str = "cpu") -> dict[str, Any]:
    """{date (UTC), tsenor, torch, transformers, python, platform, processor, cpu_threads, load_average,
    device, bf16_products ("native", "generic" or "unknown"), cpu and cpu_capability (the CPU's kind:
    `precision.machine_versions`)}; on a CUDA device also gpu (its name), cuda,
    compute_capability and cusparselt."""
    import transformers

    device = torch.device(device)
    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "tsenor": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0],
        "device": str(device),
        "bf16_products": BF16_PRODUCTS[native_products(device, torch.bfloat16)],
        **machine_versions(),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = str(torch.version.cuda)
        env["compute_capability"] = f"{major}.{minor}"
        cusparselt = torch.backends.cusparselt
        env["cusparselt"] = str(cusparselt.version()) if cusparselt.is_available() else "no"
    return env

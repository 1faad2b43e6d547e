"""Whether a device multiplies half-precision matrices in hardware, and the one line that says so when a
setting asks for products the device would run far slower than float32.

PyTorch's CPU products in bf16 or fp16 run on the CPU's matrix instructions where it has them (AVX-512 BF16
or AMX for bf16, AVX-512 FP16 or AMX-FP16 for fp16 on x86; BF16 and half-precision SIMD on Arm) and
otherwise on generic kernels, which are not a little slower but tens of times. Measured by
scripts/bf16_products.py on a 2-core AMD EPYC with AVX2 only (torch 2.13.0, one thread; docs/results.md,
"Twenty-seventh session"): a (2048 × 576)·(576 × 1536) product took 57.5 ms in float32, 4.32 s in bf16 (75×)
and 4.28 s in fp16 (77×), and one SmolLM2-135M block's forward and backward over 4 × 512 tokens (a
refinement step) 1.32 s in float32 against 16.15 s under bf16 autocast (12×; 9× with two threads). The
same step under autocast ran 1.8× *faster* than float32 on the AVX-512 BF16 machine of the earlier sessions
("Twenty-first session"). So `--refine-dtype bf16` (the 16:32 quality
recipe's) or `--dtype bf16` is right on one machine and turns a 24-minute run into hours on another, and
nothing in the run's output would say why: `warn_slow_products` says it once, before the work.

`native_products` answers from what the device reports: a GPU through `torch.cuda.is_bf16_supported`
(without emulation; every CUDA GPU multiplies fp16), a CPU through the instruction-set flags Linux lists in
``/proc/cpuinfo``. Where neither tells (another OS, a GPU this machine lacks: a login node planning a GPU
job), it answers None and nothing is said.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

from tsenor_cli.progress import logger

CPUINFO = Path("/proc/cpuinfo")
# The flags (x86 ``flags``, Arm ``Features``) under which each dtype's products have their own instructions.
CPU_FLAGS: dict[torch.dtype, frozenset[str]] = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16", "bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16", "asimdhp"}),
}
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# What the instructions are called in the line (the x86 ones: the machines this project's users run on).
INSTRUCTIONS = {torch.bfloat16: "avx512_bf16 or amx_bf16", torch.float16: "avx512_fp16 or amx_fp16"}

_warned: set[tuple[str, torch.dtype]] = set()


@functools.cache
def cpu_fields(path: Path = CPUINFO) -> dict[str, str]:
    """{field: value} of the first CPU `path` lists ("model name", "flags", ...), empty where the file is
    absent (not Linux)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first CPU's block ends at its blank line
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags(path: Path = CPUINFO) -> frozenset[str] | None:
    """The instruction-set flags of the first CPU `path` lists (x86 ``flags``, Arm ``Features``), None where
    the file is absent or lists none (not Linux)."""
    fields = cpu_fields(path)
    value = fields.get("flags", fields.get("Features"))
    return None if value is None else frozenset(value.split())


def machine_versions() -> dict[str, str]:
    """{"cpu": the CPU's name with its family and model numbers, "cpu_capability": the SIMD level torch's
    kernels dispatch to}: what besides the code decides a run's last bits. The same command, seed and code
    give other masks on another kind of CPU: SmolLM2-135M plain ALPS T2:4 gave WikiText-2 138.465 on the
    earlier sessions' AVX-512 machines, 139.399 on an AVX2 EPYC and 139.134 on an AVX-512 Xeon with AMX
    (docs/results.md, "Twenty-eighth session"). The reports record it so that two runs that differ can be
    told apart; the name alone does not do it (a VM may call its CPU "Intel(R) Xeon(R) Processor")."""
    fields = cpu_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    labels = {"cpu family": "family", "model": "model"}
    numbers = [f"{label} {fields[key]}" for key, label in labels.items() if key in fields]
    return {
        "cpu": f"{name} ({', '.join(numbers)})" if numbers else name,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def native_products(device: torch.device, dtype: torch.dtype) -> bool | None:
    """Whether `device` multiplies `dtype` (bf16 or fp16) matrices on instructions of its own: True, False, or
    None when it cannot tell (see the module docstring). float32 and wider are always native (True)."""
    if dtype not in CPU_FLAGS:
        return True
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return dtype == torch.float16 or torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        flags = cpu_flags()
        return None if flags is None else bool(flags & CPU_FLAGS[dtype])
    return None


def slow_products_line(device: torch.device, dtype: torch.dtype, settings: Sequence[str], fix: str) -> str | None:
    """The warning for `settings` (the flags that ask for `dtype` products, e.g. ``--refine-dtype bf16``) on
    `device`, with `fix` (the flags that avoid them); None when the device has the instructions or cannot tell."""
    if not settings or native_products(device, dtype) is not False:
        return None
    what = " and ".join(settings)
    name = NAMES[dtype]
    if device.type == "cuda":
        where = f"this GPU ({torch.cuda.get_device_name(device)}) has no {name} matrix units"
    else:
        where = f"this CPU has no {name} matrix instructions ({INSTRUCTIONS[dtype]})"
    return (
        f"{what}: {where}, and its {name} products run several to tens of times slower than fp32 "
        f"(a refinement step 9-12x, a matrix product 75x on an AVX2 CPU); pass {fix}"
    )


def warn_slow_products(device: torch.device, dtype: torch.dtype, settings: Sequence[str], fix: str) -> None:
    """Say `slow_products_line` on stderr, once per device kind and dtype in a process (a prune that distils
    plans its distillation twice)."""
    line = slow_products_line(device, dtype, settings, fix)
    key = (device.type, dtype)
    if line is not None and key not in _warned:
        _warned.add(key)
        logger.warning(line)

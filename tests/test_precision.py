"""Half-precision products on a device without instructions for them (`tsenor_cli/precision.py`): read from
what the device reports, said once before the work with the flags that ask for them and the ones that avoid them,
and never said where the device has the instructions or cannot tell."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_cli import invoke

from tsenor_cli import precision

AVX2 = frozenset({"fpu", "sse2", "avx2", "fma"})
CpuWith = Callable[[frozenset[str] | None], None]


@pytest.fixture
def cpu_with(monkeypatch: pytest.MonkeyPatch) -> CpuWith:
    """cpu_with(flags): the CPU reports `flags` (None: it reports none), and nothing was said yet."""
    monkeypatch.setattr(precision, "_warned", set())

    def patch(flags: frozenset[str] | None) -> None:
        monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
        monkeypatch.setattr(precision, "_warned", set())

    return patch


def test_the_flags_are_read_from_an_x86_or_an_arm_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd asimdhp bf16\n")
    bare = tmp_path / "bare"
    bare.write_text("processor\t: 0\nmodel name\t: a CPU\n")
    assert precision.cpu_flags(x86) == frozenset({"fpu", "avx2", "avx512_bf16"})  # the first CPU's
    assert precision.cpu_flags(arm) == frozenset({"fp", "asimd", "asimdhp", "bf16"})
    assert precision.cpu_flags(bare) is None
    assert precision.cpu_flags(tmp_path / "absent") is None
    # The fields are the first CPU's: the second's block (after the blank line) is not read.
    assert precision.cpu_fields(x86) == {"processor": "0", "flags": "fpu avx2 avx512_bf16"}
    assert precision.cpu_fields(bare) == {"processor": "0", "model name": "a CPU"}


def test_the_reports_name_the_cpus_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's name with its family and model numbers (a VM's name alone says little), and torch's SIMD level."""
    import platform

    xeon = {"model name": "Intel(R) Xeon(R) Processor", "cpu family": "6", "model": "207", "flags": "avx512f"}
    monkeypatch.setattr(precision, "cpu_fields", lambda: xeon)
    capability = torch.backends.cpu.get_cpu_capability()
    assert precision.machine_versions() == {
        "cpu": "Intel(R) Xeon(R) Processor (family 6, model 207)",
        "cpu_capability": capability,
    }
    monkeypatch.setattr(precision, "cpu_fields", dict)  # no /proc/cpuinfo: the platform's name
    assert precision.machine_versions()["cpu"] == (platform.processor() or platform.machine())


@pytest.mark.parametrize(
    ("flags", "dtype", "native"),
    [
        (AVX2, torch.bfloat16, False),
        (AVX2 | {"avx512_bf16"}, torch.bfloat16, True),
        (AVX2 | {"amx_bf16"}, torch.bfloat16, True),
        (AVX2 | {"avx512_bf16"}, torch.float16, False),  # bf16 instructions do not multiply fp16
        (AVX2 | {"avx512_fp16"}, torch.float16, True),
        (frozenset({"fp", "asimd", "bf16"}), torch.bfloat16, True),
        (AVX2, torch.float32, True),
        (None, torch.bfloat16, None),
    ],
)
def test_the_cpu_answer_follows_its_flags(
    cpu_with: CpuWith, flags: frozenset[str] | None, dtype: torch.dtype, native: bool | None
) -> None:
    cpu_with(flags)
    assert precision.native_products(torch.device("cpu"), dtype) is native


def test_a_device_it_cannot_read_is_not_judged() -> None:
    assert precision.native_products(torch.device("meta"), torch.bfloat16) is None
    if not torch.cuda.is_available():  # a login node planning a GPU job
        assert precision.native_products(torch.device("cuda"), torch.bfloat16) is None
        assert precision.slow_products_line(torch.device("cuda"), torch.bfloat16, ["--dtype bf16"], "x") is None


def test_the_line_names_the_settings_and_their_fix(cpu_with: CpuWith) -> None:
    cpu_with(AVX2)
    line = precision.slow_products_line(
        torch.device("cpu"), torch.bfloat16, ["--refine-dtype bf16", "--distill-dtype bf16"], "--refine-dtype fp32"
    )
    assert line is not None and "\n" not in line
    assert line.startswith("--refine-dtype bf16 and --distill-dtype bf16: this CPU has no bf16 matrix instructions")
    assert line.endswith("; pass --refine-dtype fp32")
    assert precision.slow_products_line(torch.device("cpu"), torch.bfloat16, [], "--dtype fp32") is None
    cpu_with(AVX2 | {"avx512_bf16"})
    assert precision.slow_products_line(torch.device("cpu"), torch.bfloat16, ["--dtype bf16"], "x") is None


def _dry_run(model: Path, *flags: str) -> str:
    """The dry run's stderr (a distillation's plan needs the output folder named: none is written)."""
    result = invoke(["prune", "--model", str(model), "--nm", "16:32", "--nsamples", "4", "--seqlen", "16",
                     "--output", str(model.parent / "never-written"), *flags, "--dry-run"])  # fmt: skip
    assert result.exit_code == 0, result.output
    return result.stderr


def test_the_dry_run_says_once_which_settings_compute_in_bf16(tiny: Path, cpu_with: CpuWith) -> None:
    cpu_with(AVX2)
    said = _dry_run(tiny, "--dtype", "bf16", "--refine", "block", "--refine-dtype", "bf16",
                    "--distill-steps", "2", "--distill-dtype", "bf16")  # fmt: skip
    # The prune's plan and the distillation's both see bf16: one line, every setting named with its fix.
    assert said.count("matrix instructions") == 1, said
    assert "--dtype bf16 and --refine-dtype bf16 and --distill-dtype bf16: this CPU has no bf16" in said
    assert "pass --dtype fp32 --refine-dtype fp32 --distill-dtype fp32" in said
    cpu_with(AVX2)
    # A refinement that is off computes nothing in bf16, whatever its dtype says.
    assert "matrix instructions" not in _dry_run(tiny, "--refine-dtype", "bf16")
    assert "matrix instructions" not in _dry_run(tiny, "--refine", "block")
    cpu_with(AVX2 | {"amx_bf16"})
    assert "matrix instructions" not in _dry_run(tiny, "--refine", "block", "--refine-dtype", "bf16")
    assert not (tiny.parent / "never-written").exists()


def test_a_benchmark_records_whether_its_cpu_multiplies_bf16(cpu_with: CpuWith) -> None:
    from tsenor_cli.bench.machine import environment

    for flags, said in ((AVX2, "generic"), (AVX2 | {"avx512_bf16"}, "native"), (None, "unknown")):
        cpu_with(flags)
        assert environment("cpu")["bf16_products"] == said
    assert environment("cpu")["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_a_prune_report_records_the_cpus_kind() -> None:
    from tsenor_cli.pruning.run.report import versions

    assert {"cpu", "cpu_capability"} <= set(versions())

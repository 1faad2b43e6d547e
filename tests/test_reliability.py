"""Bad input is caught early and always reported as one `error:` line with its documented exit code.

Each test is a row of the table in docs/reliability.md ("Input errors"). The CLI runs in-process through
`main(argv)`, the console-script entry, so what is checked is exactly what a user sees on stderr.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tsenor_cli.cli import DEBUG_HINT, main
from tsenor_cli.errors import BadInputError
from tsenor_cli.outputs import human_bytes
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.phases import host_peak, reset_host_peak
from tsenor_cli.pruning.block import finite
from tsenor_cli.pruning.block.finite import all_finite, first_non_finite
from tsenor_cli.pruning.block.memory import ALLOCATOR_SLACK, Demand, Limits, fit_refusal
from tsenor_cli.pruning.methods.stats import reconstruction_error
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.plan.plan import plan_model
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.settings import RunContext

QPROJ = "model.layers.0.self_attn.q_proj.weight"


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit code, stderr) of `tsenor argv` run through the console-script entry."""
    capsys.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def error_line(stderr: str) -> str:
    """The single `error:` line of stderr (progress lines may precede it); fails unless there is exactly one."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert stderr.rstrip().endswith(errors[0]), f"something follows the error line: {stderr}"
    return errors[0]


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "text.txt"
    path.write_text(" ".join(f"Sentence number {i} about pruning tiles and weights." for i in range(200)))
    return path


def edited_copy(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of checkpoint `src` at `dst` whose tensors went through `edit` (in place)."""
    dst.mkdir(parents=True)
    for file in src.iterdir():
        if file.name != "model.safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def with_bad_value(src: Path, dst: Path, name: str, index: tuple[int, int], value: float) -> Path:
    """A copy of checkpoint `src` at `dst` with tensor `name`[index] set to `value`."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name][index] = value

    return edited_copy(src, dst, edit)


def prune_args(model: Path, calib: Path, output: Path, *extra: str) -> list[str]:
    # wanda: the cheapest method that reads the calibration text (magnitude reads none: issue 47)
    return [
        "prune",
        "--model",
        str(model),
        "--method",
        "wanda",
        "--calib-data",
        str(calib),
        "--nsamples",
        "2",
        "--seqlen",
        "32",
        "--output",
        str(output),
        *extra,
    ]


# ---- click's own usage errors: one line, exit 2 -------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["prune", "m", "--nm", "2:4", "--nproc", "0"], "Invalid value for '--nproc'"),
        (["prune", "--model", "m", "--bogus"], "No such option: --bogus"),
        (["eval", "m", "--max-windows", "0"], "Invalid value for '--max-windows'"),
        (["verify"], "Missing argument"),
    ],
)
def test_click_usage_errors_are_one_line(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(argv, capsys)
    assert code == 2
    line = error_line(err)
    assert expected in line and "--help" in line
    assert "╭" not in err and "Usage:" not in err  # no usage box


def test_unexpected_exception_is_one_line_with_the_debug_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import tsenor_cli.pruning.run.verify as verify_lib  # the command imports it when it runs

    def broken(_directory: Path) -> None:
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setattr(verify_lib, "verify_checkpoint", broken)
    code, err = run_cli(["verify", str(tmp_path)], capsys)
    assert code == 1
    line = error_line(err)
    assert line == f"error: unexpected RuntimeError: first line second line; {DEBUG_HINT}"
    assert "Traceback" not in err


# ---- item 1: NaN/Inf weights ------------------------------------------------------------------------------


def test_first_non_finite_finds_the_first_bad_entry_in_row_major_order() -> None:
    t = torch.zeros(4, 6)
    assert first_non_finite(t) is None
    t[3, 5] = math.nan
    t[2, 1] = -math.inf
    index, value, count = first_non_finite(t)  # type: ignore[misc]
    assert index == (2, 1) and value == -math.inf and count == 2


@pytest.mark.parametrize("shape", [(), (7,), (5, 3), (6, 2, 3)])
def test_the_sliced_finite_check_finds_a_bad_entry_in_any_slice(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...]
) -> None:
    """Slices of 4 entries: a first dimension split into several, rows wider than a slice (one row each)."""
    monkeypatch.setattr(finite, "FINITE_SLICE", 4)
    numel = math.prod(shape)
    for position in range(numel):
        for bad in (math.nan, math.inf, -math.inf):
            t = torch.zeros(numel)
            t[position] = bad
            assert not all_finite(t.reshape(shape))
            assert first_non_finite(t.reshape(shape)) is not None
    assert all_finite(torch.zeros(shape))
    assert all_finite(torch.zeros(0, 3)) and all_finite(torch.zeros(3, 0))
    assert all_finite(torch.zeros(6, 5).t())  # a transposed view is read in place, not copied


def test_the_finite_check_holds_one_slice_of_temporaries() -> None:
    """torch.isfinite on the whole of a 256 MiB fp32 tensor held 451 MiB more at its peak; sliced, 55 MiB."""
    weights = torch.ones(64 << 20)  # resident before the peak is reset
    start = reset_host_peak()
    if start is None:
        pytest.skip("this kernel cannot reset the peak resident set (/proc/self/clear_refs)")
    assert first_non_finite(weights) is None
    assert host_peak() - start < 128 << 20


def test_reconstruction_error_never_hides_a_nan() -> None:
    w = torch.ones(2, 3)
    gram = torch.eye(3)
    assert reconstruction_error(w, torch.zeros(2, 3), gram) == pytest.approx(1.0)  # all of it pruned
    bad = w.clone()
    bad[1, 2] = math.nan
    assert math.isnan(reconstruction_error(bad, torch.zeros(2, 3), gram))
    assert math.isnan(reconstruction_error(w, bad, gram))
    assert reconstruction_error(w, w, torch.zeros(3, 3)) == 0.0  # dead inputs: a zero output, not a NaN


@pytest.mark.parametrize(
    ("pattern", "value"),
    [(["--sparsity", "0.5"], math.nan), (["--nm", "2:4"], math.nan), (["--nm", "2:4", "--no-transposable"], math.inf)],
)
def test_prune_refuses_non_finite_weights_and_writes_nothing(
    pattern: list[str], value: float, tiny: Path, calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = with_bad_value(tiny, tmp_path / "bad", QPROJ, (3, 5), value)
    out = tmp_path / "out"
    code, err = run_cli(prune_args(bad, calib_file, out, *pattern), capsys)
    assert code == BadInputError.exit_code == 7
    line = error_line(err)
    assert QPROJ in line and "[3, 5]" in line and str(value) in line
    assert not out.exists() or not any(out.iterdir())


def test_non_finite_calibration_inputs_name_the_layer(
    tiny: Path, calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A finite but huge norm weight overflows the activations of the linears after it to Inf.
    bad = edited_copy(tiny, tmp_path / "bad", lambda t: t["model.layers.0.input_layernorm.weight"].fill_(3e38))
    code, err = run_cli(prune_args(bad, calib_file, tmp_path / "out", "--nm", "2:4"), capsys)
    assert code == 7
    line = error_line(err)
    assert "calibration inputs of model.layers.0.self_attn" in line and "NaN/Inf" in line


def test_verify_refuses_non_finite_weights(
    tiny: Path, calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert run_cli(prune_args(tiny, calib_file, out, "--sparsity", "0.5"), capsys)[0] == 0
    assert run_cli(["verify", str(out)], capsys)[0] == 0
    name = "model.layers.1.mlp.up_proj.weight"
    tensors = load_file(str(out / "model.safetensors"))
    tensors[name][7, 2] = math.inf
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    code, err = run_cli(["verify", str(out)], capsys)
    assert code == 7
    line = error_line(err)
    assert name in line and "[7, 2]" in line and "inf" in line


# ---- item 11: verify's inputs -----------------------------------------------------------------------------


def test_verify_input_errors(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(["verify", str(tiny)], capsys)
    assert code == 2 and "is not a tsenor checkpoint" in error_line(err)
    code, err = run_cli(["verify", str(tmp_path / "missing")], capsys)
    assert code == 3 and "does not exist" in error_line(err)
    code, err = run_cli(["verify", str(tiny / "config.json")], capsys)
    assert code == 2 and "is a file" in error_line(err)
    code, err = run_cli(["verify", str(tmp_path)], capsys)
    assert code == 3 and "has no config.json" in error_line(err)


# ---- item 7: broken checkpoints -----------------------------------------------------------------------------


def copy_checkpoint(src: Path, dst: Path, *, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir(parents=True)
    for file in src.iterdir():
        if file.is_file() and not file.name.startswith(skip):
            (dst / file.name).write_bytes(file.read_bytes())
    return dst


def test_truncated_safetensors_is_one_line(
    tiny: Path, calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = copy_checkpoint(tiny, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "out"
    code, err = run_cli(prune_args(broken, calib_file, out, "--sparsity", "0.5"), capsys)
    assert code == 7
    assert f"{weights} is truncated or corrupt" in error_line(err)
    assert not out.exists() or not any(out.iterdir())


def test_missing_tokenizer_files_is_one_line(
    tiny: Path, calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    no_tokenizer = copy_checkpoint(tiny, tmp_path / "no-tok", skip=("tokenizer",))
    code, err = run_cli(prune_args(no_tokenizer, calib_file, tmp_path / "out", "--sparsity", "0.5"), capsys)
    assert code == 3
    assert f"cannot load the tokenizer of {no_tokenizer}" in error_line(err)


# ---- item 8: --skip-incompatible with nothing left ------------------------------------------------------


def test_skip_incompatible_with_no_compatible_layer_is_refused(
    tiny: Path, calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code, err = run_cli(prune_args(tiny, calib_file, out, "--nm", "16:33", "--skip-incompatible"), capsys)
    assert code == 5
    assert "none of the 14 linear layers can take 16:33" in error_line(err)
    assert not out.exists() or not any(out.iterdir())
    # one compatible layer is enough to run (the others stay dense, as before)
    fine = tmp_path / "fine"
    code, err = run_cli(prune_args(tiny, calib_file, fine, "--nm", "32:64", "--skip-incompatible"), capsys)
    assert code == 0, err


# ---- item 6: everything checkable without the model is checked before loading it ----------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--eval", "--tasks", "typo"], "unknown zero-shot task(s) typo"),
        (["--eval", "--ppl", "wikitext3"], "unknown --ppl dataset(s) wikitext3"),
        (["--eval", "--ppl", "none"], "evaluates nothing"),
        (["--tasks", "piqa"], "--tasks applies with --eval only"),
    ],
)
def test_prune_checks_eval_options_before_loading(
    extra: list[str], expected: str, calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The model does not exist: an error about it would mean the options were checked too late.
    out = tmp_path / "out"
    code, err = run_cli(prune_args(tmp_path / "no-model", calib_file, out, "--nm", "2:4", *extra), capsys)
    assert code == 2
    assert expected in error_line(err)
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("empty.txt", "", "holds no text"),
        ("numbers.jsonl", '{"text": 5}\n', "has no string `text` field"),
        ("garbage.jsonl", "not json\n", "is not valid JSON"),
    ],
)
def test_calibration_file_contents_are_checked_before_loading(
    name: str, content: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calib = tmp_path / name
    calib.write_text(content)
    code, err = run_cli(prune_args(tmp_path / "no-model", calib, tmp_path / "out", "--nm", "2:4"), capsys)
    assert code == 2
    assert expected in error_line(err)


def test_calibration_too_short_for_seqlen_is_refused_before_the_weights_load(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whether the text fills --seqlen needs the tokenizer, not the weights: the error comes first."""
    from transformers import AutoModelForCausalLM

    def no_weights(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the weights were read before the calibration text was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    short = tmp_path / "short.txt"
    short.write_text("A few words only.")
    out = tmp_path / "new" / "deeper" / "out"
    code, err = run_cli(prune_args(tiny, short, out, "--nm", "2:4"), capsys)
    assert code == 2
    assert "need more than --seqlen 32" in error_line(err)
    # The folders made to hold the output's lock are gone again: the failed run left nothing.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


def test_named_data_without_a_source_is_refused_before_loading(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TSENOR_DATA_DIR", raising=False)
    argv = ["prune", "--model", str(tmp_path / "no-model"), "--nm", "2:4", "--offline", "--output", str(tmp_path / "o")]
    code, err = run_cli(argv, capsys)
    assert code == 3 and "no data for c4" in error_line(err)
    code, err = run_cli(["eval", "--model", str(tmp_path / "no-model"), "--ppl", "ptb", "--offline"], capsys)
    assert code == 3 and "no data for ptb" in error_line(err)


# ---- item 11: smaller ones --------------------------------------------------------------------------------


def test_mistyped_relative_path_is_not_called_a_hub_failure(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tiny.parent)
    code, err = run_cli(["eval", "--model", f"{tiny.name}/typo", "--ppl", "wikitext2", "--offline"], capsys)
    assert code == 3
    line = error_line(err)
    assert f"model directory {tiny.name}/typo does not exist" in line and "local HF cache" not in line


def test_capped_seqlen_is_announced(
    tiny: Path, calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = prune_args(tiny, calib_file, tmp_path / "out", "--sparsity", "0.5")
    argv[argv.index("--seqlen") + 1] = "4096"
    code, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "--seqlen 4096 is longer than the model's 512 positions; calibrating with 512" in err


# ---- issue 30 item 6: the smaller cases ------------------------------------------------------------------


def test_a_folder_without_weights_names_the_weights(
    tiny: Path, calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder with config.json and the tokenizer but no weights: the weights are named (was a
    tokenizer error), before the tokenizer is read."""
    bare = copy_checkpoint(tiny, tmp_path / "bare", skip=("model.safetensors",))
    expected = (
        f"error: {bare} has no weight files (*.safetensors or pytorch_model*.bin); copy the checkpoint's "
        "weights into it, or pass the folder that holds them"
    )
    for argv in (
        prune_args(bare, calib_file, tmp_path / "out", "--nm", "2:4"),
        ["eval", "--model", str(bare), "--ppl", "none", "--tasks", "piqa"],
    ):
        code, err = run_cli(argv, capsys)
        assert (code, error_line(err)) == (3, expected), argv


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the line for a machine without CUDA")
def test_nproc_with_a_missing_cuda_device_prints_its_line_once(tiny: Path, calib_file: Path, tmp_path: Path) -> None:
    """--nproc 2 --device cuda on a CPU machine: the launching process refuses the device before any rank
    starts (every rank used to print the same line)."""
    argv = prune_args(tiny, calib_file, tmp_path / "out", "--nm", "2:4", "--nproc", "2", "--device", "cuda")
    proc = subprocess.run([sys.executable, "-m", "tsenor_cli", *argv], capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert error_line(proc.stderr) == "error: device 'cuda' requested but no CUDA device is available; use --device cpu"


def test_tsenor_alone_prints_its_help_ending_with_a_newline(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli([], capsys)
    assert code == 2 and err.startswith("Usage: ") and err.endswith("\n") and not err.endswith("\n\n")


def test_quiet_silences_the_libraries_progress_bars_too(tiny: Path, calib_file: Path, tmp_path: Path) -> None:
    """`tsenor -q prune` writes nothing on stderr: neither tsenor's progress lines nor transformers'
    "Loading weights" bar, which a plain run shows (on a pipe too)."""

    def stderr(*root: str, out: str) -> str:
        # A whole load (--no-stream), so that transformers' own loading bar is there to be silenced.
        argv = [*root, *prune_args(tiny, calib_file, tmp_path / out, "--nm", "2:4", "--no-stream")]
        proc = subprocess.run([sys.executable, "-m", "tsenor_cli", *argv], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    assert "Loading weights" in stderr(out="plain")
    assert stderr("-q", out="quiet") == ""


# ---- issue 30 item 5: models that need their own code ----------------------------------------------------

CUSTOM_CONFIG = (
    "from transformers import LlamaConfig\n\n\nclass TinyConfig(LlamaConfig):\n    model_type = 'tsenor_tiny'\n"
)
CUSTOM_MODEL = (
    "from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import TinyConfig\n\n\n"
    "class TinyForCausalLM(LlamaForCausalLM):\n    config_class = TinyConfig\n"
)


def with_own_code(src: Path, dst: Path, *, code: bool) -> Path:
    """A copy of checkpoint `src` whose config.json names model code of its own (model type `tsenor_tiny`,
    unknown to transformers, and an auto_map); `code`: the two modules it names are there (a LLaMA under
    another name), else missing."""
    folder = copy_checkpoint(src, dst)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "tsenor_tiny"
    config["auto_map"] = {
        "AutoConfig": "configuration_tiny.TinyConfig",
        "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config))
    if code:
        (folder / "configuration_tiny.py").write_text(CUSTOM_CONFIG)
        (folder / "modeling_tiny.py").write_text(CUSTOM_MODEL)
    return folder


def test_a_model_that_needs_its_own_code_is_one_line_naming_trust_remote_code(
    tiny: Path, calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --trust-remote-code a checkpoint with its own code (config.json auto_map) is refused by
    prune (dry run too), eval and finetune with one line naming the flag (was "unexpected ValueError" and a
    hub URL made of the folder); with the flag but without the code files, the missing file is named; a
    model type transformers does not know and no code is exit 5. With the code and the flag the model is
    pruned, and its checkpoint (which carries the code) fine-tuned."""
    missing = with_own_code(tiny, tmp_path / "missing", code=False)
    out = tmp_path / "out"
    needs = (
        f"error: {missing} needs its own model code (configuration_tiny.TinyConfig, from config.json's auto_map); "
        "pass --trust-remote-code to run it, if you trust that code"
    )
    for argv in (
        prune_args(missing, calib_file, out, "--nm", "2:4"),
        prune_args(missing, calib_file, out, "--nm", "2:4", "--dry-run"),
        ["eval", "--model", str(missing), "--ppl", "none", "--tasks", "piqa", "--output", str(out)],
    ):
        code, err = run_cli(argv, capsys)
        assert (code, error_line(err)) == (2, needs), argv
    code, err = run_cli(prune_args(missing, calib_file, out, "--nm", "2:4", "--trust-remote-code"), capsys)
    assert code == 3
    assert error_line(err) == (
        f"error: {missing}: config.json's auto_map names configuration_tiny.TinyConfig, but {missing} has no "
        "configuration_tiny.py; copy the model's code files into the checkpoint folder"
    )
    unknown = copy_checkpoint(tiny, tmp_path / "unknown")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "tsenor_tiny"}))
    code, err = run_cli(prune_args(unknown, calib_file, out, "--nm", "2:4", "--trust-remote-code"), capsys)
    assert code == 5 and "model type 'tsenor_tiny' is unknown to transformers" in error_line(err)
    assert not out.exists()

    custom = with_own_code(tiny, tmp_path / "custom", code=True)
    code, err = run_cli(prune_args(custom, calib_file, out, "--nm", "2:4", "--trust-remote-code"), capsys)
    assert code == 0, err
    assert (out / "modeling_tiny.py").is_file()  # save_pretrained keeps the model's code with the checkpoint
    tuned = tmp_path / "tuned"
    finetune = ["finetune", str(out), "--output", str(tuned), "--data", str(calib_file), "--seqlen", "16"]
    finetune += ["--max-steps", "1", "--batch-size", "1", "--ppl", "none", "--save-every", "0"]
    code, err = run_cli(finetune, capsys)
    assert code == 2 and error_line(err) == needs.replace(str(missing), str(out))
    code, err = run_cli([*finetune, "--trust-remote-code"], capsys)
    assert code == 0, err
    assert json.loads((tuned / "config.json").read_text())["model_type"] == "tsenor_tiny"


# ---- issue 30 item 3: sizes that cannot fit ------------------------------------------------------------


def test_sizes_that_cannot_fit_are_refused_before_any_allocation(
    tiny: Path, calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--nsamples 10^9 (tokens and activations of hundreds of TiB) is refused from the plan's own estimate,
    dry run or not, with --no-resume-state too (the free-space error used to send users there), before the
    process grows: it used to allocate 8 GB for half a minute and end in an unexpected RuntimeError."""
    out = tmp_path / "out"
    argv = [*prune_args(tiny, calib_file, out, "--nm", "2:4", "--no-resume-state")]
    argv[argv.index("--nsamples") + 1] = "1000000000"
    # The process's own peak (VmHWM), written at exit: a forked child's ru_maxrss also counts the pages
    # it shared with pytest before exec (CI saw 2.8 GB in the full suite for a 0.6 GB process).
    peak_file = tmp_path / "peak"
    child = (
        "import atexit, os, pathlib, sys\n"
        "from tsenor_cli.cli import main\n"
        "status = pathlib.Path('/proc/self/status')\n"
        "atexit.register(lambda: pathlib.Path(os.environ['PEAK_FILE']).write_text("
        "next(l for l in status.read_text().splitlines() if l.startswith('VmHWM'))))\n"
        "main(sys.argv[1:])\n"
    )
    env = {**os.environ, "PEAK_FILE": str(peak_file)}
    proc = subprocess.run([sys.executable, "-c", child, *argv], capture_output=True, text=True, env=env)
    stderr = proc.stderr
    assert proc.returncode == 5, stderr
    line = error_line(stderr)
    assert line.startswith(
        "error: --nsamples 1000000000 × --seqlen 32 needs about 15.4 TiB of host memory (weights outside the blocks "
    )
    assert line.endswith("are available; pass a smaller --nsamples or --seqlen (nothing was written)")
    peak_kib = int(peak_file.read_text().split()[1])
    assert peak_kib < 2 * 1024 * 1024  # KiB: the interpreter, torch and the tiny model, no calibration set
    assert not out.exists()

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--dry-run"])
    printed = capsys.readouterr()
    assert exit_info.value.code == 5 and error_line(printed.err).split(", but ")[0] == line.split(", but ")[0]
    assert "estimated memory: host 15.4 TiB (weights outside the blocks " in printed.out  # the plan is printed first


def test_host_and_device_estimates_by_hand(tiny: Path, data_ctx: RunContext) -> None:
    """The plan's host estimate of the tiny LLaMA (hidden 64, fp32, 2 blocks) at 4 × 32 tokens, and the
    verdicts against given limits: host first, then the device with the fix that applies."""
    cfg = PruneConfig(
        model=str(tiny),
        matrix=MatrixPruneConfig(pattern=SparsityPattern.from_nm(2, 4, transposable=True)),
        method="sparsegpt",
        nsamples=4,
        seqlen=32,
        stream=False,  # the whole model held: the estimate's model term is every parameter
    )
    plan = plan_model(cfg, data_ctx)
    host = plan.host_memory
    assert host.model == plan.params * 4
    assert host.tokens == 2 * 4 * 32 * 8  # int64 ids and the index that cuts them
    assert host.activations == 2 * 4 * 32 * 64 * 4  # (S, T, H) in and out, on the CPU
    (device,) = plan.device_memory
    assert host.work == device.statistics + device.workspace
    assert host.allocator == round(ALLOCATOR_SLACK * device.workspace) > 0  # on the CPU: glibc's arenas
    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def verdict(
        device: torch.device, host_available: int, device_total: int | None, offload: bool = False, processes: int = 1
    ) -> str:
        demand = Demand(host, plan.device_bytes, device, nsamples=4, seqlen=32, processes=processes)
        refusal = fit_refusal(demand, Limits(host_available, device_total), offload_activations=offload)
        return "fits" if refusal is None else refusal

    assert verdict(cpu, host.total, None) == "fits"
    assert verdict(cpu, host.total - 1, None).startswith("--nsamples 4 × --seqlen 32 needs about ")
    assert verdict(cpu, 2 * host.total, None, processes=2) == "fits"
    assert "in each of 2 processes" in verdict(cpu, 2 * host.total - 1, None, processes=2)
    assert verdict(cuda, host.total, plan.device_bytes) == "fits"
    small = verdict(cuda, host.total, plan.device_bytes - 1)
    assert small.startswith(f"--nsamples 4 × --seqlen 32 needs about {human_bytes(plan.device_bytes)} of cuda memory")
    assert small.endswith("pass a smaller --nsamples or --seqlen, or --offload-activations (nothing was written)")
    assert "--offload-activations" not in verdict(cuda, host.total, plan.device_bytes - 1, offload=True)


# ---- the earlier cases of the table ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "code", "expected"),
    [
        ("bad --nm", 2, "N:M pattern 3:2 needs 1 <= N < M"),
        ("missing model", 3, "does not exist; pass an existing local checkpoint directory"),
        ("hub id offline", 3, "is not in the local HF cache and the hub is off"),
        ("existing output", 4, "holds files that are not a tsenor run (notes.txt)"),
        ("output is a file", 4, "is a file; choose a directory path"),
        ("output equals input", 2, "would overwrite the input checkpoint"),
        ("output inside input", 2, "is inside the input checkpoint"),
    ],
)
def test_earlier_input_errors(
    case: str,
    code: int,
    expected: str,
    tiny: Path,
    calib_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    model, out, extra = tiny, tmp_path / "out", ["--nm", "2:4"]
    if case == "bad --nm":
        extra = ["--nm", "3:2"]
    elif case == "missing model":
        model = tmp_path / "missing"
    elif case == "hub id offline":
        model = Path("someorg/somemodel")
        extra += ["--offline"]
    elif case == "existing output":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "output is a file":
        out.write_text("mine")
    elif case == "output equals input":
        out, extra = tiny, [*extra, "--force"]
    elif case == "output inside input":
        out = tiny / "pruned"
    before = sorted(p.name for p in out.iterdir()) if out.is_dir() else None
    got, err = run_cli(prune_args(model, calib_file, out, *extra), capsys)
    assert got == code
    assert expected in error_line(err)
    assert (sorted(p.name for p in out.iterdir()) if out.is_dir() else None) == before  # nothing written

"""The output folder (docs/reliability.md): the lock, what --force may replace, the location checked
before any model is loaded, and the temporaries of killed runs recovered or removed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from helpers_cli import invoke
from helpers_faults import FullDisk, Killed, KillSwitch
from safetensors.torch import load_file
from typer.testing import Result

from tsenor_cli import atomic
from tsenor_cli.errors import OutputBusyError, OutputUnwritableError
from tsenor_cli.locks import lock_path
from tsenor_cli.outputs import output_lock
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.plan.plan import plan_model
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.runfiles import EVAL_FILE, PRUNE_FILE, RESUME_DIR
from tsenor_cli.runfiles import output as output_module
from tsenor_cli.settings import RunContext

REPO = Path(__file__).resolve().parents[1]
FAST = ["--method", "wanda", "--nm", "2:4", "--solver", "exhaustive", "--nsamples", "2", "--seqlen", "16"]


@pytest.fixture(scope="module")
def calib(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_bytes((data_dir / "wikitext-2-raw" / "wiki.valid.raw").read_bytes()[:20_000])
    return path


def _prune(model: Path | str, calib: Path, output: Path, *extra: str) -> Result:
    return invoke(["prune", "--model", str(model), *FAST, "--calib-data", str(calib), "--output", str(output), *extra])


def _line(result: Result) -> str:
    """The one line main() prints for a known error."""
    text = str(result.exception)
    assert "\n" not in text
    return text


# ---------------------------------------------------------------- the lock


def test_a_second_run_gets_the_lock_error_and_a_killed_holder_leaves_no_stale_lock(
    tiny: Path, calib: Path, tmp_path: Path
) -> None:
    """A real second process holds the lock: the prune is refused naming its pid, writing nothing;
    once the holder is SIGKILLed the same prune runs."""
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable, "-c",
            "import sys, time; from pathlib import Path; from tsenor_cli.outputs import output_lock\n"
            "with output_lock(Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(600)",
            str(out),
        ],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        refused = _prune(tiny, calib, out)
        assert refused.exit_code == 4
        assert _line(refused).startswith(f"--output {out} is in use by another tsenor run (pid {holder.pid} on ")
        assert not out.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    assert lock_path(out).exists()  # left by the killed holder; its lock died with it
    result = _prune(tiny, calib, out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the lock file is gone after the run


def test_the_lock_is_exclusive_and_reacquired_after_release(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with output_lock(out):
        with pytest.raises(OutputBusyError, match=r"pid [0-9]+ on "), output_lock(out / ".." / "out"):
            pass  # another spelling of the same folder gets the same lock
        assert lock_path(out).read_text().startswith(f"{os.getpid()}@")
    assert not lock_path(out).exists()
    with output_lock(out):
        pass


# ---------------------------------------------------------------- what --force may replace


def test_force_replaces_only_a_tsenor_run_or_an_empty_folder(tiny: Path, calib: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    (foreign / "data").mkdir()
    refused = _prune(tiny, calib, foreign, "--force")
    assert refused.exit_code == 4
    assert "holds files that are not a tsenor run (data, notes.txt)" in _line(refused)
    assert sorted(p.name for p in foreign.iterdir()) == ["data", "notes.txt"]
    assert (foreign / "notes.txt").read_text() == "keep me"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert _prune(tiny, calib, empty).exit_code == 0
    report = (empty / "tsenor_report.json").read_bytes()
    same = _prune(tiny, calib, empty)  # the same command again: finished already, nothing rewritten
    assert same.exit_code == 0 and "already holds this run" in same.stderr
    assert (empty / "tsenor_report.json").read_bytes() == report
    other = _prune(tiny, calib, empty, "--seed", "1")  # other settings: the finished run is not replaced
    assert other.exit_code == 4 and "already holds a tsenor run; pass --force" in _line(other)
    assert (empty / "tsenor_report.json").read_bytes() == report
    replaced = _prune(tiny, calib, empty, "--force")
    assert replaced.exit_code == 0, replaced.output
    assert (empty / PRUNE_FILE).is_file() and not (empty / "extra.txt").exists()  # the whole run was replaced


def test_the_rerun_of_a_finished_prune_with_eval_writes_nothing_and_says_so(
    tiny: Path, calib: Path, data_dir: Path, tmp_path: Path
) -> None:
    """A requeued `prune --eval` job: the prune is found finished, and the eval.json this same command wrote
    is taken as it is (it was evaluated again), the summary is the first run's (its phases read back from
    the report), and the last line says nothing was written (it said "wrote OUT"). Other evaluation flags
    evaluate anew, and say so."""

    def prune(*extra: str) -> Result:
        return invoke(["prune", "--model", str(tiny), *FAST, "--calib-data", str(calib), "--output", str(out), *extra])

    out = tmp_path / "out"
    evaluate = ["--eval", "--ppl", "wikitext2", "--max-windows", "1", "--data-dir", str(data_dir)]
    first = prune(*evaluate)
    assert first.exit_code == 0, first.output
    assert first.stdout.splitlines()[-1].startswith(f"wrote {out} (")
    files = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}
    again = prune(*evaluate)
    assert again.exit_code == 0, again.output
    assert {path.name: path.stat().st_mtime_ns for path in out.iterdir()} == files
    assert f"{out / EVAL_FILE} holds this command's evaluation; nothing to do" in again.stderr
    done = again.stdout.splitlines()[-1]
    assert done.startswith(f"{out} already held this run (") and done.endswith("); nothing written"), done
    summary = [line for line in first.stdout.splitlines() if line.startswith("- total time:")]
    assert summary and summary == [line for line in again.stdout.splitlines() if line.startswith("- total time:")]
    assert "load " in summary[0]  # the phases, read back from tsenor_report.json on the rerun
    more = prune(*evaluate[:-4], "--max-windows", "2", "--data-dir", str(data_dir))
    assert more.exit_code == 0, more.output
    assert more.stdout.splitlines()[-1].endswith(f"; evaluated it into its {EVAL_FILE}")
    assert json.loads((out / EVAL_FILE).read_text())["perplexity"]["wikitext2"]["windows"] == 2
    assert (out / PRUNE_FILE).stat().st_mtime_ns == files[PRUNE_FILE]


# ---------------------------------------------------------------- the location, before any model is loaded


def test_an_unusable_output_location_fails_before_the_model_is_read(calib: Path, tmp_path: Path) -> None:
    """The model named here does not exist: the output's error coming first shows it is checked first."""
    missing_model = tmp_path / "no-such-model"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = {
        blocker / "out": f"--output {blocker}/out cannot be created: {blocker} is a file",
        Path("/proc/tsenor-out"): "--output /proc/tsenor-out is not writable: cannot create files in /proc",
        blocker: f"--output {blocker} is a file",
    }
    for output, start in cases.items():
        result = _prune(missing_model, calib, output)
        assert result.exit_code == 4, (output, result.output)
        assert _line(result).startswith(start), _line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no probe, no lock left behind


def test_not_enough_space_fails_before_the_model_is_loaded(
    tiny: Path, calib: Path, tmp_path: Path, data_ctx: RunContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = PruneConfig(
        model=str(tiny),
        matrix=MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True)),
        calib_data=str(calib),
        nsamples=2,
        seqlen=16,
    )
    plan = plan_model(cfg, data_ctx)
    # The checkpoint estimate is the model's own parameter count at fp32, tied embeddings counted once.
    params = sum(t.numel() for t in load_file(str(tiny / "model.safetensors")).values())
    assert plan.checkpoint_bytes == 4 * params
    hidden = json.loads((tiny / "config.json").read_text())["hidden_size"]
    block_bytes = plan.resume_bytes - 2 * 2 * 16 * hidden * 4  # two (2, 16, hidden) fp32 hidden-state files
    assert 0 < block_bytes < plan.checkpoint_bytes

    usage = namedtuple("usage", "total used free")
    # the tokenizer and the other files copied beside the weights count too (audit item 6)
    free = plan.checkpoint_bytes + plan.resume_bytes + output_module.copied_bytes(str(tiny)) - 1
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(10 * free, 9 * free, free))

    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the model was loaded before the free space was checked")

    monkeypatch.setattr("tsenor_cli.models.loading.load_model", never)
    out = tmp_path / "out"
    short = _prune(tiny, calib, out)
    assert short.exit_code == 4
    assert _line(short).startswith(f"not enough free space for --output {out}: the run writes about ")
    assert "--no-resume-state saves" in _line(short)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # without the resume state the checkpoint fits: the check passes and the (stubbed) load is reached
    fits = _prune(tiny, calib, out, "--no-resume-state")
    assert isinstance(fits.exception, AssertionError)


@pytest.mark.parametrize(("nm", "sparsity"), [((2, 4), None), (None, 0.5)], ids=["2:4", "unstructured"])
def test_a_packed_prune_s_checkpoint_estimate_is_its_weight_bytes(
    tiny: Path, calib: Path, tmp_path: Path, data_ctx: RunContext, nm: tuple[int, int] | None, sparsity: float | None
) -> None:
    """The dry run's checkpoint bytes (the free-space check's) for --save-format packed are the packed
    files' tensor bytes, from the format's size function: once the dense size, which kept a run that fits
    packed from starting on a disk too small for it dense."""
    import struct

    pattern = SparsityPattern.from_nm(*nm, transposable=True) if nm else SparsityPattern.unstructured(sparsity or 0)
    settings = {"matrix": MatrixPruneConfig(pattern), "calib_data": str(calib), "nsamples": 2, "seqlen": 16}
    dense = plan_model(PruneConfig(model=str(tiny), **settings), data_ctx)  # type: ignore[arg-type]
    cfg = PruneConfig(model=str(tiny), method="magnitude", save_format="packed", output=tmp_path / "out", **settings)  # type: ignore[arg-type]
    plan = plan_model(cfg, data_ctx)
    assert dense.packed_savings == 0 < plan.packed_savings == dense.checkpoint_bytes - plan.checkpoint_bytes
    prune_model(cfg, data_ctx)
    blob = (tmp_path / "out" / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    assert plan.checkpoint_bytes == len(blob) - 8 - length


# ---------------------------------------------------------------- temporaries of killed runs


def test_stale_temporaries_of_the_output_are_removed_at_the_next_run(tiny: Path, calib: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (tmp_path / ".out.tmp-999999-abcd1234").mkdir()
    (tmp_path / ".out.tmp-999999-abcd1234" / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / ".out.tmp-999999-efgh5678").write_bytes(b"half a file")
    (tmp_path / ".out.old-999999-ijkl9012").mkdir()
    (tmp_path / ".other.tmp-999999-abcd1234").mkdir()  # another output's: not touched
    result = _prune(tiny, calib, out)
    assert result.exit_code == 0, result.output
    assert "removed .out.tmp-999999-abcd1234, left by an interrupted write of out" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-999999-abcd1234", "out"]


def test_folder_swap_killed_at_every_step_recovers_old_or_new(tmp_path: Path) -> None:
    """atomic_dir(replace=True) killed before each of its file-system changes: `recover` leaves the old
    folder or the new one, whole, and no temporary."""
    at, restored = 1, []
    while True:
        root = tmp_path / f"k{at}"
        out = root / "out"
        out.mkdir(parents=True)
        (out / "old.txt").write_text("old")
        (out / RESUME_DIR).mkdir()
        (out / RESUME_DIR / "state.json").write_text("{}")
        switch = KillSwitch(root, at=at)
        with switch.armed(), contextlib.suppress(Killed), atomic.atomic_dir(out, replace=True) as tmp:
            (tmp / "new.txt").write_text("new")
        restored += [line for line in atomic.recover(out) if line.startswith("restored")]
        assert sorted(p.name for p in root.iterdir()) == ["out"]
        assert sorted(p.name for p in out.iterdir()) in (["new.txt"], [RESUME_DIR, "old.txt"])
        if not switch.dead:
            assert (out / "new.txt").read_text() == "new"
            break
        at += 1
    assert at > 3  # moving aside, moving in and deleting the old folder were each interrupted
    assert len(restored) == 1  # the kill between moving the old folder aside and the new one in


def test_recover_touches_only_the_temporaries_of_its_output(tmp_path: Path) -> None:
    for name in (".out.tmp-1-abc", ".out.old-2-def", ".out.lock", ".out.tmp-x-abc", ".outer.tmp-1-abc", "out.tmp-1-a"):
        (tmp_path / name).mkdir()
    done = atomic.recover(tmp_path / "out")
    assert len(done) == 2
    kept = [".out.lock", ".out.tmp-x-abc", ".outer.tmp-1-abc", "out.tmp-1-a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == kept


# ---------------------------------------------------------------- a full disk


def test_the_space_check_counts_the_files_copied_beside_the_weights(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer, generation settings and other small files are part of the write (audit item 6)."""
    weights = {"model.safetensors", "model.safetensors.index.json"}
    expected = sum(p.stat().st_size for p in tiny.iterdir() if p.is_file() and p.name not in weights)
    copied = output_module.copied_bytes(str(tiny))
    assert copied == expected and copied > 0
    assert output_module.copied_bytes("HuggingFaceTB/SmolLM2-135M") == 0  # a hub id: nothing on disk yet
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(10**9, 10**9 - 1000, 1000))
    output_module.check_free_space(tmp_path / "out", 900, 0)  # the weights alone fit
    with pytest.raises(OutputUnwritableError, match=r"tokenizer and other files 200\.0 B"):
        output_module.check_free_space(tmp_path / "out", 900, 0, copied=200)


def test_a_disk_that_fills_up_during_the_write_is_one_line_and_changes_nothing(
    tiny: Path, calib: Path, tmp_path: Path
) -> None:
    """Audit item 6: ENOSPC while the checkpoint is written → exit 4 with one line; a finished output that
    --force was replacing stays byte for byte, the resume state of a fresh run stays to continue from."""
    out = tmp_path / "out"
    assert _prune(tiny, calib, out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with FullDisk(tmp_path / ".out.tmp", budget=4096).armed() as disk:
        full = _prune(tiny, calib, out, "--force", "--method", "magnitude")
    assert disk.written <= 4096
    assert full.exit_code == 4, full.output
    assert _line(full).startswith(f"the disk holding --output {out.resolve()} filled up while the checkpoint")
    assert "No space left on device" in _line(full) and "nothing was changed" in _line(full)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporaries left
    fresh = tmp_path / "fresh"
    with FullDisk(tmp_path / ".fresh.tmp", budget=4096).armed():
        assert _prune(tiny, calib, fresh).exit_code == 4
    assert (fresh / RESUME_DIR).is_dir()  # every block saved: the rerun only writes
    again = _prune(tiny, calib, fresh)
    assert again.exit_code == 0, again.output
    assert (fresh / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()

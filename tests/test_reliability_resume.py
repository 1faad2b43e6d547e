"""Resume state and interruptions (docs/reliability.md): kills at every step of the save sequence and of
the final write, damaged and foreign states, resume by default, SIGTERM/Ctrl-C lines and exit codes,
and real SIGKILL/SIGTERM/SIGINT on `python -m tsenor_cli prune` with a second run locked out."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_cli import invoke
from helpers_faults import Killed, KillSwitch
from helpers_tiny import make_tiny_llama, sparsegpt_config
from torch import nn

from tsenor_cli.errors import (
    EXIT_RESUMABLE,
    EXIT_SIGINT,
    Interrupted,
    ResumeStateError,
)
from tsenor_cli.interrupt import StopRequest, stop_on_signals
from tsenor_cli.locks import lock_path
from tsenor_cli.pruning.methods.types import LayerRecord
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.runfiles import PRUNE_FILE, PRUNE_MARKDOWN, RESUME_DIR, RESUME_STATE_FILE, DataSource, block_file
from tsenor_cli.runfiles.resume import BlockSave, ResumeStore, StateKey
from tsenor_cli.settings import RunContext

REPO = Path(__file__).resolve().parents[1]
BLOCKS = 3  # first, middle and last block: the save sequence differs for each


@pytest.fixture(scope="module")
def tiny(tiny_llama: Callable[..., Path]) -> Path:
    return tiny_llama(num_layers=BLOCKS)


def _args(model: Path, calib: Path, output: Path) -> list[str]:
    return [
        "prune", "--model", str(model), "--method", "sparsegpt", "--nm", "2:4", "--solver", "exhaustive",
        "--nsamples", "4", "--seqlen", "32", "--calib-data", str(calib), "--output", str(output),
    ]  # fmt: skip


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _errors(output: Path) -> list[float]:
    return [layer["recon_error"] for layer in json.loads((output / PRUNE_FILE).read_text())["layers"]]


@pytest.fixture(scope="module")
def reference(tiny: Path, calib: Path, data_ctx: RunContext, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run without a resume state: what every interrupted-and-resumed run must equal."""
    out = tmp_path_factory.mktemp("reference") / "out"
    prune_model(sparsegpt_config(tiny, calib, out, resume=False), data_ctx)
    return out


def _assert_same_as(out: Path, reference: Path) -> None:
    assert _sha(out / "model.safetensors") == _sha(reference / "model.safetensors")
    assert _errors(out) == _errors(reference)
    assert not (out / RESUME_DIR).exists()  # the state goes away with the final swap
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporaries, no lock file


# ---------------------------------------------------------------- the save sequence, unit level


def _source() -> DataSource:
    return DataSource("file", ())


def _save(store: ResumeStore, index: int, block: nn.Module, hidden: torch.Tensor | None, previous: object) -> object:
    record = LayerRecord(index, f"layers.{index}.proj", 4, 4, "pruned", recon_error=0.1 * index)
    records = [LayerRecord(i, f"layers.{i}.proj", 4, 4, "pruned", recon_error=0.1 * i) for i in range(index)]
    save = BlockSave(index, block, hidden, [*records, record])
    return store.save_block(save, StateKey("hash", "calib", _source(), BLOCKS), previous)  # type: ignore[arg-type]


def test_state_save_is_atomic_at_every_step(tmp_path: Path) -> None:
    """A kill before any file-system change of block i's save leaves the state of block i-1 or of block i,
    whole: the hidden states it names are the input of its next block, never a later one."""
    blocks = [nn.Linear(4, 4) for _ in range(BLOCKS)]
    for index, block in enumerate(blocks):
        nn.init.constant_(block.weight, float(index))
    hidden = [torch.full((2, 3, 4), float(i)) for i in range(BLOCKS)]  # hidden[i]: the output of block i

    def save_through(store: ResumeStore, last: int) -> object:
        state = None
        for i in range(last + 1):
            state = _save(store, i, blocks[i], hidden[i] if i < BLOCKS - 1 else None, state)
        return state

    checked = set()
    for index in range(BLOCKS):
        at = 1
        while True:
            out = tmp_path / f"b{index}-k{at}"
            store = ResumeStore(out)
            before = save_through(store, index - 1) if index else None
            switch = KillSwitch(out, at=at)
            with switch.armed(), contextlib.suppress(Killed):
                _save(store, index, blocks[index], hidden[index] if index < BLOCKS - 1 else None, before)
            state = store.load("hash", BLOCKS)
            if not switch.dead:
                assert state is not None and state.next_block == index + 1
                break
            checked.add(switch.ops[-1][0])
            assert state is None if index == 0 else state.next_block in (index, index + 1)
            if state is not None:
                done = state.next_block
                restored = [nn.Linear(4, 4) for _ in range(BLOCKS)]
                store.restore_blocks(nn.ModuleList(restored), state)
                assert all(torch.equal(restored[i].weight, blocks[i].weight) for i in range(done))
                if done < BLOCKS:
                    assert torch.equal(store.load_hidden(state, torch.device("cpu")), hidden[done - 1])
                assert [r.block for r in state.records] == list(range(done))
                # nothing unnamed is left: the state's own files only
                assert sorted(p.name for p in store.root.iterdir()) == sorted([RESUME_STATE_FILE, *state.files])
            at += 1
        assert at > 3  # block file, hidden states or state.json, and at least one more change were hit
    assert checked == {"replace", "unlink"}


def test_damaged_or_foreign_state_is_one_line(tmp_path: Path) -> None:
    block = nn.Linear(4, 4)
    damages = {
        "garbage state.json": lambda root: (root / RESUME_STATE_FILE).write_text("{not json"),
        "truncated hidden states": lambda root: (root / "hidden_0000.safetensors").write_bytes(b"\0" * 10),
        "missing block file": lambda root: (root / block_file(0)).unlink(),
        # The last bytes are the block's weights: the same size, the header intact, other values.
        "block file changed at the same size": lambda root: (root / block_file(0)).write_bytes(
            (root / block_file(0)).read_bytes()[:-4] + b"\x00\x00\x80\x7f"
        ),
        "state.json without a field": lambda root: (root / RESUME_STATE_FILE).write_text(
            json.dumps({k: v for k, v in json.loads((root / RESUME_STATE_FILE).read_text()).items() if k != "records"})
        ),
    }
    for name, damage in damages.items():
        store = ResumeStore(tmp_path / name.replace(" ", "-"))
        _save(store, 0, block, torch.zeros(2, 3, 4), None)
        damage(store.root)
        with pytest.raises(ResumeStateError, match=r"is damaged \(.*\); pass --force to start over") as caught:
            store.load("hash", BLOCKS)
        assert "\n" not in str(caught.value), name
    store = ResumeStore(tmp_path / "other")
    _save(store, 0, block, torch.zeros(2, 3, 4), None)
    with pytest.raises(ResumeStateError, match="different settings"):
        store.load("another hash", BLOCKS)
    with pytest.raises(ResumeStateError, match="3 blocks, not 4"):
        store.load("hash", BLOCKS + 1)
    (store.root / "finetune_state.json").write_text("{}")
    with pytest.raises(ResumeStateError, match=r"finetune_state\.json"):
        store.load("hash", BLOCKS)


# ---------------------------------------------------------------- kills of a whole prune


@pytest.mark.slow
def test_prune_killed_before_every_file_change_resumes_to_the_same_checkpoint(
    tiny: Path, calib: Path, reference: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """Kill a prune before each of its file-system changes in turn (each block's save, the final
    build-and-swap, the removal of the old folder and of the lock), rerun: the checkpoint equals the
    uninterrupted one and nothing is left over."""
    killed_before: list[tuple[str, str]] = []
    at = 1
    while True:
        out = tmp_path / f"k{at}" / "out"
        switch = KillSwitch(out.parent, at=at)
        with switch.armed(), contextlib.suppress(Killed):
            prune_model(sparsegpt_config(tiny, calib, out), data_ctx)
        if not switch.dead:
            break
        killed_before.append(switch.ops[-1])
        if (out / PRUNE_FILE).is_file():
            # Killed after the swap: the checkpoint is complete. A rerun removes the old folder moved
            # aside and, the run being finished with the same settings, writes nothing and succeeds.
            before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
            messages: list[str] = []
            prune_model(sparsegpt_config(tiny, calib, out), data_ctx, progress=messages.append)
            assert any("already holds this run" in m for m in messages)
            assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
            assert not [p for p in out.parent.iterdir() if p.name.startswith(".out.old-")]
        else:
            prune_model(sparsegpt_config(tiny, calib, out), data_ctx)
        _assert_same_as(out, reference)
        at += 1
    names = [Path(path).name for _, path in killed_before]
    # the kills landed inside every part of the sequence
    for expected in ("state.json", "hidden_0000.safetensors", block_file(BLOCKS - 1), "out", ".out.lock"):
        assert any(expected in name for name in names), expected
    assert any(name.startswith(".out.tmp-") for name in names)  # the swap's second rename


def test_kill_inside_the_final_swap_is_recovered(
    tiny: Path, calib: Path, reference: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """Killed between moving the old folder aside and renaming the new one in: `out` is missing; the next
    run moves the old folder (with its complete resume state) back and only writes the checkpoint."""
    out = tmp_path / "out"
    switch = KillSwitch(tmp_path, when=lambda op, path: op == "replace" and Path(path).name.startswith(".out.tmp-"))
    with switch.armed(), pytest.raises(Killed):
        prune_model(sparsegpt_config(tiny, calib, out), data_ctx)
    assert not out.exists()
    leftovers = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
    assert leftovers == [".out.lock", ".out.old", ".out.tmp"]
    messages: list[str] = []
    report = prune_model(sparsegpt_config(tiny, calib, out), data_ctx, progress=messages.append)
    assert any(m.startswith(f"restored {out}") for m in messages)
    assert report.resumed_from_block == BLOCKS and not any(m.startswith("block ") for m in messages)
    _assert_same_as(out, reference)


# ---------------------------------------------------------------- resume by default, from the CLI


def _killed_after_first_block(tiny: Path, calib: Path, out: Path, data_ctx: RunContext) -> None:
    """A prune into `out` killed (simulated) once block 1's resume state is saved."""

    def kill_after_first(index: int) -> None:
        if index == 0:
            raise Killed

    with pytest.raises(Killed):
        prune_model(sparsegpt_config(tiny, calib, out), data_ctx, after_block=kill_after_first)


def test_rerunning_the_same_command_continues_an_interrupted_run(
    tiny: Path, calib: Path, reference: Path, data_ctx: RunContext, data_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    _killed_after_first_block(tiny, calib, out, data_ctx)
    assert sorted(p.name for p in out.iterdir()) == [RESUME_DIR]
    args = [*_args(tiny, calib, out), "--data-dir", str(data_dir)]
    off = invoke([*args, "--no-resume-state"])  # refused, the state kept
    assert off.exit_code == 4 and "drop --no-resume-state to continue it" in str(off.exception)
    other = invoke([*args, "--seed", "1"])
    assert other.exit_code == 4 and "different settings" in str(other.exception)
    assert (out / RESUME_DIR / RESUME_STATE_FILE).is_file()
    result = invoke(args)
    assert result.exit_code == 0, result.output
    assert f"resuming after block 1/{BLOCKS} from {out / RESUME_DIR}" in result.stderr
    assert json.loads((out / PRUNE_FILE).read_text())["resumed_from_block"] == 1
    summary = (out / PRUNE_MARKDOWN).read_text()
    assert "s in this attempt, which resumed with block 1 done (" in summary  # this attempt's phases
    assert (
        "); method " in summary
        and "s over all attempts" in summary
        and "s in this attempt" not in (reference / PRUNE_MARKDOWN).read_text()
    )
    _assert_same_as(out, reference)


def test_a_checkpoint_replaced_at_the_same_path_is_another_input(
    tiny: Path, calib: Path, data_ctx: RunContext, data_dir: Path, tmp_path: Path
) -> None:
    """Audit item 1: kill a prune after block 1, copy another checkpoint's model.safetensors over the input,
    rerun: refused with a line naming --force (was: resumed, mixing blocks of both); with --force the run
    starts over and equals a fresh run of the new input. A finished run whose input changed is not "nothing
    to do" but refused the same way."""
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    other = make_tiny_llama(tmp_path / "other", num_layers=BLOCKS, seed=1)
    out = tmp_path / "out"
    _killed_after_first_block(model, calib, out, data_ctx)
    shutil.copyfile(other / "model.safetensors", model / "model.safetensors")
    args = [*_args(model, calib, out), "--data-dir", str(data_dir)]
    replaced = invoke(args)
    assert replaced.exit_code == 4, replaced.output
    assert "from another input checkpoint (its files changed since)" in str(replaced.exception)
    assert "pass --force to start over" in str(replaced.exception)
    assert (out / RESUME_DIR / RESUME_STATE_FILE).is_file()  # kept for the user to decide
    forced = invoke([*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert "--force: discarding" in forced.stderr
    fresh = tmp_path / "fresh"
    prune_model(sparsegpt_config(model, calib, fresh, resume=False), data_ctx)
    assert _sha(out / "model.safetensors") == _sha(fresh / "model.safetensors")
    again = invoke(args)
    assert again.exit_code == 0 and "nothing to do" in again.stderr  # the same input: done
    shutil.copyfile(tiny / "model.safetensors", model / "model.safetensors")
    changed = invoke(args)
    assert changed.exit_code == 4 and "nothing to do" not in changed.stderr
    assert "already holds a tsenor run; pass --force" in str(changed.exception)


def test_the_checkpoint_identity_follows_the_files_not_the_path(tiny: Path, tmp_path: Path) -> None:
    """Same files → same identity (a copy keeping the times too); a rewrite of one file, or another header
    under a restored time, → another."""
    from tsenor_cli.models.identity import checkpoint_identity

    first = shutil.copytree(tiny, tmp_path / "a")  # copy2: contents and modification times
    second = shutil.copytree(tiny, tmp_path / "b")
    assert checkpoint_identity(str(first)) == checkpoint_identity(str(second)) is not None
    names = set(checkpoint_identity(str(first))["files"])  # type: ignore[index]
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    weights = second / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes(weights.read_bytes())  # the same bytes rewritten: a new modification time
    assert checkpoint_identity(str(second)) != checkpoint_identity(str(first))
    raw = bytearray(weights.read_bytes())
    raw[9:13] = raw[9:13].swapcase()  # one header name changed, same size
    assert bytes(raw) != weights.read_bytes()
    weights.write_bytes(bytes(raw))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert checkpoint_identity(str(second)) != checkpoint_identity(str(first))
    assert checkpoint_identity("smollm2-135m") is None  # the embedded model: made from the package's GGUF
    assert checkpoint_identity(str(tmp_path / "missing" / "model")) is None  # neither a folder nor a hub id


def test_force_starts_over_from_a_damaged_or_foreign_state(
    tiny: Path, calib: Path, reference: Path, data_ctx: RunContext, data_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    _killed_after_first_block(tiny, calib, out, data_ctx)
    (out / RESUME_DIR / RESUME_STATE_FILE).write_text("{")
    args = [*_args(tiny, calib, out), "--data-dir", str(data_dir)]
    damaged = invoke(args)
    assert damaged.exit_code == 4 and "is damaged" in str(damaged.exception)
    assert "Traceback" not in damaged.output
    forced = invoke([*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert "--force: discarding" in forced.stderr
    assert json.loads((out / PRUNE_FILE).read_text())["resumed_from_block"] is None
    _assert_same_as(out, reference)


def test_no_resume_state_writes_nothing_before_the_checkpoint(
    tiny: Path, calib: Path, reference: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    seen: list[bool] = []
    prune_model(
        sparsegpt_config(tiny, calib, out, resume=False), data_ctx, after_block=lambda _i: seen.append(out.exists())
    )
    assert seen == [False] * BLOCKS
    _assert_same_as(out, reference)


# ---------------------------------------------------------------- interruptions: the line and the exit code


def test_ctrl_c_and_stop_signals_say_what_was_saved(
    tiny: Path, calib: Path, reference: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    out = tmp_path / "out"

    def ctrl_c_after_first(index: int) -> None:
        if index == 0:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted) as caught:
        prune_model(sparsegpt_config(tiny, calib, out), data_ctx, after_block=ctrl_c_after_first)
    assert caught.value.exit_code == EXIT_SIGINT
    assert str(caught.value) == (
        f"interrupted after block 1/{BLOCKS}; the resume state holds block 1: rerun the same command to continue"
    )

    # A real SIGTERM to this process inside stop_on_signals: block 2 finishes and is saved, then the run stops.
    before = signal.getsignal(signal.SIGTERM)

    def sigterm_in_second(index: int) -> None:
        if index == 1:
            signal.raise_signal(signal.SIGTERM)

    with stop_on_signals() as stop, pytest.raises(Interrupted) as stopped:
        prune_model(sparsegpt_config(tiny, calib, out), data_ctx, after_block=sigterm_in_second, stop=stop)
    assert stopped.value.exit_code == EXIT_RESUMABLE == 75
    said = str(stopped.value)
    assert said.startswith(f"stopped by SIGTERM after block 2/{BLOCKS}; the resume state holds blocks 1-2:")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is gone again
    assert not lock_path(out).exists()
    prune_model(sparsegpt_config(tiny, calib, out), data_ctx)
    _assert_same_as(out, reference)

    unsaved = tmp_path / "unsaved" / "out"
    with pytest.raises(Interrupted) as nothing:
        prune_model(sparsegpt_config(tiny, calib, unsaved, resume=False), data_ctx, after_block=ctrl_c_after_first)
    assert str(nothing.value).endswith("nothing was saved (--no-resume-state): rerunning starts over")
    assert not unsaved.exists()


def test_ctrl_c_before_pruning_during_the_write_and_during_prune_eval(
    tiny: Path,
    calib: Path,
    reference: Path,
    data_ctx: RunContext,
    data_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tsenor_cli.evaluation import runner
    from tsenor_cli.pruning.block import engine
    from tsenor_cli.pruning.run import api, writer

    def ctrl_c(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt

    out = tmp_path / "out"
    with monkeypatch.context() as patch, pytest.raises(Interrupted) as early:
        patch.setattr(api, "plan_model", ctrl_c)
        prune_model(sparsegpt_config(tiny, calib, out), data_ctx)
    assert (str(early.value), early.value.exit_code) == ("interrupted before pruning began; nothing was written", 130)
    assert list(tmp_path.iterdir()) == []

    with monkeypatch.context() as patch, pytest.raises(Interrupted) as first_block:
        patch.setattr(engine.BlockPruner, "prune", ctrl_c)
        prune_model(sparsegpt_config(tiny, calib, out), data_ctx)
    assert str(first_block.value) == (
        f"interrupted at block 1/{BLOCKS}; no block was finished: rerunning the same command starts over"
    )
    assert list(tmp_path.iterdir()) == []

    with monkeypatch.context() as patch, pytest.raises(Interrupted) as writing:
        patch.setattr(writer, "write_checkpoint", ctrl_c)
        prune_model(sparsegpt_config(tiny, calib, out), data_ctx)
    assert str(writing.value) == (
        f"interrupted while writing {out}; every block is saved in the resume state: "
        "rerun the same command to write the checkpoint"
    )
    assert prune_model(sparsegpt_config(tiny, calib, out), data_ctx).resumed_from_block == BLOCKS
    _assert_same_as(out, reference)

    evaluated = tmp_path / "evaluated"
    monkeypatch.setattr(runner, "evaluate_model", ctrl_c)
    args = [*_args(tiny, calib, evaluated), "--data-dir", str(data_dir), "--eval", "--max-windows", "1"]
    result = invoke(args)
    assert result.exit_code == EXIT_SIGINT
    assert str(result.exception) == (
        f"interrupted while evaluating; the checkpoint {evaluated} is complete but has no eval.json: "
        f"run `tsenor eval {evaluated} --output {evaluated}`"  # MODEL, as --help shows it (not the hidden --model)
    )
    assert (evaluated / PRUNE_FILE).is_file() and not (evaluated / "eval.json").exists()


def test_a_stop_signal_during_prune_evals_evaluation_stops_it_at_once(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evaluation has no safe point: a scheduler's signal stops it at once (exit 75), the checkpoint kept."""
    from tsenor_cli.evaluation import runner
    from tsenor_cli.pruning.run.api import prune_and_evaluate

    stop = StopRequest()

    def signalled(*_args: object, **_kwargs: object) -> None:
        stop.request("SIGTERM")  # inside StopRequest.at_once: raises KeyboardInterrupt here
        raise AssertionError("the evaluation went on after SIGTERM")

    monkeypatch.setattr(runner, "evaluate_model", signalled)
    out = tmp_path / "out"
    eval_cfg = runner.EvalConfig(ppl_datasets=("wikitext2",), max_windows=1)
    with pytest.raises(Interrupted) as stopped:
        prune_and_evaluate(sparsegpt_config(tiny, calib, out), data_ctx, eval_cfg, stop=stop)
    assert stopped.value.exit_code == EXIT_RESUMABLE
    assert str(stopped.value).startswith(f"stopped by SIGTERM while evaluating; the checkpoint {out} is complete")
    assert (out / PRUNE_FILE).is_file() and not (out / "eval.json").exists()


def test_stop_signals_are_recorded_and_a_second_one_stops_at_once() -> None:
    stop = StopRequest()
    stop.request("SIGTERM")
    assert stop.requested and stop.name == "SIGTERM"
    with pytest.raises(KeyboardInterrupt):
        stop.request("SIGTERM")
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    with stop_on_signals() as stop:
        signal.raise_signal(signal.SIGUSR1)  # SLURM's early warning (--signal=USR1@300)
        assert stop.name == "SIGUSR1"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGUSR2)
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_ctrl_c_during_eval_is_one_line_and_writes_nothing(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tsenor_cli.cli import main
    from tsenor_cli.evaluation import runner  # the command imports evaluate_model from here when it runs

    def interrupted(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "evaluate_model", interrupted)
    monkeypatch.setattr(sys, "argv", ["tsenor", "eval", "--model", str(tiny), "--output", str(tmp_path)])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == EXIT_SIGINT == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted while evaluating; nothing was written"
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- real signals on real processes


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """`python -m tsenor_cli ARGS` from the repository. SIGINT goes back to its default in the child, so
    Python turns it into KeyboardInterrupt even when this test runs in a background job (which starts
    with SIGINT ignored)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tsenor_cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for_block(out: Path, done: int, proc: subprocess.Popen[str], timeout: float = 300) -> None:
    """Poll the resume state until it holds at least `done` blocks."""
    state = out / RESUME_DIR / RESUME_STATE_FILE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if json.loads(state.read_text())["next_block"] >= done:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"block {done} was not saved within {timeout} s")


@pytest.mark.slow
def test_real_kill_int_and_term_then_resume_equals_an_uninterrupted_run(
    tmp_path: Path, calib: Path, data_ctx: RunContext, data_dir: Path
) -> None:
    """`python -m tsenor_cli prune` on an 8-block model: a second prune into the same folder is locked
    out naming the first's pid; SIGKILL leaves no stale lock; Ctrl-C stops at once (exit 130); SIGTERM
    stops after the block in hand (exit 75); each rerun continues, and the last one's checkpoint equals
    an uninterrupted run's byte for byte."""
    blocks = 8
    model = make_tiny_llama(tmp_path / "model", num_layers=blocks)
    # ALPS takes about a second per block here: long enough to signal a run in the middle of one.
    run_args = [
        "prune", "--model", str(model), "--method", "alps", "--nm", "2:4", "--solver", "exhaustive",
        "--nsamples", "8", "--seqlen", "64", "--calib-data", str(calib), "--data-dir", str(data_dir),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = tmp_path / "out"
    args = [*run_args, "--output", str(out)]

    first = _spawn(args, env)
    _wait_for_block(out, 1, first)
    first.send_signal(signal.SIGSTOP)  # frozen while holding the lock, so the second run surely meets it
    second = _spawn(args, env)
    _, err = second.communicate(timeout=300)
    assert second.returncode == 4, err
    holder = f"error: --output {out} is in use by another tsenor run (pid {first.pid} on "
    assert err.strip().splitlines()[-1].startswith(holder)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    assert lock_path(out).exists()  # the file stays; its lock died with the process
    killed_at = json.loads((out / RESUME_DIR / RESUME_STATE_FILE).read_text())["next_block"]

    ctrl_c = _spawn(args, env)  # takes the lock at once and continues where the killed run stopped
    _wait_for_block(out, killed_at + 1, ctrl_c)
    ctrl_c.send_signal(signal.SIGINT)
    _, err = ctrl_c.communicate(timeout=300)
    assert ctrl_c.returncode == EXIT_SIGINT, err
    assert f"resuming after block {killed_at}/{blocks}" in err
    saved = json.loads((out / RESUME_DIR / RESUME_STATE_FILE).read_text())["next_block"]
    assert err.strip().splitlines()[-1] == (
        f"interrupted at block {saved + 1}/{blocks}; the resume state holds blocks 1-{saved}: "
        "rerun the same command to continue"
    )

    term = _spawn(args, env)
    _wait_for_block(out, saved + 2, term)
    term.send_signal(signal.SIGTERM)
    _, err = term.communicate(timeout=300)
    assert term.returncode == EXIT_RESUMABLE, err
    stopped = json.loads((out / RESUME_DIR / RESUME_STATE_FILE).read_text())["next_block"]
    assert stopped < blocks
    assert err.strip().splitlines()[-1] == (
        f"stopped by SIGTERM after block {stopped}/{blocks}; the resume state holds blocks 1-{stopped}: "
        "rerun the same command to continue"
    )

    last = _spawn(args, env)
    _, err = last.communicate(timeout=600)
    assert last.returncode == 0, err
    reference = tmp_path / "reference"
    prune_model(sparsegpt_config(model, calib, reference, method="alps", nsamples=8, seqlen=64, resume=False), data_ctx)
    assert _sha(out / "model.safetensors") == _sha(reference / "model.safetensors")
    assert _errors(out) == _errors(reference)
    assert json.loads((out / PRUNE_FILE).read_text())["resumed_from_block"] == stopped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out", "reference"]

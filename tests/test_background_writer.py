"""The background writer of the resume state (background.py, issue 42 item 2): writes in order with
a bounded number of payloads held, a failed write raised in the run's thread, the files bit for bit those
of the synchronous save, an interruption's line naming what is committed, and a real SIGKILL while the
writer's thread writes resuming to the same checkpoint as an uninterrupted run."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_faults import FullDisk
from helpers_tiny import sparsegpt_config

from tsenor_cli import background
from tsenor_cli.background import BackgroundWriter
from tsenor_cli.errors import Interrupted, OutputUnwritableError
from tsenor_cli.interrupt import stop_on_signals
from tsenor_cli.pruning.run import run
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.run.hooks import HostCopies
from tsenor_cli.pruning.settings.config import RefineConfig
from tsenor_cli.runfiles import PRUNE_FILE, RESUME_DIR, RESUME_STATE_FILE
from tsenor_cli.runfiles.resume import ResumeStore
from tsenor_cli.settings import RunContext

REPO = Path(__file__).resolve().parents[1]
BLOCKS = 3  # first, middle and last block: the save sequence differs for each
# A layer's or a refined block's record holds timings, which differ from run to run; nothing else in a
# state.json may.
TIMING_KEYS = ("seconds", "solver_seconds")


@pytest.fixture(scope="module")
def tiny(tiny_llama: Callable[..., Path]) -> Path:
    return tiny_llama(num_layers=BLOCKS)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- the writer alone


def test_writes_run_in_order_with_at_most_depth_payloads_held() -> None:
    """Each snapshot is taken only once a slot is free: with depth 1 the second submit waits until the
    first write ends, so never more than one payload exists; the writes run in submission order."""
    release = threading.Event()
    held: list[int] = []
    most = [0]
    written: list[int] = []

    def snapshot(i: int) -> Callable[[], int]:
        def take() -> int:
            held.append(i)
            most[0] = max(most[0], len(held))
            return i

        return take

    def write(i: int) -> None:
        if i == 0:
            release.wait(10)
        written.append(i)
        held.remove(i)

    writer = BackgroundWriter(1)
    with writer:
        writer.submit(snapshot(0), write)
        second = threading.Thread(target=writer.submit, args=(snapshot(1), write))
        second.start()
        second.join(0.3)
        assert second.is_alive() and held == [0]  # the loop waits for the slot; no second copy was made
        release.set()
        second.join(10)
        for i in range(2, 6):
            writer.submit(snapshot(i), write)
    assert written == list(range(6)) and most[0] == 1 and writer.busy > 0


def test_a_failed_write_is_raised_in_the_callers_thread_and_stops_the_writer(caplog: pytest.LogCaptureFixture) -> None:
    """The write's own exception object at the next submit (or drain), the writes queued after it skipped."""
    failure = OSError(errno.ENOSPC, "No space left on device")
    written: list[int] = []
    queued = threading.Event()

    def write(i: int) -> None:
        if i == 1:
            queued.wait(10)
            raise failure
        written.append(i)

    writer = BackgroundWriter(2)
    writer.submit(lambda: 0, write)
    writer.submit(lambda: 1, write)
    writer.submit(lambda: 2, write)  # queued behind the write that fails: skipped, not written
    queued.set()
    with pytest.raises(OSError) as caught:
        writer.drain()
    assert caught.value is failure and written == [0]
    with pytest.raises(OSError) as again:
        writer.submit(lambda: 3, write)
    assert again.value is failure and written == [0]
    # Leaving with another exception: that one goes on, the writer's is logged, not lost.
    with caplog.at_level(logging.ERROR, logger="tsenor"):
        writer.close(KeyboardInterrupt())
    assert "the background writer failed too: [Errno 28] No space left on device" in caplog.text


def test_depth_0_writes_in_the_callers_thread() -> None:
    names: list[str] = []
    writer = BackgroundWriter(0)
    writer.submit(lambda: None, lambda _none: names.append(threading.current_thread().name))
    writer.close()
    assert names == [threading.current_thread().name]


def test_the_host_copies_of_the_loops_buffers_are_reused_one_buffer_a_slot() -> None:
    """Snapshot k copies into buffer k mod slots (the writer holds at most `slots` payloads, so that one is
    written); the copy keeps what the loop wrote even after the loop writes its buffer again; a tensor that
    is not the loop's buffer (a gathered copy) or None is taken as it is; another shape gets a new buffer."""
    copies = HostCopies(2)
    loop = torch.arange(6.0).reshape(2, 3)
    taken = []
    for _ in range(3):
        taken.append(copies.copy("outputs", loop, loop))
        copies.next_snapshot()
        assert torch.equal(taken[-1], loop) and taken[-1].data_ptr() != loop.data_ptr()
        loop.add_(10.0)  # the next block's rerun writes the buffer again
    assert torch.equal(taken[1], torch.arange(6.0).reshape(2, 3) + 10.0)  # untouched by the loop's writes
    pointers = [t.data_ptr() for t in taken]
    assert pointers[0] != pointers[1] and pointers[2] == pointers[0]
    assert copies.copy("dense", loop, loop).data_ptr() not in pointers  # each stream its own buffers
    gathered = torch.ones(2, 3)
    assert copies.copy("outputs", gathered, loop) is gathered and copies.copy("outputs", None, loop) is None
    wider = torch.zeros(2, 4)
    assert copies.copy("outputs", wider, wider).shape == (2, 4)
    assert HostCopies(0).slots == 1  # a synchronous writer (depth 0) holds nothing between snapshots


def test_a_host_copy_is_on_the_cpu_page_locked_when_the_loop_is_on_a_gpu(device: torch.device) -> None:
    copies = HostCopies(1)
    loop = torch.randn(3, 4, 5, device=device, dtype=torch.bfloat16)
    held = copies.copy("outputs", loop, loop)
    assert held is not None and held.device.type == "cpu" and torch.equal(held, loop.cpu())
    assert held.is_pinned() == (device.type == "cuda")


def test_the_host_estimate_counts_the_writers_payload(tiny: Path, calib: Path, data_ctx: RunContext) -> None:
    """By hand, the tiny LLaMA (hidden 64, fp32) at 4 × 32 tokens: with a resume state the writer holds a
    copy of the hidden states (S, T, H) (twice with --refine: the dense stream), and a streamed run's
    pruned block besides; streamed without one, the block; a whole load without one, nothing."""
    from tsenor_cli.pruning.plan.plan import plan_model

    base = sparsegpt_config(tiny, calib, None)
    hidden = 4 * 32 * 64 * 4
    plan = plan_model(replace(base, stream=False), data_ctx)
    block = max(plan.sizing.per_block) * 4
    cases = {
        (False, True, "none"): hidden,
        (False, True, "block"): 2 * hidden,
        (True, True, "none"): hidden + block,
        (True, False, "none"): block,
        (False, False, "none"): 0,
    }
    for (stream, resume, refine), expected in cases.items():
        cfg = replace(base, stream=stream, resume=resume, refine=replace(base.refine, mode=refine))
        host = plan_model(cfg, data_ctx).host_memory
        assert host.writer == background.WRITER_DEPTH * expected, (stream, resume, refine)
        assert host.total == host.model + host.tokens + host.activations + host.work + host.allocator + host.writer


# ---------------------------------------------------------------- whole prunes


def _recording_saves(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """After each `ResumeStore.save_block` (on whichever thread runs it): the sha256 of every file its
    state names and its state.json without the timings."""
    seen: list[dict[str, Any]] = []
    real = ResumeStore.save_block

    def save_block(self: ResumeStore, *args: Any, **kwargs: Any) -> Any:
        state = real(self, *args, **kwargs)
        raw = json.loads(self.state_path.read_text())
        for record in [*raw["records"], *raw["refinement"]]:
            for key in TIMING_KEYS:
                record.pop(key, None)
        seen.append({"files": {name: _sha(self.root / name) for name in state.files}, "state": raw})
        return state

    monkeypatch.setattr(ResumeStore, "save_block", save_block)
    return seen


@pytest.mark.parametrize(
    ("stream", "refined"), [(False, False), (True, False), (False, True)], ids=["whole", "streamed", "refine"]
)
def test_files_are_bit_for_bit_those_of_the_synchronous_save(
    tiny: Path,
    calib: Path,
    data_ctx: RunContext,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
    refined: bool,
) -> None:
    """Each block's file, the hidden states (with --refine block the dense stream beside them, which the
    next block overwrites in place), the state.json (timings aside) and the checkpoint are the same as
    with the writes in the block loop (depth 0); the summary's phases still add up, and the writer's own
    time is shown beside them."""
    refine = RefineConfig("block", 1, 1e-3) if refined else RefineConfig()
    outcomes = {}
    for depth in (0, background.WRITER_DEPTH):
        monkeypatch.setattr(run, "WRITER_DEPTH", depth)
        with monkeypatch.context() as patch:
            saves = _recording_saves(patch)
            out = tmp_path / f"depth{depth}"
            messages: list[str] = []
            cfg = sparsegpt_config(tiny, calib, out, stream=stream, refine=refine)
            report = prune_model(cfg, data_ctx, progress=messages.append)
        assert [s["state"]["next_block"] for s in saves] == list(range(1, BLOCKS + 1))
        assert sum(report.phases.values()) <= report.seconds and report.phases["save"] > 0
        (timing,) = [m for m in messages if m.startswith("time ")]
        assert ("in the background, overlapping them: save" in timing) == (depth > 0)
        weights = {p.name: _sha(p) for p in out.glob("*.safetensors")}
        outcomes[depth] = (saves, weights)
    assert outcomes[0] == outcomes[background.WRITER_DEPTH]


def test_streamed_without_resume_state_keeps_its_blocks_in_the_background(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--no-resume-state, streamed: the kept block files are written on the writer's thread and the
    checkpoint equals the whole load's."""
    threads: list[str] = []
    real = background.BackgroundWriter._work

    def work(self: BackgroundWriter) -> None:
        threads.append(threading.current_thread().name)
        real(self)

    monkeypatch.setattr(background.BackgroundWriter, "_work", work)
    streamed, whole = tmp_path / "streamed", tmp_path / "whole"
    prune_model(sparsegpt_config(tiny, calib, streamed, stream=True, resume=False), data_ctx)
    prune_model(sparsegpt_config(tiny, calib, whole, stream=False, resume=False), data_ctx)
    assert threads == ["tsenor-writer"]
    assert _sha(streamed / "model.safetensors") == _sha(whole / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["streamed", "whole"]  # the kept blocks are gone


def _slow_saves(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every resume-state save takes `seconds` longer: an interruption then meets the writer still busy."""
    real = ResumeStore.save_block

    def save_block(self: ResumeStore, *args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ResumeStore, "save_block", save_block)


def test_an_interruption_names_the_blocks_committed_after_the_writer_drains(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C and SIGTERM while the writer still writes: the queued writes land first, and the line
    names exactly what state.json holds."""
    _slow_saves(monkeypatch, 0.5)
    out = tmp_path / "out"

    with pytest.raises(Interrupted) as caught:
        prune_model(sparsegpt_config(tiny, calib, out), data_ctx, after_block=_ctrl_c)
    assert json.loads((out / RESUME_DIR / RESUME_STATE_FILE).read_text())["next_block"] == 1
    assert str(caught.value).endswith("the resume state holds block 1: rerun the same command to continue")

    def sigterm_in_second(index: int) -> None:
        if index == 1:
            signal.raise_signal(signal.SIGTERM)

    with stop_on_signals() as stop, pytest.raises(Interrupted) as stopped:
        prune_model(sparsegpt_config(tiny, calib, out), data_ctx, after_block=sigterm_in_second, stop=stop)
    assert json.loads((out / RESUME_DIR / RESUME_STATE_FILE).read_text())["next_block"] == 2
    assert str(stopped.value).startswith(
        f"stopped by SIGTERM after block 2/{BLOCKS}; the resume state holds blocks 1-2:"
    )


def test_a_full_disk_in_the_writer_is_the_synchronous_error_and_resumes(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC while the writer writes block 2's state.json (a disk that holds block 1's files and block 2's
    safetensors files, and no more; tests/test_audit4.py fills it inside a safetensors file): the run stops with
    the error the synchronous save gave (the same type and line: exit 4), the state names block 1 only, and a
    rerun finishes the same checkpoint as an uninterrupted run."""
    reference = tmp_path / "reference"
    prune_model(sparsegpt_config(tiny, calib, reference, resume=False), data_ctx)
    sized = tmp_path / "sized"
    with pytest.raises(Interrupted):
        prune_model(sparsegpt_config(tiny, calib, sized), data_ctx, after_block=_ctrl_c)
    # Block 1's files and block 2's safetensors files (the same sizes as block 1's) fit, and block 2's
    # state.json (longer: it lists both blocks) does not. Its size moves by a few bytes from run to run
    # (the timings it records), so the budget is not that size to the byte.
    first = (sized / RESUME_DIR / RESUME_STATE_FILE).stat().st_size
    tensors = sum(f.stat().st_size for f in (sized / RESUME_DIR).glob("*.safetensors"))
    budget = 2 * tensors + first + first // 2
    lines = {}
    for depth in (0, background.WRITER_DEPTH):
        monkeypatch.setattr(run, "WRITER_DEPTH", depth)
        out = tmp_path / f"depth{depth}"
        with FullDisk(out / RESUME_DIR, budget=budget).armed(), pytest.raises(OutputUnwritableError) as caught:
            prune_model(sparsegpt_config(tiny, calib, out), data_ctx)
        # One line, exit 4, as the final write's full disk (issue 47; was "unexpected OSError", exit 1).
        assert caught.value.exit_code == 4 and "\n" not in str(caught.value)
        assert str(caught.value).startswith(
            f"the disk holding --output {out} filled up while the resume state was written (No space left on device); "
            "the resume state holds block 1: free some space"
        )
        lines[depth] = (type(caught.value), str(caught.value).split(" (about ")[0].replace(str(out), "OUT"))
        assert json.loads((out / RESUME_DIR / RESUME_STATE_FILE).read_text())["next_block"] == 1
        report = prune_model(sparsegpt_config(tiny, calib, out), data_ctx)
        assert report.resumed_from_block == 1
        assert _sha(out / "model.safetensors") == _sha(reference / "model.safetensors")
    assert lines[0] == lines[background.WRITER_DEPTH]


def _ctrl_c(index: int) -> None:
    """An after_block hook: Ctrl-C once block 1 is done."""
    if index == 0:
        raise KeyboardInterrupt


# ---------------------------------------------------------------- a real SIGKILL while the writer writes

# The child: `python -m tsenor_cli prune ...` whose writer thread, at its N-th rename (a block file, the
# hidden states or state.json coming into place), writes a marker and sleeps, so the parent's SIGKILL
# lands in the middle of the writer's save while the block loop runs on.
_CHILD = """
import os, sys, threading, time
from pathlib import Path
at, marker = int(sys.argv[1]), Path(sys.argv[2])
real, count = os.replace, [0]
def replace(src, dst, *args, **kwargs):
    if threading.current_thread().name == "tsenor-writer":
        count[0] += 1
        if count[0] == at:
            marker.write_text(os.fspath(dst))
            time.sleep(600)
    return real(src, dst, *args, **kwargs)
os.replace = replace
from tsenor_cli.cli import main
sys.argv = ["tsenor", *sys.argv[3:]]
main()
"""


@pytest.mark.slow
@pytest.mark.parametrize(("at", "committed"), [(2, 0), (4, 1), (6, 1)], ids=["hidden0", "block1", "state1"])
def test_sigkill_while_the_writer_writes_resumes_to_the_same_checkpoint(
    tiny: Path, calib: Path, data_ctx: RunContext, data_dir: Path, tmp_path: Path, at: int, committed: int
) -> None:
    """SIGKILL with the writer's thread inside block 1's hidden states (nothing committed), inside block
    2's block file, or just before block 2's state.json (block 1 committed): the state names only
    complete files, and the rerun's checkpoint is the uninterrupted run's, byte for byte."""
    out, marker = tmp_path / "out", tmp_path / "marker"
    args = [
        "prune", "--model", str(tiny), "--method", "sparsegpt", "--nm", "2:4", "--solver", "exhaustive",
        "--nsamples", "4", "--seqlen", "32", "--calib-data", str(calib), "--data-dir", str(data_dir),
        "--output", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(at), str(marker), *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the writer never reached its rename"
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    state = out / RESUME_DIR / RESUME_STATE_FILE
    assert (json.loads(state.read_text())["next_block"] if state.exists() else 0) == committed
    messages: list[str] = []
    report = prune_model(sparsegpt_config(tiny, calib, out), data_ctx, progress=messages.append)
    assert report.resumed_from_block == (committed or None)
    reference = tmp_path / "reference"
    prune_model(sparsegpt_config(tiny, calib, reference, resume=False), data_ctx)
    assert _sha(out / "model.safetensors") == _sha(reference / "model.safetensors")
    assert [r["recon_error"] for r in json.loads((out / PRUNE_FILE).read_text())["layers"]] == [
        r["recon_error"] for r in json.loads((reference / PRUNE_FILE).read_text())["layers"]
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker", "out", "reference"]  # no temporaries

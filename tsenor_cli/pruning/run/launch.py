"""`tsenor prune --nproc K`: the same command in K processes on this node, ended as one run.

This used to be torch's elastic launcher (what torchrun runs), which got three things wrong
for a run of tsenor's: on Ctrl-C or SIGTERM it raised SignalException here ("unexpected SignalException",
exit 1, where a stop is 130 or 75), sent the signal a second time to ranks the terminal had already sent it
to, and SIGKILLed them 30 s later whatever they were saving; and a `kill -9` of this process left the ranks
running to the end, writing the output and holding its lock. The launcher here starts the ranks with what
torchrun gives them on one node (the env:// rendezvous variables, `settings.DistributedContext`'s rank
variables, one thread each) and:

- each rank dies with this process (`die_with_parent`: Linux's parent-death signal, SIGKILL), set before the
  rank imports anything heavy, the launcher's pid checked after it so a death in between is seen; a
  resume state is consistent at any kill (docs/reliability.md), so the rerun continues;
- Ctrl-C comes to every process of the terminal's foreground group, the ranks included, so this process
  passes on only what was sent to it by another process (`kill -INT`), and SIGTERM, SIGUSR1, SIGUSR2 and
  SIGHUP (the ranks stop gracefully on the first three: docs/reliability.md, "Signals and schedulers");
- the run's status is the ranks' (`run_status`): the agreed exit code of a failure or a stop (130, 75),
  whose one line rank 0 printed. A rank killed by a signal cannot take part in the collectives any more:
  the others get `KILLED_PEER_S` to exit by themselves (a rank that crashed while the run ended leaves
  peers that are ending too, with their code) and are killed then; a rank that exited with a code leaves
  the others `AGREED_EXIT_S` to exit with theirs. A rank this process killed is never named as the cause.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tsenor_cli.errors import PeerError
from tsenor_cli.progress import logger
from tsenor_cli.settings import (
    LOCAL_RANK_ENV,
    RANK_ENV,
    WORLD_SIZE_ENV,
    child_environment,
    default_worker_threads,
)

if TYPE_CHECKING:
    from tsenor_cli.pruning.settings.config import PruneConfig

# The signals this process passes on to the ranks (SIGINT only when another process sent it, see above).
FORWARDED: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGHUP,
)
# Ranks that agreed on a failure exit within a second of each other; a rank still running this long after
# another exited with a code is stuck (e.g. in a collective with a peer that left) and is killed.
AGREED_EXIT_S = 60.0
# A rank killed by a signal from outside (out of memory, a crash) leaves its peers this long to exit by
# themselves before they are killed. CI saw a run refused by rank 0 (exit code 4) end as "process 0 of 2
# was killed by signal 9": a peer died by a signal as both ranks were ending, and rank 0 was killed at once.
# A peer that waits for the dead rank in a collective never exits by itself, so the wait is short.
KILLED_PEER_S = 5.0
_POLL_S = 0.1
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What a rank runs: its death signal first, then `tsenor ARGS` (tsenor_cli/__main__.py), which records the
# command line from sys.argv (`cli.command_line`) as "tsenor ARGS".
_RANK_ENTRY = (
    "import sys; from tsenor_cli.pruning.run.launch import die_with_parent; "
    "die_with_parent(int(sys.argv.pop(1))); sys.argv[0] = 'tsenor'; import tsenor_cli.__main__"
)


def without_option(args: Sequence[str], option: str) -> list[str]:
    """`args` less every ``option VALUE`` and ``option=VALUE``."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            kept.append(arg)
    return kept


def stage_arguments(args: Sequence[str], stage: Path) -> list[str]:
    """`tsenor prune ARGS` (a run with --distill-steps N) as the plain prune of its first stage: its output
    `stage` (`runfiles.pruned_stage`), no distillation, no evaluation and no JSON summary (the launching
    process distils, evaluates and prints the summary after the ranks, `tsenor_cli/compress.py`). Typed flags
    override --config, so a recipe's steps are overridden; the typed distillation flags are the launching
    process's, dropped here so that the ranks do not warn that they ignore them."""
    from tsenor_cli.fields import by_name
    from tsenor_cli.pruning.settings.table import DISTILL_KEYS, PRUNE_FIELDS

    kept = without_option(without_option(without_option(args, "--output"), "-o"), "--tasks")
    table = by_name(PRUNE_FIELDS)
    for field in (table[key] for key in DISTILL_KEYS):
        spellings = (field.cli_flag, *field.aliases)
        if field.kind is bool:  # a flag without a value
            kept = [arg for arg in kept if arg not in (*spellings, field.negation)]
            continue
        for spelling in spellings:
            kept = without_option(kept, spelling)
    # --json: the launching process prints the one summary of the whole run.
    return [*(arg for arg in kept if arg not in ("--eval", "--json")), "--output", str(stage), "--distill-steps", "0"]


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when the thread that started it ends (Linux's PR_SET_PDEATHSIG),
    and end now if `parent` (that process's pid) already did. Elsewhere: nothing (no such call)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the launcher ended before the call: nothing would signal this rank
        os.kill(os.getpid(), signal.SIGKILL)


def run_status(codes: Mapping[int, int], nproc: int, killed: Collection[int] = ()) -> int:
    """The run's exit code from its ranks' (rank → returncode, negative: killed by that signal): 0 when every
    rank succeeded; else the code of the lowest rank that exited by itself (the ranks of a failed or stopped
    run exit with the agreed code, and rank 0 printed its line; a rank killed while it shut down does not
    count); PeerError (128 + the signal) when every failed rank was killed, as none printed anything. It
    names the lowest rank killed from outside, not one of `killed` (the ranks the launcher itself killed
    because a peer had died)."""
    exited = sorted(rank for rank, code in codes.items() if code > 0)
    if exited:
        for rank in sorted(rank for rank, code in codes.items() if code < 0 and rank not in killed):
            logger.debug("process %d of %d was killed by signal %d while the run ended", rank, nproc, -codes[rank])
        return codes[exited[0]]
    dead = sorted(rank for rank, code in codes.items() if code < 0)
    if not dead:
        return 0
    rank = next((rank for rank in dead if rank not in killed), dead[0])
    raise PeerError(
        f"process {rank} of {nproc} was killed by signal {-codes[rank]} (e.g. out of memory); rerunning the "
        "same command continues from the last saved block",
        128 - codes[rank],
    )


def _free_port() -> int:
    """A TCP port free on this host now, for rank 0's rendezvous store: torchrun's own choice of one."""
    from torch.distributed.elastic.utils.distributed import get_free_port

    return int(get_free_port())


def _start_ranks(args: Sequence[str], nproc: int, *, stdout_to_stderr: bool = False) -> list[subprocess.Popen[bytes]]:
    default_worker_threads(nproc)
    shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), WORLD_SIZE_ENV: str(nproc)}
    command = [sys.executable, "-c", _RANK_ENTRY, str(os.getpid()), *without_option(args, "--nproc")]
    ranks = []
    for rank in range(nproc):
        env = child_environment({**shared, RANK_ENV: str(rank), LOCAL_RANK_ENV: str(rank)})
        ranks.append(subprocess.Popen(command, env=env, stdout=sys.stderr.fileno() if stdout_to_stderr else None))
    return ranks


def _signal_ranks(ranks: Sequence[subprocess.Popen[bytes]], signum: int) -> set[int]:
    """Send `signum` to the ranks still running → their indices."""
    sent = set()
    for rank, proc in enumerate(ranks):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
                sent.add(rank)
    return sent


def wait_ranks(ranks: Sequence[subprocess.Popen[bytes]]) -> tuple[dict[int, int], set[int]]:
    """Wait for every rank, passing on the signals this process receives (`FORWARDED`) → the ranks'
    returncodes and the ranks this process killed (`KILLED_PEER_S`, `AGREED_EXIT_S`)."""
    died: float | None = None  # when a rank was first seen killed by a signal
    exited: float | None = None  # when a rank was first seen exited with a code
    killed: set[int] = set()
    while any(proc.poll() is None for proc in ranks):
        info = signal.sigtimedwait(FORWARDED, _POLL_S)
        # The terminal's Ctrl-C (si_code SI_KERNEL) reached the ranks too; a second copy would stop them
        # at once where the first lets them say what was saved.
        if info is not None and not (info.si_signo == signal.SIGINT and info.si_code == 0x80):
            _signal_ranks(ranks, info.si_signo)
        codes = [proc.poll() for proc in ranks]
        now = time.monotonic()
        if died is None and any(code is not None and code < 0 for code in codes):
            died = now
        if exited is None and any(code is not None and code > 0 for code in codes):
            exited = now
        if (died is not None and now - died > KILLED_PEER_S) or (exited is not None and now - exited > AGREED_EXIT_S):
            killed |= _signal_ranks(ranks, signal.SIGKILL)  # stuck in a collective with a rank that left
    return {rank: int(proc.returncode) for rank, proc in enumerate(ranks)}, killed


def launch(args: Sequence[str], nproc: int, *, stdout_to_stderr: bool = False) -> int:
    """Run ``python -m tsenor_cli ARGS`` (less --nproc) in `nproc` processes on this node → the run's exit
    code (`run_status`). stdout_to_stderr: what the ranks print goes to this process's stderr (a stage of a
    command whose own summary is its stdout)."""
    ranks = _start_ranks(args, nproc, stdout_to_stderr=stdout_to_stderr)
    # Held for `wait_ranks` once the ranks exist (a blocked mask is inherited across exec, so not before).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        codes, killed = wait_ranks(ranks)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        _signal_ranks(ranks, signal.SIGKILL)  # only when this process itself failed: no rank outlives it
    return run_status(codes, nproc, killed)


def launch_prune(args: Sequence[str], cfg: PruneConfig, nproc: int, *, stage: bool = False) -> int:
    """`tsenor prune ARGS --nproc K`: the checks every rank would make, made once here so their line comes
    once, then `launch` → the run's exit code. stage: the ranks prune the first stage of a distilling run
    (`stage_arguments`), whose summary goes to stderr: stdout is the whole command's."""
    from tsenor_cli.models.loading import resolve_device

    cfg.check_samples(nproc, f"--nproc {nproc}")
    resolve_device(cfg.device)
    return launch(args, nproc, stdout_to_stderr=stage)

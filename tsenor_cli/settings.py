"""The run's external inputs, read from the environment in this one place and frozen into a `RunContext`.

The CLI builds one `RunContext` per command from its flags (``--data-dir``, ``--offline``), with the
environment variables below as defaults, and hands it to the library; no other module reads
``os.environ`` or probes the network.

Which source a named dataset (calibration text, perplexity text, zero-shot task data) comes from is
decided by the context alone, never by trying one and falling back to another:

- ``data_dir`` set → every named dataset is read from that offline data folder;
- otherwise → from the HF hub (a download failure is an error naming ``--data-dir``);
- otherwise with ``offline`` → an error: the hub is forbidden and there is no data folder.

``offline`` also decides how a hub model id loads: from the local HF cache only.

A process started by ``torchrun`` learns its place in the run from RANK, WORLD_SIZE and LOCAL_RANK;
they are read here too (`distributed_default`) and travel in `RunContext.distributed`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tsenor_cli.errors import UsageError

DATA_DIR_ENV = "TSENOR_DATA_DIR"
CACHE_DIR_ENV = "TSENOR_CACHE_DIR"
DEBUG_ENV = "TSENOR_DEBUG"
# The HF libraries' own "stay offline" switches; any of them set makes offline the default.
HUB_OFFLINE_ENVS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
TRITON_INTERPRET_ENV = "TRITON_INTERPRET"
# What torchrun (torch.distributed.run) sets in each process it starts.
RANK_ENV, WORLD_SIZE_ENV, LOCAL_RANK_ENV = "RANK", "WORLD_SIZE", "LOCAL_RANK"

_FALSE = ("", "0", "false", "False", "no")


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "") not in _FALSE


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def data_dir_default(environ: Mapping[str, str] | None = None) -> Path | None:
    """$TSENOR_DATA_DIR (the offline data folder, layout of ``shared/data``) or None when unset."""
    value = _environ(environ).get(DATA_DIR_ENV)
    return Path(value).expanduser() if value else None


def cache_dir_default(environ: Mapping[str, str] | None = None) -> Path:
    """Where materialized models live: $TSENOR_CACHE_DIR, else $XDG_CACHE_HOME/tsenor, else ~/.cache/tsenor."""
    env = _environ(environ)
    value = env.get(CACHE_DIR_ENV)
    if value:
        return Path(value).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tsenor"


def debug_default(environ: Mapping[str, str] | None = None) -> bool:
    """$TSENOR_DEBUG set to anything but empty/0/false: full tracebacks instead of one `error:` line."""
    return _flag(_environ(environ), DEBUG_ENV)


def offline_default(environ: Mapping[str, str] | None = None) -> bool:
    """True when the user told the HF libraries not to reach the hub (HF_HUB_OFFLINE & co)."""
    env = _environ(environ)
    return any(_flag(env, name) for name in HUB_OFFLINE_ENVS)


def triton_interpret() -> bool:
    """Whether Triton runs its kernels in the CPU interpreter ($TRITON_INTERPRET=1, set by the tests)."""
    return os.environ.get(TRITON_INTERPRET_ENV) == "1"


OMP_THREADS_ENV = "OMP_NUM_THREADS"


def default_worker_threads(nproc: int) -> None:
    """What torchrun does before starting `nproc` > 1 processes that inherit this environment: one
    intra-op thread each unless $OMP_NUM_THREADS says otherwise (K processes of all cores would
    oversubscribe the CPU)."""
    if nproc > 1:
        os.environ.setdefault(OMP_THREADS_ENV, "1")


def child_environment(overrides: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a subprocess: this one's (`environ`, default os.environ) with `overrides`
    (e.g. the thread counts of a scaling measurement)."""
    return {**_environ(environ), **overrides}


@dataclass(frozen=True)
class DistributedContext:
    """This process's place in a run split over several processes (docs/design/distributed.md).

    rank: 0..world_size-1, rank 0 writes every file; world_size: the processes pruning one model
    together (1: this process alone); local_rank: the rank on this node, which picks its CUDA device.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size or self.local_rank < 0:
            raise ValueError(
                f"rank {self.rank}, local rank {self.local_rank} of world size {self.world_size} is not a valid place"
            )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"${name}={value!r} is not an integer; torchrun sets it, do not set it by hand") from None


def distributed_default(environ: Mapping[str, str] | None = None) -> DistributedContext:
    """$RANK, $WORLD_SIZE and $LOCAL_RANK as torchrun sets them; a single process when unset."""
    env = _environ(environ)
    world = _env_int(env, WORLD_SIZE_ENV, 1)
    rank = _env_int(env, RANK_ENV, 0)
    local = _env_int(env, LOCAL_RANK_ENV, rank)
    try:
        return DistributedContext(rank=rank, world_size=world, local_rank=local)
    except ValueError as exc:
        raise UsageError(f"the torchrun environment is inconsistent: {exc}; start the run with torchrun") from None


@dataclass(frozen=True)
class RunContext:
    """The external inputs of one run (the rule for data sources is in this module's docstring).

    data_dir: the offline data folder; None = named datasets come from the HF hub.
    offline: never contact the HF hub (hub model ids load from the local HF cache only).
    cache_dir: where embedded models are materialized.
    debug: show full tracebacks.
    distributed: this process's rank among the processes of one run (torchrun), a single one by default.
    """

    data_dir: Path | None
    offline: bool
    cache_dir: Path
    debug: bool = False
    distributed: DistributedContext = DistributedContext()

    @classmethod
    def from_environment(
        cls,
        data_dir: Path | None = None,
        offline: bool | None = None,
        cache_dir: Path | None = None,
        debug: bool | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> RunContext:
        """Explicit values win; what is None comes from the environment (`environ`, default os.environ)."""
        folder = Path(data_dir).expanduser() if data_dir is not None else data_dir_default(environ)
        return cls(
            data_dir=folder.resolve() if folder is not None else None,
            offline=offline if offline is not None else offline_default(environ),
            cache_dir=Path(cache_dir).expanduser() if cache_dir is not None else cache_dir_default(environ),
            debug=debug if debug is not None else debug_default(environ),
            distributed=distributed_default(environ),
        )

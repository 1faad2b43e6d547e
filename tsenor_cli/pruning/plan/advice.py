"""Whether a plan fits, and what would make it fit: the limits it is checked against (`plan_limits`), the
flags that would make a refused run fit (`fixes`, each re-estimated from the plan's `Sizing`), and the dry
run's end (`check_plan`: the run's own error where the run would stop)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from tsenor_cli.errors import DoesNotFitError
from tsenor_cli.pruning.block.memory import (
    KNOWN_GPUS,
    Demand,
    Limits,
    available_host_bytes,
    device_present,
    device_total_bytes,
    fit_problem,
)
from tsenor_cli.pruning.block.outside import check_outside
from tsenor_cli.pruning.block.slots import check_compatibility

if TYPE_CHECKING:
    from tsenor_cli.pruning.plan.plan import PrunePlan
    from tsenor_cli.pruning.settings.config import PruneConfig


def plan_limits(plan: PrunePlan) -> Limits:
    """The limits the plan is checked against: this machine's when it has the plan's device; for a GPU it
    lacks (a login node planning a GPU job) the host is not the run's and is not checked, and the device
    is the largest of `KNOWN_GPUS`."""
    device = torch.device(plan.device)
    if device_present(device):
        return Limits(available_host_bytes(), device_total_bytes(device))
    return Limits(None, max(size for _name, size in KNOWN_GPUS))


def _fits(plan: PrunePlan, changed: PruneConfig, processes: int, limits: Limits) -> bool:
    """Whether the run of `changed` (the plan's model, other flags) fits `limits`."""
    device = torch.device(plan.device)
    memory, host = plan.sizing.estimate(changed, min(changed.seqlen, plan.seqlen), device, plan.world_size)
    device_bytes = max(estimate.total for estimate in memory)
    demand = Demand(host, device_bytes, device, changed.nsamples, changed.seqlen, processes)
    return fit_problem(demand, limits) is None


def _switches(plan: PrunePlan, cfg: PruneConfig) -> dict[str, Callable[[PruneConfig], PruneConfig]]:
    """The flags that lower the estimate and `cfg` does not pass yet, each as the change it makes."""
    changes: dict[str, Callable[[PruneConfig], PruneConfig]] = {}
    if not cfg.stream:
        changes["--stream"] = lambda c: replace(c, stream=True)
    if plan.dtype == "float32":
        changes["--dtype bf16"] = lambda c: replace(c, dtype="bf16")
    if not cfg.offload_activations:
        changes["--offload-activations"] = lambda c: replace(c, offload_activations=True)
    return changes


def _largest(fits: Callable[[int], bool], value: int) -> int:
    """The largest size below `value` that fits, by bisection (the estimate grows with it); 0 for none."""
    low, high = 0, value - 1
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def fixes(plan: PrunePlan, cfg: PruneConfig, processes: int, limits: Limits) -> list[str]:
    """The flags that would make the run fit `limits`, each computed from the plan: --stream,
    --dtype bf16 and --offload-activations alone where they apply, else the fewest of them together,
    then the largest --nsamples and --seqlen that fit alone."""
    changes = _switches(plan, cfg)
    found: list[str] = []
    for size in range(1, len(changes) + 1):
        for combo in itertools.combinations(changes, size):
            changed = cfg
            for flag in combo:
                changed = changes[flag](changed)
            if _fits(plan, changed, processes, limits):
                found.append(" ".join(combo))
        if found:
            break
    nsamples = _largest(lambda v: _fits(plan, replace(cfg, nsamples=v), processes, limits), cfg.nsamples)
    seqlen = _largest(lambda v: _fits(plan, replace(cfg, seqlen=v), processes, limits), plan.seqlen)
    found += [f"{flag} {low}" for flag, low in (("--nsamples", nsamples), ("--seqlen", seqlen)) if low]
    return found


def check_plan(plan: PrunePlan, cfg: PruneConfig, processes: int) -> None:
    """The run's own error (its exit code too) when the run would not fit in memory (`processes` of it
    on this machine, or on the largest known GPU when this machine lacks the device: `plan_limits`), would
    stop on an incompatible layer or a matrix --nproc cannot prune, or has nothing to prune, so a dry
    run fails where the run would. A refusal to fit names the flags that would (`fixes`)."""
    limits = plan_limits(plan)
    device = torch.device(plan.device)
    demand = Demand(plan.host_memory, plan.device_bytes, device, cfg.nsamples, plan.seqlen, processes)
    problem = fit_problem(demand, limits)
    if problem is not None:
        found = fixes(plan, cfg, processes, limits)
        fix = f"pass {' or '.join(found)}" if found else "no flag of tsenor makes it fit: prune a smaller model"
        raise DoesNotFitError(f"{problem}; {fix} (nothing was written)")
    plan.check_processes()
    check_compatibility(plan.candidates, cfg.pattern, skip=cfg.skip_incompatible)
    check_outside(plan.outside_targets, cfg.pattern, skip=cfg.skip_incompatible)

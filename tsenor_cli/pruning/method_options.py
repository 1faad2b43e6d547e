"""Each pruning method's own options, one frozen dataclass per method (registered with its `PrunerSpec`).

A field's metadata holds its help line. The CLI flag and recipe key of option `x` of method `m` is
`--m-x` / `m_x` (`pruning/recipe.method_fields`); `LayerPruneConfig.options` carries the chosen
method's instance to its `prune`. No torch here: `tsenor prune --help` lists these.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from tsenor_cli.errors import UsageError


def option(default: Any, help: str, *, minimum: float | None = None) -> Any:
    """A method option: its default, help line and least value (checked when the config is built)."""
    return dataclasses.field(default=default, metadata={"help": help, "minimum": minimum})


@dataclass(frozen=True)
class MethodOptions:
    """The base of every method's options; a method without options uses it as is."""

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            want = float if item.type in ("float", float) else int
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or (want is int and isinstance(value, float))
            ):
                raise UsageError(f"method option {item.name} must be a {want.__name__}, got {value!r}; pass a number")
            least = item.metadata.get("minimum")
            if not math.isfinite(value) or (least is not None and value < least):
                raise UsageError(
                    f"method option {item.name} {value} must be finite and >= {least:g}; pass e.g. {item.default}"
                )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SparseGPTOptions(MethodOptions):
    percdamp: float = option(0.01, "Hessian dampening as a share of mean diag(H) (SparseGPT uses 1%).", minimum=0)
    blocksize: int = option(128, "Lazy-update block width in columns (rounded to a multiple of M).", minimum=1)


@dataclass(frozen=True)
class ALPSOptions(MethodOptions):
    """The ALPS ADMM schedule (mazumder-lab/ALPS). inner_sweeps, inner_iterations: the `tsenor`
    cycle-cancelling sweeps and Sinkhorn iterations of the intermediate projections where `tsenor` runs
    (`auto` on CUDA); with `flow` (`auto` on the CPU) every projection is exact (alps.inner_solver_options)."""

    percdamp: float = option(0.01, "Hessian dampening as a share of mean diag(H) (ALPS uses 1%).", minimum=0)
    rho0: float = option(0.1, "Initial ADMM penalty ρ₀.", minimum=0)
    max_iter: int = option(300, "ADMM iteration cap.", minimum=1)
    update_iter: int = option(3, "ρ-update period in iterations.", minimum=1)
    switch_iter: int = option(30, "Earliest iteration at which a converged support stops.", minimum=0)
    stop_change: float = option(3e-4, "Stop threshold on the support change between ρ updates.", minimum=0)
    cg_iters: int = option(10, "Conjugate-gradient steps refining the weights on the final mask.", minimum=0)
    inner_sweeps: int = option(2, "Cycle-cancelling sweeps of intermediate tsenor projections.", minimum=0)
    inner_iterations: int = option(0, "Sinkhorn iterations of intermediate tsenor projections.", minimum=0)

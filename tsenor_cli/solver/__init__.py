"""Transposable N:M mask solvers (paper Section 3) as pure batched torch functions.

Public API: `transposable_nm_mask`, `solve`, `SolveResult`, `METHODS`, `resolve_method` (what `auto`
runs where), and the non-transposable helpers `nm_mask` and `unstructured_mask` used by the pruning
frameworks.
"""

from tsenor_cli.solver import auto, baselines, exact, exhaustive, flow, reference, tsenor  # noqa: F401  (register methods)
from tsenor_cli.solver.api import solve, transposable_nm_mask
from tsenor_cli.solver.registry import METHODS, MethodInfo, get_method, resolve_method
from tsenor_cli.solver.rowwise import nm_mask, unstructured_mask
from tsenor_cli.solver.tiling import from_blocks, to_blocks, validate_scores
from tsenor_cli.solver.types import BlockSolution, DualState, SolveResult

__all__ = [
    "METHODS",
    "BlockSolution",
    "DualState",
    "MethodInfo",
    "SolveResult",
    "from_blocks",
    "get_method",
    "nm_mask",
    "resolve_method",
    "solve",
    "to_blocks",
    "transposable_nm_mask",
    "unstructured_mask",
    "validate_scores",
]

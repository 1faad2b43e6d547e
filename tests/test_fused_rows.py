"""Linears that share one statistics object (q/k/v, gate/up) pruned as one matrix stacked along their
outputs (`PrunerSpec.prune_rows`, issue 42): the masks each gets alone, its own records, fewer solves."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_tiny import LOCAL_CTX

from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.methods.masks import SolveTally, choose_mask
from tsenor_cli.pruning.methods.registry import PRUNERS, PrunerSpec, get_pruner
from tsenor_cli.pruning.methods.stats import InputStats
from tsenor_cli.pruning.methods.types import MatrixPruneConfig

FUSING = ("sparsegpt", "wanda", "magnitude")
# (pattern, solver): the exact reference solver (HiGHS), the CPU's default exact one (flow, what `auto`
# runs there) and row-wise and unstructured patterns, which take no solver.
CASES = {
    "transposable-exact": (SparsityPattern.from_nm(4, 8, transposable=True), "exact"),
    "transposable-flow": (SparsityPattern.from_nm(4, 8, transposable=True), "flow"),
    "nm": (SparsityPattern.from_nm(2, 4, transposable=False), "flow"),
    "unstructured": (SparsityPattern.unstructured(0.5), "flow"),
}


def _qkv(seed: int) -> tuple[list[torch.Tensor], InputStats]:
    """q/k/v-like weights (32, 24), (16, 24), (16, 24) (grouped-query: k and v smaller) and the statistics
    of correlated inputs with uneven column scales (one column that never fires) that all three read."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(rows, 24, generator=gen) * (1 + i) for i, rows in enumerate((32, 16, 16))]
    mix = torch.eye(24) + 0.3 * torch.randn(24, 24, generator=gen)
    x = (torch.randn(200, 24, generator=gen) * (0.1 + 3 * torch.rand(24, generator=gen))) @ mix
    x[:, 5] = 0.0
    return weights, InputStats.from_inputs(x)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("method", FUSING)
def test_stacked_linears_get_the_masks_they_get_alone(method: str, case: str) -> None:
    weights, stats = _qkv(seed=3)
    pattern, solver = CASES[case]
    cfg = MatrixPruneConfig(pattern, solver=solver)
    spec = PRUNERS[method]
    fused = spec.prune_rows(torch.cat(weights), [len(w) for w in weights], stats, cfg)
    alone = [spec.prune(w, stats, cfg) for w in weights]
    assert len(fused) == len(weights)
    for w, f, a in zip(weights, fused, alone, strict=True):
        assert f.mask.shape == w.shape and torch.equal(f.mask, a.mask)
        # The same float32 operations row by row; the stacked updates' matmul may round differently.
        torch.testing.assert_close(f.weight, a.weight, rtol=0, atol=1e-6)
        if a.solve is None:
            assert f.solve is None
            continue
        assert f.solve is not None and f.solve.calls == a.solve.calls
        assert f.solve.objective == pytest.approx(a.solve.objective, rel=1e-12)
        assert f.solve.upper_bound == pytest.approx(a.solve.upper_bound, rel=1e-12)
        assert f.solve.gap == pytest.approx(a.solve.gap, abs=1e-12)
    again = spec.prune_rows(torch.cat(weights), [len(w) for w in weights], stats, cfg)
    assert all(
        torch.equal(f.weight, g.weight) and torch.equal(f.mask, g.mask) for f, g in zip(fused, again, strict=True)
    )


def test_a_whole_matrix_comparison_stays_within_each_part() -> None:
    """Unstructured magnitude compares a whole matrix: stacked, a small-valued k must still keep half of
    its own weights, not lose them all to q's larger ones (hand-worked: 2×2 parts, 50%)."""
    q = torch.tensor([[9.0, 8.0], [7.0, 6.0]])
    k = torch.tensor([[4.0, 1.0], [2.0, 3.0]])
    pattern = SparsityPattern.unstructured(0.5)
    stacked = torch.cat([q, k])
    assert not choose_mask(stacked, pattern, "flow", unstructured_scope="matrix").mask[2:].any()
    per_part = choose_mask(stacked, pattern, "flow", unstructured_scope=[2, 2]).mask
    expected = torch.tensor([[True, True], [False, False], [True, False], [False, True]])
    assert torch.equal(per_part, expected)


def test_tally_splits_each_call_by_part() -> None:
    """Tiles are numbered row-major (`to_blocks`): a (12, 4) slab with M = 4 has tiles 0-1 in the first part
    (8 rows) and tile 2 in the second (4 rows); seconds go by share of rows."""
    tally = SolveTally(1, torch.device("cpu"), parts=[8, 4])
    tally.add(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([2.0, 2.0, 5.0]), seconds=3.0)
    tally.add(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0, 1.0, 1.0]), seconds=0.0)
    infos = tally.infos()
    assert infos is not None
    assert [(i.objective, i.upper_bound, i.seconds, i.calls) for i in infos] == [(5.0, 6.0, 2.0, 2), (5.0, 6.0, 1.0, 2)]
    # A stack of 2 matrices of 2 parts: matrix by matrix, part by part.
    two = SolveTally(2, torch.device("cpu"), parts=[4, 4])
    two.add(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0, 4.0]), seconds=4.0)
    infos = two.infos()
    assert infos is not None and [(i.objective, i.seconds) for i in infos] == [
        (1.0, 1.0),
        (2.0, 1.0),
        (3.0, 1.0),
        (4.0, 1.0),
    ]


def test_prune_rows_refuses_what_it_cannot_stack() -> None:
    weights, stats = _qkv(seed=0)
    cfg = MatrixPruneConfig(SparsityPattern.from_nm(4, 8, transposable=True), solver="flow")
    with pytest.raises(ValueError, match="multiples of M = 8"):
        PRUNERS["sparsegpt"].prune_rows(torch.cat([weights[0], weights[1][:12]]), [32, 12], stats, cfg)
    with pytest.raises(ValueError, match="do not add up"):
        PRUNERS["sparsegpt"].prune_rows(torch.cat(weights), [32, 16], stats, cfg)
    with pytest.raises(ValueError, match="fuses_rows=False"):
        PRUNERS["alps"].prune_rows(torch.cat(weights), [32, 16, 16], stats, cfg)
    assert {name for name, spec in PRUNERS.items() if spec.fuses_rows} == set(FUSING)


def _prune_block(tiny: Path, spec: PrunerSpec, cfg: MatrixPruneConfig) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """Block 0 of the tiny LLaMA pruned with `spec` → (its state dict, its records)."""
    from tsenor_cli.models.loading import load_model
    from tsenor_cli.pruning.block.engine import BlockPruner
    from tsenor_cli.pruning.block.slots import linear_slots
    from tsenor_cli.replay import capture_block_inputs

    structure = load_model(str(tiny), LOCAL_CTX).structure
    ids = torch.randint(0, 1000, (3, 16), generator=torch.Generator().manual_seed(0))
    inputs = capture_block_inputs(structure, ids, torch.device("cpu"))
    block = copy.deepcopy(structure.blocks[0])
    pruner = BlockPruner(structure, linear_slots(structure), spec, cfg, torch.device("cpu"), lambda _msg: None)
    records = pruner.prune(block, 0, inputs.hidden, inputs.calls[0])
    return block.state_dict(), records


# (method, the tiny LLaMA's MLP width, the stacks the engine hands the method): q (64) / k, v (32: 2 of 4
# heads) stacked, o and down alone (each reads its own input), nothing for ALPS. gate / up go apart at
# MLP width 128: stacked (256, 64), their working set (`memory.matrix_workspace`) would pass down's
# (64, 128), the largest the plan's device estimate holds (`engine._classes`); at width 512 (as at
# SmolLM2's widths) SparseGPT's stack (1024, 64) stays under down's (64, 512), whose H is 8² times q's.
STACKS = [
    ("sparsegpt", 128, [[64, 32, 32]]),
    ("sparsegpt", 512, [[64, 32, 32], [512, 512]]),
    ("wanda", 128, [[64, 32, 32]]),
    ("alps", 128, []),
]


@pytest.mark.parametrize(("method", "mlp", "expected"), STACKS)
def test_the_engine_stacks_exactly_the_linears_that_share_an_input(
    method: str, mlp: int, expected: list[list[int]], tiny_llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The linears that share an input go to the method stacked, and the block's weights and records are
    those of pruning each linear alone."""
    tiny = tiny_llama(intermediate_size=mlp)
    stacked: list[list[int]] = []
    original = PrunerSpec.prune_rows

    def spy(self: PrunerSpec, weight: Any, parts: Any, stats: Any, cfg: Any) -> Any:
        stacked.append(list(parts))
        return original(self, weight, parts, stats, cfg)

    monkeypatch.setattr(PrunerSpec, "prune_rows", spy)
    cfg = MatrixPruneConfig(SparsityPattern.from_nm(4, 8, transposable=True), solver="exact")
    spec = get_pruner(method)
    fused_weights, fused = _prune_block(tiny, spec, cfg)
    assert stacked == expected
    stacked.clear()
    apart_weights, apart = _prune_block(tiny, dataclasses.replace(spec, fuses_rows=False), cfg)
    assert stacked == []
    assert fused_weights.keys() == apart_weights.keys()
    for name, tensor in apart_weights.items():
        assert torch.equal(fused_weights[name] == 0, tensor == 0), name  # the same masks
        torch.testing.assert_close(fused_weights[name], tensor, rtol=0, atol=1e-6)
    assert len(fused) == len(apart) == 7
    for f, a in zip(fused, apart, strict=True):
        same = ("name", "out_features", "in_features", "status", "density", "solver_calls", "param", "transposed")
        assert [getattr(f, key) for key in same] == [getattr(a, key) for key in same]
        # HiGHS's bound (its dual objective on the call's tiles) moves by round-off with the call: 7e-11 seen.
        assert f.gap is not None and f.gap == pytest.approx(a.gap, abs=1e-9)
        assert f.solver_objective == pytest.approx(a.solver_objective, rel=1e-12)
        assert f.recon_error == pytest.approx(a.recon_error, rel=1e-5)
        assert f.seconds > 0 and f.solver_seconds is not None and f.solver_seconds >= 0

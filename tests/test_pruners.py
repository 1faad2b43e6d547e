"""The pruning methods on plain tensors and on a real SmolLM2 layer with real calibration activations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tsenor_cli.pruning import PRUNERS, InputStats, MatrixPruneConfig, SparsityPattern, reconstruction_error
from tsenor_cli.pruning.methods.alps import conjugate_gradient, inner_solver_options
from tsenor_cli.pruning.methods.linalg import inverse_cholesky_upper
from tsenor_cli.pruning.methods.masks import keep_better_tiles
from tsenor_cli.pruning.methods.method_options import ALPSOptions, SparseGPTOptions
from tsenor_cli.pruning.methods.stats import ExpertStats, damped_gram
from tsenor_cli.solver import solve, to_blocks

PATTERNS = {
    "transposable": SparsityPattern.from_nm(2, 4, transposable=True),
    "nm": SparsityPattern.from_nm(2, 4, transposable=False),
    "unstructured": SparsityPattern.unstructured(0.5),
}


def _problem(out: int, inp: int, tokens: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (out, in) and correlated inputs (tokens, in) with uneven column scales, like LLM activations."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen)
    mix = torch.eye(inp) + 0.3 * torch.randn(inp, inp, generator=gen)
    x = (torch.randn(tokens, inp, generator=gen) * (0.1 + 3 * torch.rand(inp, generator=gen))) @ mix
    return w.to(device), x.to(device)


def _assert_pattern(mask: torch.Tensor, pattern: SparsityPattern) -> None:
    if pattern.kind == "transposable":
        blocks = to_blocks(mask, pattern.m)  # (B, M, M)
        assert bool((blocks.sum(1) == pattern.n).all()) and bool((blocks.sum(2) == pattern.n).all())
    elif pattern.kind == "nm":
        rows, cols = mask.shape
        assert bool((mask.reshape(rows, cols // pattern.m, pattern.m).sum(2) == pattern.n).all())
    else:
        assert int(mask.sum()) == mask.numel() - round(pattern.sparsity * mask.numel())


@pytest.mark.parametrize("kind", list(PATTERNS))
@pytest.mark.parametrize("method", list(PRUNERS))
def test_masks_feasible_and_weights_supported(method: str, kind: str, device: torch.device) -> None:
    w, x = _problem(16, 32, 256, seed=1, device=device)
    pattern = PATTERNS[kind]
    out = PRUNERS[method].prune(w, InputStats.from_inputs(x), MatrixPruneConfig(pattern, solver="exhaustive"))
    assert out.mask.shape == w.shape and out.mask.dtype == torch.bool
    _assert_pattern(out.mask, pattern)
    assert bool((out.weight[~out.mask] == 0).all())
    assert bool(torch.isfinite(out.weight).all())
    if kind == "transposable":
        assert out.solve is not None and out.solve.gap == pytest.approx(0.0, abs=1e-9)  # exhaustive is exact
    else:
        assert out.solve is None


@pytest.mark.parametrize("kind", list(PATTERNS))
@pytest.mark.parametrize("method", list(PRUNERS))
def test_a_stack_prunes_as_each_matrix_alone(method: str, kind: str, device: torch.device) -> None:
    """`prune_batch` on 3 experts with their own inputs (different scales, a dead input each, different
    token counts) gives each expert what `prune` gives it alone: the same mask, the same weights to
    round-off, the same ADMM iteration count and certificate. ALPS checks its support every step from
    the first here, so its experts stop at different iterations (10, 1, 9 and so on: each keeps its own ρ
    schedule and is frozen once stopped while the others run on)."""
    experts, out, inp = 3, 16, 32
    weights = torch.stack([_problem(out, inp, 8, seed=10 + e, device=device)[0] for e in range(experts)])
    inputs = []
    stats = ExpertStats(experts, inp, gram=True, device=device)
    for e in range(experts):
        x = _problem(out, inp, 64 + 40 * e, seed=20 + e, device=device)[1] * (e + 1)
        x[:, e] = 0.0
        inputs.append(x)
        stats.add(x, torch.full((x.shape[0],), e, device=device))
    solver = "flow" if device.type == "cpu" else "auto"
    options = ALPSOptions(switch_iter=0, update_iter=1) if method == "alps" else None
    cfg = MatrixPruneConfig(PATTERNS[kind], solver=solver, options=options)
    spec = PRUNERS[method]
    batched = spec.prune_batch(weights.clone(), stats, cfg)
    assert len(batched) == experts
    for e in range(experts):
        alone = spec.prune(weights[e].clone(), InputStats.from_inputs(inputs[e]), cfg)
        assert torch.equal(batched[e].mask, alone.mask), f"expert {e}"
        torch.testing.assert_close(batched[e].weight, alone.weight, rtol=1e-5, atol=1e-6)
        assert batched[e].iterations == alone.iterations
        assert (batched[e].solve is None) == (alone.solve is None)
        if alone.solve is not None and batched[e].solve is not None:
            assert batched[e].solve.objective == pytest.approx(alone.solve.objective, rel=1e-6)  # float32 tiles
            assert batched[e].solve.gap == pytest.approx(alone.solve.gap, abs=1e-6)
    if method == "alps":
        assert len({o.iterations for o in batched}) > 1


def test_expert_statistics_select_takes_fallback_experts_from_every_token() -> None:
    """`ExpertStats.select`: the chosen experts' routed sums, except where `use` says every-token ones."""
    gen = torch.Generator().manual_seed(3)
    routed, every = ExpertStats(3, 2, gram=True, device="cpu"), ExpertStats(3, 2, gram=True, device="cpu")
    rows = torch.randn(6, 2, generator=gen)
    routed.add(rows, torch.tensor([0, 1, 2, 2, 1, 0]))
    every.add(torch.cat([rows, rows, rows]), torch.tensor([0] * 6 + [1] * 6 + [2] * 6))
    picked = routed.select(torch.tensor([2, 0]), every, torch.tensor([True, False]))
    torch.testing.assert_close(picked.require_gram()[0], rows.T @ rows)  # expert 2: every token
    mine = rows[[0, 5]]
    torch.testing.assert_close(picked.require_gram()[1], mine.T @ mine)  # expert 0: its routed rows
    torch.testing.assert_close(picked.col_norms[1], mine.square().sum(0).sqrt())
    assert picked.tokens.tolist() == [2, 2]  # the routed counts, for the report


def test_wanda_mask_is_the_optimal_transposable_mask_of_its_score() -> None:
    w, x = _problem(16, 32, 128, seed=2, device=torch.device("cpu"))
    stats = InputStats.from_inputs(x)
    out = PRUNERS["wanda"].prune(w, stats, MatrixPruneConfig(PATTERNS["transposable"], solver="exhaustive"))
    score = w.abs() * x.norm(dim=0)[None, :]  # (out, in): |W_ij|·‖X_j‖ (paper Section 4)
    best = solve(score, 2, 4, method="exhaustive")
    assert float((score * out.mask).sum()) == pytest.approx(best.objective, rel=1e-6)
    # Magnitude ignores X: its mask is optimal for |W| instead.
    mag = PRUNERS["magnitude"].prune(w, None, MatrixPruneConfig(PATTERNS["transposable"], solver="exhaustive"))
    assert float((w.abs() * mag.mask).sum()) == pytest.approx(solve(w.abs(), 2, 4, method="exhaustive").objective)


def test_reconstruction_error_matches_its_definition() -> None:
    w, x = _problem(8, 16, 64, seed=3, device=torch.device("cpu"))
    w_hat = w * (torch.rand(w.shape, generator=torch.Generator().manual_seed(0)) > 0.5)
    direct = float((x @ (w_hat - w).T).square().sum() / (x @ w.T).square().sum())
    assert reconstruction_error(w, w_hat, InputStats.from_inputs(x).require_gram()) == pytest.approx(direct, rel=1e-4)


@pytest.mark.parametrize("kind", ["transposable", "nm"])
def test_sparsegpt_lazy_blocks_equal_column_by_column(kind: str) -> None:
    """The lazy batch update is an exact reordering of OBS: any block width gives the same result."""
    w, x = _problem(16, 64, 256, seed=4, device=torch.device("cpu"))
    stats = InputStats.from_inputs(x)
    wide = PRUNERS["sparsegpt"].prune(
        w, stats, MatrixPruneConfig(PATTERNS[kind], "exhaustive", SparseGPTOptions(blocksize=128))
    )
    narrow = PRUNERS["sparsegpt"].prune(
        w, stats, MatrixPruneConfig(PATTERNS[kind], "exhaustive", SparseGPTOptions(blocksize=4))
    )
    assert torch.equal(wide.mask, narrow.mask)
    torch.testing.assert_close(wide.weight, narrow.weight, rtol=1e-4, atol=1e-5)


def _sparsegpt_column_by_column(w: torch.Tensor, gram: torch.Tensor, n: int, m: int, percdamp: float) -> torch.Tensor:
    """The transposable SparseGPT of paper Section 4 without lazy batches, one slab solve per M columns:
    w (out, in) → the mask (out, in) bool (the reference for the batched code path)."""
    w = w.clone().masked_fill_((gram.diagonal() == 0)[None, :], 0.0)
    hinv = inverse_cholesky_upper(damped_gram(gram, percdamp))  # (in, in) upper
    mask = torch.zeros_like(w, dtype=torch.bool)
    for i0 in range(0, w.shape[1], m):
        d = hinv.diagonal()[i0 : i0 + m]  # (M,)
        mask[:, i0 : i0 + m] = solve(w[:, i0 : i0 + m].square() / d.square(), n, m, method="flow").mask
        for i in range(i0, i0 + m):
            err = torch.where(mask[:, i], torch.zeros_like(w[:, i]), w[:, i]) / hinv[i, i]  # (out,)
            w[:, i:] -= err[:, None] * hinv[i, None, i:]
    return mask


@pytest.mark.parametrize("source", ["random", "smollm2"])
@pytest.mark.parametrize(("n", "m"), [(2, 4), (8, 16), (16, 32)])
def test_sparsegpt_transposable_slab_solves_equal_column_by_column(
    source: str, n: int, m: int, smollm2_path: Path
) -> None:
    """Every lazy block width (one slab, several, 128, and 30 and 100, not multiples of M: rounded down to whole
    slabs) gives the masks of one exact slab solve per M columns with plain OBS updates between them."""
    if source == "random":
        w, x = _problem(64, 192, 512, seed=n, device=torch.device("cpu"))
    else:
        with safe_open(str(smollm2_path / "model.safetensors"), "pt") as f:
            w = f.get_tensor("model.layers.2.self_attn.k_proj.weight").float()[:, :192]  # (192, 192) real
        _, x = _problem(64, 192, 512, seed=n, device=torch.device("cpu"))
    stats = InputStats.from_inputs(x)
    pattern = SparsityPattern.from_nm(n, m, transposable=True)
    want = _sparsegpt_column_by_column(w, stats.require_gram(), n, m, SparseGPTOptions().percdamp)
    weights = []
    for blocksize in sorted({m, 3 * m, 30, 100, 128}):
        out = PRUNERS["sparsegpt"].prune(
            w, stats, MatrixPruneConfig(pattern, solver="flow", options=SparseGPTOptions(blocksize=blocksize))
        )
        assert torch.equal(out.mask, want), f"blocksize {blocksize}"
        weights.append(out.weight)
    for other in weights[1:]:
        torch.testing.assert_close(other, weights[0], rtol=1e-4, atol=1e-5)


def test_sparsegpt_updates_beat_masking_alone() -> None:
    w, x = _problem(32, 64, 512, seed=5, device=torch.device("cpu"))
    gram = InputStats.from_inputs(x).require_gram()
    out = PRUNERS["sparsegpt"].prune(
        w, InputStats.from_inputs(x), MatrixPruneConfig(PATTERNS["transposable"], "exhaustive")
    )
    assert reconstruction_error(w, out.weight, gram) < 0.8 * reconstruction_error(w, w * out.mask, gram)


def _refit(w: torch.Tensor, mask: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Least squares on a fixed support, row by row (reference for the CG step): (out, in)."""
    rows = []
    for r in range(w.shape[0]):
        s = mask[r]
        sol = torch.zeros_like(w[r], dtype=torch.float64)
        sol[s] = torch.linalg.solve(h[s][:, s].double(), (w[r].double() @ h.double())[s])
        rows.append(sol)
    return torch.stack(rows).to(w.dtype)


def test_alps_weights_are_optimal_on_their_support_and_beat_one_shot_methods() -> None:
    w, x = _problem(16, 32, 512, seed=6, device=torch.device("cpu"))
    stats = InputStats.from_inputs(x)
    gram = stats.require_gram()
    cfg = MatrixPruneConfig(PATTERNS["transposable"], solver="exhaustive")
    alps = PRUNERS["alps"].prune(w, stats, cfg)
    assert 1 <= alps.iterations <= ALPSOptions().max_iter
    # CG refinement reaches the damped least-squares optimum on the chosen support.
    best = _refit(w, alps.mask, damped_gram(gram, ALPSOptions().percdamp))
    assert reconstruction_error(w, alps.weight, gram) <= 1.02 * reconstruction_error(w, best, gram) + 1e-7
    errors = {m: reconstruction_error(w, PRUNERS[m].prune(w, stats, cfg).weight, gram) for m in PRUNERS}
    assert errors["alps"] < errors["sparsegpt"] < errors["wanda"]


def test_alps_inner_projections_are_cheap_only_where_tsenor_runs() -> None:
    """The intermediate D-steps pass reduced options to `tsenor` alone: asked for by name on any device,
    or picked by `auto` on CUDA; `auto` on CPU runs the exact `flow` for every projection, M = 4 the
    exhaustive enumeration, and other solvers run as asked."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cheap = {"sweeps": 2, "bound": "potentials", "iterations": 0}
    assert inner_solver_options("auto", 2, 0, cuda, 16) == cheap
    assert inner_solver_options("auto", 2, 0, cuda, 16, 4096 * 4096) == cheap
    assert inner_solver_options("auto", 2, 0, cuda, 16, 64 * 64) == {}  # few tiles: flow on the host
    assert inner_solver_options("tsenor", 2, 0, cuda, 16) == cheap
    assert inner_solver_options("tsenor", 2, 0, cpu, 16) == cheap
    assert inner_solver_options("auto", 2, 0, cpu, 16) == {}
    assert inner_solver_options("auto", 2, 0, cuda, 4) == {}
    assert inner_solver_options("flow", 2, 0, cuda, 16) == {}
    assert inner_solver_options("exact", 2, 0, cuda, 16) == {}


@pytest.mark.cuda
def test_alps_with_cheap_inner_projections_stays_close_to_full_projections() -> None:
    """Real-valued random layer, transposable 8:16 with the default solver on CUDA (`auto` runs `tsenor`
    there, with the cheap projections): they cost at most 5% more reconstruction error than full ones."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: on CPU `auto` runs the exact flow for every ALPS projection")
    w, x = _problem(32, 64, 512, seed=8, device=torch.device("cuda"))
    stats = InputStats.from_inputs(x)
    gram = stats.require_gram()
    pattern = SparsityPattern.from_nm(8, 16, transposable=True)
    cheap = PRUNERS["alps"].prune(w, stats, MatrixPruneConfig(pattern))
    full = PRUNERS["alps"].prune(
        w, stats, MatrixPruneConfig(pattern, options=ALPSOptions(inner_sweeps=30, inner_iterations=25))
    )
    assert reconstruction_error(w, cheap.weight, gram) <= 1.05 * reconstruction_error(w, full.weight, gram)


@pytest.mark.parametrize("solver", ["auto", "flow"])
def test_alps_on_cpu_follows_exact_projections(solver: str) -> None:
    """On CPU the default `auto` runs the exact `flow`, so ALPS with it takes the same ADMM path as ALPS
    with the HiGHS `exact` solver: same iterations, same mask, same weights (continuous data, no ties)."""
    w, x = _problem(32, 64, 512, seed=9, device=torch.device("cpu"))
    stats = InputStats.from_inputs(x)
    pattern = SparsityPattern.from_nm(8, 16, transposable=True)
    ours = PRUNERS["alps"].prune(w, stats, MatrixPruneConfig(pattern, solver=solver))
    exact = PRUNERS["alps"].prune(w, stats, MatrixPruneConfig(pattern, solver="exact"))
    assert ours.iterations == exact.iterations
    assert torch.equal(ours.mask, exact.mask)
    torch.testing.assert_close(ours.weight, exact.weight)


def test_conjugate_gradient_solves_the_restricted_system() -> None:
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(12, 12, generator=gen, dtype=torch.float64)
    h = a @ a.T + 12 * torch.eye(12, dtype=torch.float64)
    rhs = torch.randn(3, 12, generator=gen, dtype=torch.float64)
    support = torch.rand(3, 12, generator=gen) > 0.4
    x = conjugate_gradient(h, rhs, support, torch.zeros_like(rhs), iters=12, rtol=1e-12)
    for r in range(3):
        s = support[r]
        torch.testing.assert_close(x[r, s], torch.linalg.solve(h[s][:, s], rhs[r, s]))
        assert bool((x[r, ~s] == 0).all())


def test_safeguard_keeps_the_better_tile() -> None:
    """Assumption 1 per tile: a tile where the previous mask scores higher keeps the previous mask."""
    scores = torch.tensor(
        [[9.0, 0, 0, 0, 1, 1, 1, 1], [0, 9, 0, 0, 1, 1, 1, 1], [0, 0, 9, 0, 1, 1, 1, 1], [0, 0, 0, 9, 1, 1, 1, 1]]
    )  # (4, 8): two 4×4 tiles, N=1
    new = solve(scores, 1, 4, method="exhaustive")
    worse_tile0 = new.mask.clone()
    worse_tile0[:, :4] = torch.eye(4, dtype=torch.bool).flip(0)  # anti-diagonal: objective 0 on tile 0
    fake_new = solve(scores * torch.tensor([0.0] * 4 + [1.0] * 4), 1, 4, method="exhaustive")
    # Previous mask = the optimal one; "new" result whose tile 0 is worse on the current scores.
    previous = new.mask
    _, obj_new, _ = keep_better_tiles(scores, new, worse_tile0, 4)
    mask, block_obj, kept = keep_better_tiles(scores, fake_new, previous, 4)
    assert kept.tolist() == [True, False]  # tile 0 kept from the previous mask, tile 1 the new one
    assert torch.equal(mask[:, :4], previous[:, :4])
    assert float(block_obj.sum()) >= float(obj_new.sum()) - 1e-9
    assert bool((block_obj >= to_blocks(scores.double() * fake_new.mask, 4).sum((1, 2)) - 1e-12).all())


@pytest.mark.realmodel
@pytest.mark.realdata
@pytest.mark.slow
def test_method_ordering_on_a_real_smollm2_layer(smollm2_path: object, data_ctx: object) -> None:
    """Real weights and real activations (C4 calibration through SmolLM2 up to block 2's k_proj, 192×576).

    The paper's ordering alps ≤ sparsegpt ≤ wanda holds robustly for the reconstruction error; magnitude vs
    wanda is close and not asserted.
    """
    from helpers_tiny import LOCAL_CTX

    from tsenor_cli.data.calibration import calibration_batches
    from tsenor_cli.models.loading import load_model

    loaded = load_model(str(smollm2_path), LOCAL_CTX)
    calib = calibration_batches("c4", loaded.tokenizer, data_ctx, nsamples=4, seqlen=128, seed=0)  # type: ignore[arg-type]
    linear = loaded.structure.block_linears(2)["self_attn.k_proj"]
    stats = InputStats(linear.in_features, gram=True, device="cpu")
    handle = linear.register_forward_hook(lambda _m, args, _o: stats.add(args[0]))
    with torch.no_grad():
        loaded.model(calib.input_ids)
    handle.remove()
    w = linear.weight.data.float()
    cfg = MatrixPruneConfig(PATTERNS["transposable"], solver="exhaustive")
    gram = stats.require_gram()
    errors = {}
    for method, spec in PRUNERS.items():
        out = spec.prune(w, stats, cfg)
        _assert_pattern(out.mask, cfg.pattern)
        errors[method] = reconstruction_error(w, out.weight, gram)
    assert errors["alps"] < errors["sparsegpt"] < errors["wanda"] < 1.0
    assert errors["magnitude"] < 1.0

"""`--kernels sparse` (tsenor_cli/kernels/sparse.py): the 2:4-pruned linears on sparse kernels.

On CUDA (the `device` fixture) the real kernel runs and must match the dense layer within bf16 rounding;
on the CPU the same autograd function runs with the dense stand-in of the sparse product, so its math
(the transposable backward on Wᵀ's compressed copy, the dense masked weight gradient, the refresh after
a weight change), the choice of linears and every fallback line are tested without a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import LOCAL_CTX, make_tiny_llama
from torch import nn

from tsenor_cli.errors import VerificationError
from tsenor_cli.evaluation.runner import EvalConfig, evaluate_model, load_for_evaluation
from tsenor_cli.kernels import sparse
from tsenor_cli.kernels.sparse import STAND_IN, KernelPlan, cuda_backend, plan_kernels
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.runfiles import PrunedWeight, SparsityRecord, read_sparsity
from tsenor_cli.settings import RunContext
from tsenor_cli.solver import nm_mask, transposable_nm_mask

TWO_FOUR = SparsityPattern.from_nm(2, 4, transposable=True)


def _two_four_linear(
    out_features: int, in_features: int, *, transposable: bool, device: torch.device, dtype: torch.dtype
) -> nn.Linear:
    """A linear with bias whose weight is magnitude-pruned to 2:4 (along columns too when transposable)."""
    torch.manual_seed(0)
    layer = nn.Linear(in_features, out_features)
    scores = layer.weight.detach().abs()
    mask = transposable_nm_mask(scores, 2, 4, method="exhaustive") if transposable else nm_mask(scores, 2, 4)
    with torch.no_grad():
        layer.weight.mul_(mask)
    return layer.to(device=device, dtype=dtype)


def _record(names: list[str], pattern: SparsityPattern = TWO_FOUR) -> SparsityRecord:
    pruned = tuple(PrunedWeight(name, f"{name}.weight") for name in names)
    return SparsityRecord("magnitude", pattern, None, None, pruned, (), None)


def _backend(device: torch.device) -> tuple[str, torch.dtype]:
    """The backend a device test runs: the real kernel in bf16 on CUDA (skipped where the GPU has none),
    the dense stand-in in fp32 on the CPU."""
    if device.type == "cpu":
        return STAND_IN, torch.float32
    backend, why = cuda_backend(device)
    if backend is None:
        pytest.skip(why)
    return backend, torch.bfloat16


@pytest.mark.parametrize("transposable", [True, False], ids=["transposable", "ordinary"])
def test_a_sparse_linear_gives_the_dense_masked_layers_output_and_gradients(
    device: torch.device, transposable: bool
) -> None:
    backend, dtype = _backend(device)
    layer = _two_four_linear(64, 128, transposable=transposable, device=device, dtype=dtype)  # CUTLASS's tile
    dense = _two_four_linear(64, 128, transposable=transposable, device=device, dtype=dtype)
    plan = KernelPlan(backend, {"": transposable}, dtypes=(dtype,))
    assert plan.install(layer) == 1
    # 15 tokens: not a multiple of the kernels' 8, so the padding is exercised on CUDA.
    x = torch.randn(3, 5, 128, device=device, dtype=dtype, requires_grad=True)
    x_dense = x.detach().clone().requires_grad_(True)
    grad = torch.randn(3, 5, 64, device=device, dtype=dtype)
    y, y_dense = layer(x), dense(x_dense)
    (y * grad).sum().backward()
    (y_dense * grad).sum().backward()
    tol = {"rtol": 0, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for got, want in ((y, y_dense), (x.grad, x_dense.grad), (layer.weight.grad, dense.weight.grad)):
        assert got is not None and want is not None
        torch.testing.assert_close(got.float(), want.float(), **tol)
    assert layer.bias.grad is not None and dense.bias.grad is not None
    torch.testing.assert_close(layer.bias.grad.float(), dense.bias.grad.float(), **tol)
    # The input gradient ran on Wᵀ's compressed copy exactly when the mask is transposable.
    assert plan.kernels[""].compressed == ((False, True) if transposable else (False,))
    plan.uninstall()
    assert "forward" not in vars(layer)


def test_the_compressed_copies_are_made_again_only_after_a_refresh() -> None:
    layer = _two_four_linear(8, 16, transposable=True, device=torch.device("cpu"), dtype=torch.float32)
    plan = KernelPlan(STAND_IN, {"": True}, dtypes=(torch.float32,))
    plan.install(layer)
    x = torch.randn(4, 16)
    before = layer(x).detach()
    with torch.no_grad():
        layer.weight.mul_(2.0)  # what an optimizer step does to the kept weights
    torch.testing.assert_close(layer(x), before)  # still the old copy: a run must refresh
    plan.refresh()
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.odd = nn.Linear(6, 8)  # 6 inputs: not whole groups of 4
        self.table = nn.Embedding(10, 16)
        self.down = nn.Linear(32, 16)


def test_the_plan_takes_the_recorded_linears_the_kernel_can_run() -> None:
    block = _Block()
    record = _record(["up", "odd", "table"])  # down is not recorded: left alone whatever its name
    plan = plan_kernels(block, record, torch.device("cpu"), torch.float32, backend=STAND_IN)
    assert dict(plan.linears) == {"up": True}
    assert set(plan.dense) == {"odd", "table"}
    assert plan.dense["table"] == "not nn.Linear weights"
    line = plan.line()
    assert "\n" not in line
    assert line.startswith("kernels: sparse (a dense stand-in) for the forward of 1 2:4-pruned linears")
    assert "2 pruned matrices dense" in line
    ordinary = _record(["up"], SparsityPattern.from_nm(2, 4, transposable=False))
    assert dict(plan_kernels(block, ordinary, torch.device("cpu"), torch.float32, backend=STAND_IN).linears) == {
        "up": False
    }


@pytest.mark.parametrize(
    ("record", "device", "dtype", "backend", "why"),
    [
        (None, "cpu", torch.bfloat16, None, "the checkpoint records no sparsity"),
        (_record(["up"], SparsityPattern.from_nm(16, 32, transposable=True)), "cpu", torch.bfloat16, None,
         "its pattern is 16:32 transposable; sparse tensor cores take 2:4"),
        (_record(["up"]), "cpu", torch.bfloat16, None, "the model runs on the cpu"),
        (_record(["up"]), "cuda", torch.float32, "cusparselt-direct", "the model computes in float32"),
        (_record(["odd", "table"]), "cpu", torch.float32, STAND_IN, "none of its 2 pruned matrices can"),
    ],
    ids=["no-record", "16:32", "cpu", "fp32", "no-linear-fits"],
)  # fmt: skip
def test_each_fallback_is_one_line_saying_why(
    record: SparsityRecord | None, device: str, dtype: torch.dtype, backend: str | None, why: str
) -> None:
    plan = plan_kernels(_Block(), record, torch.device(device), dtype, backend=backend)
    assert plan.backend is None and not plan.linears
    line = plan.line()
    assert line.startswith("kernels: dense, not sparse: ") and why in line and "\n" not in line
    assert plan.install(_Block()) == 0


def test_weights_that_break_the_recorded_two_four_are_refused() -> None:
    layer = _two_four_linear(8, 16, transposable=False, device=torch.device("cpu"), dtype=torch.float32)
    rows_only = torch.tensor([1.0, 1.0, 0.0, 0.0]).repeat(8, 4)  # 2:4 along rows, 4 or 0 of 4 along columns
    with torch.no_grad():
        layer.weight.copy_(rows_only)
    with pytest.raises(VerificationError, match="not 2:4 along rows and columns"):
        KernelPlan(STAND_IN, {"": True}, dtypes=(torch.float32,)).install(layer)
    assert KernelPlan(STAND_IN, {"": False}, dtypes=(torch.float32,)).install(layer) == 1
    with torch.no_grad():
        layer.weight.fill_(1.0)
    with pytest.raises(VerificationError, match="not 2:4, as the checkpoint's sparsity record says"):
        KernelPlan(STAND_IN, {"": False}, dtypes=(torch.float32,)).install(layer)


# ---------------------------------------------------------------- eval and finetune with the kernels


@pytest.fixture(scope="module")
def pruned_two_four(tmp_path_factory: pytest.TempPathFactory, data_ctx: RunContext) -> Path:
    """A tiny random LLaMA pruned to transposable 2:4 by magnitude."""
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig
    from tsenor_cli.pruning.run.api import prune_model
    from tsenor_cli.pruning.settings.config import PruneConfig

    root = tmp_path_factory.mktemp("kernels")
    cfg = PruneConfig(
        model=str(make_tiny_llama(root / "src")),
        matrix=MatrixPruneConfig(TWO_FOUR, solver="exact"),
        method="magnitude",
        calib_data="wikitext2",
        nsamples=2,
        seqlen=16,
        output=root / "pruned",
    )
    prune_model(cfg, data_ctx)
    return root / "pruned"


@pytest.fixture
def stand_in_gpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The CPU taken for a GPU with 2:4 kernels, run by the dense stand-in; → the count of sparse products."""
    calls: list[int] = []
    linear = sparse.SparseOperand.linear

    def counted(self: Any, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return linear(self, y)

    monkeypatch.setattr(sparse, "cuda_backend", lambda device: (STAND_IN, ""))
    monkeypatch.setattr(sparse.SparseOperand, "linear", counted)
    return calls


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_eval_with_sparse_kernels_gives_the_dense_perplexity(
    pruned_two_four: Path, data_ctx: RunContext, stand_in_gpu: list[int], stream: bool
) -> None:
    def ppl(kernels: str, said: list[str]) -> float:
        cfg = EvalConfig(ppl_datasets=("wikitext2",), seqlen=32, max_windows=2, stream=stream, kernels=kernels)
        loaded = load_for_evaluation(str(pruned_two_four), data_ctx, cfg, dtype=None, device="cpu")
        assert (loaded.checkpoint is not None) == stream
        return evaluate_model(loaded, cfg, data_ctx, progress=said.append).perplexity["wikitext2"].ppl

    lines: list[str] = []
    dense = ppl("dense", [])
    assert not stand_in_gpu
    sparse_ppl = ppl("sparse", lines)
    record = read_sparsity(pruned_two_four)
    assert record is not None
    pruned = len(record.pruned)
    kernel_lines = [line for line in lines if line.startswith("kernels:")]
    assert kernel_lines == [
        f"kernels: sparse (a dense stand-in) for the forward of {pruned} 2:4-pruned linears, {pruned} of them "
        "also for the input gradient (the transposable mask on Wᵀ)"
    ]
    assert len(stand_in_gpu) >= pruned  # every pruned linear ran on the kernel path
    assert sparse_ppl == pytest.approx(dense, rel=1e-6)


def test_eval_on_the_cpu_says_in_one_line_that_it_runs_dense(pruned_two_four: Path, data_dir: Path) -> None:
    args = ["eval", str(pruned_two_four), "--kernels", "sparse", "--device", "cpu", "--ppl", "wikitext2"]
    result = invoke([*args, "--seqlen", "32", "--max-windows", "1", "--data-dir", str(data_dir), "--json"])
    assert result.exit_code == 0, result.output
    assert result.output.count("kernels: dense, not sparse: the model runs on the cpu") == 1
    bad = invoke(["eval", str(pruned_two_four), "--kernels", "fast"])
    assert bad.exit_code == 2 and str(bad.exception) == "unknown --kernels 'fast'; choose one of: dense, sparse"


def test_finetune_on_sparse_kernels_trains_as_the_dense_run(
    pruned_two_four: Path, tmp_path: Path, stand_in_gpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four steps at a large learning rate on the stand-in kernels give the dense run's weights; without
    the refresh after each step the stand-in computes with stale weights and the run differs."""
    from safetensors.torch import load_file

    from tsenor_cli.finetune.run import FinetuneConfig, finetune

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. " * 40)

    def run(name: str, kernels: str) -> dict[str, torch.Tensor]:
        cfg = FinetuneConfig(
            run_dir=pruned_two_four, output=tmp_path / name, data=str(text), seqlen=32, max_steps=4, lr=1e-2,
            batch_size=2, ppl_datasets=(), save_every=0, kernels=kernels,
        )  # fmt: skip
        report = finetune(cfg, LOCAL_CTX)
        assert report.pruned_nonzero == 0
        return load_file(str(tmp_path / name / "model.safetensors"))

    dense = run("dense", "dense")
    assert not stand_in_gpu
    on_kernels = run("sparse", "sparse")
    assert stand_in_gpu
    for key, want in dense.items():
        torch.testing.assert_close(on_kernels[key], want, rtol=1e-4, atol=1e-5, msg=key)
    monkeypatch.setattr(sparse.KernelPlan, "refresh", lambda self: None)
    stale = run("stale", "sparse")
    assert any(not torch.allclose(stale[key], want, rtol=1e-4, atol=1e-5) for key, want in dense.items())


def test_the_direct_path_searches_each_shape_once_and_calls_its_algorithm(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuSPARSELt's default algorithm left the 8B MLP step at 0.59x dense on an H200 (gpu-check 2026-11-29):
    the product runs the searched one, searched once per (shape, padded tokens up to a power of two) for
    every linear of that shape and kept across refreshes. torch's ops stand in on the CPU (compress: a
    copy; the product: A·B)."""
    searched: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    used: list[int] = []

    def search(packed: torch.Tensor, dense: torch.Tensor, transpose_result: bool = False) -> int:
        searched.append((tuple(packed.shape), tuple(dense.shape)))
        return 7

    def sparse_mm(packed: torch.Tensor, dense: torch.Tensor, transpose_result: bool = False, alg_id: int = 0):
        used.append(alg_id)
        product = packed @ dense
        return product.t() if transpose_result else product

    monkeypatch.setattr(torch, "_cslt_compress", lambda w: w.clone())
    monkeypatch.setattr(torch, "_cslt_sparse_mm_search", search)
    monkeypatch.setattr(torch, "_cslt_sparse_mm", sparse_mm)
    monkeypatch.setattr(sparse, "_ALGORITHMS", {})
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(16, 32, generator=gen, dtype=torch.float64) for _ in range(2)]  # two linears, one shape
    x = torch.randn(13, 32, generator=gen, dtype=torch.float64)  # 13 tokens: padded to 16
    kernels = [sparse.LinearKernel("cusparselt-direct", transposable=False) for _ in weights]
    for kernel, weight in zip(kernels, weights, strict=True):
        for _ in range(2):
            out = kernel.operand(weight, transposed=False).linear(x)
            torch.testing.assert_close(out, x @ weight.t())
        kernel.refresh()
    kernels[0].operand(weights[0], transposed=False).linear(x[:3])  # 3 tokens: padded to 8, another shape
    long = torch.randn(30, 32, generator=gen, dtype=torch.float64)
    for tokens in (20, 30):  # padded to 24 and 32: one power of two, one search
        kernels[0].operand(weights[0], transposed=False).linear(long[:tokens])
    assert searched == [((16, 32), (32, 16)), ((16, 32), (32, 8)), ((16, 32), (32, 24))]
    assert used == [7] * 7


def test_the_break_even_tokens_per_optimizer_step_by_hand() -> None:
    """k micro-batches of T tokens: dense k·10 ms, sparse k·8 ms + 6 ms of compression: even at k = 3."""
    from tsenor_cli.bench.kernels import breakeven_tokens

    assert breakeven_tokens(8192, 10.0, 8.0, 6.0) == pytest.approx(3 * 8192)
    assert breakeven_tokens(8192, 10.0, 10.0, 6.0) is None  # the products alone no faster: never
    assert breakeven_tokens(8192, 10.0, 8.0, -0.5) == 0.0  # timing noise below zero: even at once


def test_the_graphed_prefill_record_says_which_side_was_not_captured() -> None:
    """`tsenor bench kernels`' CUDA-graph row: the ratio when both sides replay, else one note naming the side."""
    from tsenor_cli.bench.kernels import _graphed_record

    assert _graphed_record(8192, 4.0, 2.0) == pytest.approx(
        {"dense_tokens_per_s": 2048e3, "sparse_tokens_per_s": 4096e3, "speedup": 2.0}
    )
    cpu = "CUDA graphs need a CUDA GPU"
    assert _graphed_record(8, cpu, cpu) == {"note": cpu}
    assert _graphed_record(8, "not measured: the sparse capture failed", "not captured: X") == {
        "note": "sparse not captured: X"
    }
    assert _graphed_record(8, "not captured: Y", 2.0) == {"note": "dense not captured: Y"}


# ---------------------------------------------------------------- the fused compression of W and Wᵀ


def test_the_tile_patterns_are_the_90_transposable_two_four_tiles() -> None:
    """4×4 0/1 matrices with every row and column summing to 2: 90 of them (the 2-regular bipartite
    graphs on 4 + 4 vertices), each once."""
    tiles = sparse.tile_patterns()
    assert tiles.shape == (90, 4, 4)
    assert (tiles.sum(1) == 2).all() and (tiles.sum(2) == 2).all()
    assert len({tuple(tile.flatten().tolist()) for tile in tiles}) == 90


def test_the_probe_is_transposable_two_four_with_no_kept_zero_and_every_pattern() -> None:
    probe = sparse.transposable_probe((128, 128), torch.device("cpu"), torch.bfloat16)
    assert sparse.two_four_rows(probe) and sparse.two_four_rows(probe.t())
    kept = probe != 0
    assert int(kept.sum()) == 128 * 64  # exactly 2 of 4: no kept value is zero
    assert float(probe.abs()[kept].min()) >= 0.5
    tiles = kept.reshape(32, 4, 32, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    assert len({tuple(tile.tolist()) for tile in tiles}) == 90  # 1024 tiles show every pattern
    torch.testing.assert_close(probe, sparse.transposable_probe((128, 128), torch.device("cpu"), torch.bfloat16))


@pytest.fixture
def cslt_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """torch's cuSPARSELt ops and fused tile kernel stood in on the CPU: a compressed form is the matrix
    itself, the product A·B; → the shapes the fused kernel was called on."""
    fused_calls: list[tuple[int, ...]] = []

    def tile(matrix: torch.Tensor, algorithm: str = "", use_cutlass: bool = True) -> tuple[torch.Tensor, ...]:
        assert algorithm == "largest_abs_values_greedy" and not use_cutlass
        fused_calls.append(tuple(matrix.shape))
        return matrix.clone(), None, matrix.t().contiguous(), None, None  # type: ignore[return-value]

    def sparse_mm(packed: torch.Tensor, dense: torch.Tensor, transpose_result: bool = False, alg_id: int = 0):
        product = packed @ dense
        return product.t() if transpose_result else product

    monkeypatch.setattr(torch, "_cslt_compress", lambda w: w.clone(), raising=False)
    monkeypatch.setattr(torch, "_cslt_sparse_mm_search", lambda *a, **k: 0, raising=False)
    monkeypatch.setattr(torch, "_cslt_sparse_mm", sparse_mm, raising=False)
    monkeypatch.setattr(torch, sparse.FUSED_OP, tile, raising=False)
    monkeypatch.setattr(sparse, "_FUSED", {})
    monkeypatch.setattr(sparse, "_ALGORITHMS", {})
    return fused_calls


def test_training_makes_both_copies_in_one_fused_pass_where_the_shape_was_checked(
    cslt_on_cpu: list[tuple[int, ...]],
) -> None:
    """Three transposable linears: two of a 128-multiple shape (checked once, then both copies from one
    fused call per forward), one of 64 rows (the fused layout's 128 rows not met: apart, said in the line)."""
    layers = nn.ModuleDict(
        {name: _two_four_linear(o, i, transposable=True, device=torch.device("cpu"), dtype=torch.float64)
         for name, (o, i) in {"a": (128, 256), "b": (128, 256), "c": (64, 128)}.items()}
    )  # fmt: skip
    plan = KernelPlan("cusparselt-direct", dict.fromkeys(layers, True), dtypes=(torch.float64,),
                      training=True, dtype=torch.float64)  # fmt: skip
    assert plan.install(layers) == 3
    assert cslt_on_cpu == [(128, 256)]  # the check's probe: one shape, once
    assert plan.fused == {"a": "", "b": "", "c": "a shape not in multiples of 128"}
    assert plan.line().endswith(
        "; W and Wᵀ compressed in one pass (torch's fused 2:4 kernel, checked against cuSPARSELt's own) for 2, "
        "apart by cuSPARSELt for 1 (1 a shape not in multiples of 128)"
    )
    for name, layer in layers.items():
        x = torch.randn(13, layer.in_features, dtype=torch.float64, requires_grad=True)
        y = layer(x)
        (x_grad,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(y, nn.functional.linear(x, layer.weight, layer.bias))
        torch.testing.assert_close(x_grad, torch.ones_like(y) @ layer.weight)
        assert plan.kernels[name].compressed == (False, True)
    assert cslt_on_cpu == [(128, 256)] * 3  # the probe, then one fused call for each of a and b
    plan.refresh()
    with torch.no_grad():  # an evaluation: W's copy only, never through the fused kernel
        layers["a"](torch.randn(8, 256, dtype=torch.float64))
    assert plan.kernels["a"].compressed == (False,) and len(cslt_on_cpu) == 3


def test_a_fused_layout_unlike_cusparselts_own_is_not_used_and_said(
    cslt_on_cpu: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "_cslt_compress", lambda w: w.flip(0).contiguous())  # another byte order
    layer = _two_four_linear(128, 128, transposable=True, device=torch.device("cpu"), dtype=torch.float64)
    plan = KernelPlan("cusparselt-direct", {"": True}, dtypes=(torch.float64,), training=True, dtype=torch.float64)
    plan.install(layer)
    assert plan.fused == {"": "its layout differs from cuSPARSELt's compression on this GPU"}
    assert "for 0, apart by cuSPARSELt for 1 (1 its layout differs" in plan.line()
    x = torch.randn(8, 128, dtype=torch.float64, requires_grad=True)
    layer(x).sum().backward()
    assert cslt_on_cpu == [(128, 128)]  # the check's call only: the copies were made apart
    untrained = KernelPlan("cusparselt-direct", {"": True}, dtypes=(torch.float64,), dtype=torch.float64)
    untrained.install(layer)
    assert not untrained.fused and "one pass" not in untrained.line()  # evaluation: nothing checked


def test_on_cuda_the_fused_copies_give_cusparselts_products(device: torch.device) -> None:
    """The real fused kernel against cuSPARSELt's own compression on a pruned weight: the same products
    to the bit, W's and Wᵀ's (skipped where the check found the layouts differ, which it then says)."""
    if device.type != "cuda":
        pytest.skip("the fused kernel and cuSPARSELt are CUDA's")
    backend, dtype = _backend(device)
    if backend != "cusparselt-direct":
        pytest.skip(f"{backend}: the fused kernel serves cuSPARSELt")
    problem = sparse.fused_problem((256, 512), device, dtype)
    if problem:
        pytest.skip(problem)
    weight = _two_four_linear(256, 512, transposable=True, device=device, dtype=dtype).weight.detach()
    forward, backward = sparse.fused_operands(weight)
    x, dy = torch.randn(64, 512, device=device, dtype=dtype), torch.randn(64, 256, device=device, dtype=dtype)
    assert torch.equal(forward.linear(x), sparse.SparseOperand(weight, backend).linear(x))
    assert torch.equal(backward.linear(dy), sparse.SparseOperand(weight.t(), backend).linear(dy))

"""`tsenor bench speedup`: the parts that run without a GPU (shapes, 2:4 masks, Markdown, the CPU refusal)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tsenor_cli.bench.speedup import (
    BACKENDS,
    MODELS,
    SpeedupConfig,
    SpeedupResult,
    Timing,
    available_backends,
    is_two_four,
    to_markdown,
    two_four_masks,
)
from tsenor_cli.cli import app
from tsenor_cli.errors import TsenorError, UsageError


def test_model_shapes_are_the_llama_configs() -> None:
    # config.json: hidden_size, intermediate_size, num_key_value_heads × head_dim (8 × 64, 8 × 128).
    assert MODELS["llama-3.2-1b"].linears() == {
        "q_proj/o_proj": (2048, 2048),
        "k_proj/v_proj": (512, 2048),
        "gate_proj/up_proj": (8192, 2048),
        "down_proj": (2048, 8192),
    }
    assert MODELS["llama-3.1-8b"].linears() == {
        "q_proj/o_proj": (4096, 4096),
        "k_proj/v_proj": (1024, 4096),
        "gate_proj/up_proj": (14336, 4096),
        "down_proj": (4096, 14336),
    }
    # The CUTLASS bf16 kernels need both sides of the sparse operand in multiples of 64 (and of 32 rows).
    assert all(d % 64 == 0 for model in MODELS.values() for shape in model.linears().values() for d in shape)


def test_is_two_four_on_a_hand_made_mask() -> None:
    good = torch.tensor([[1, 0, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    assert is_two_four(good)
    assert not is_two_four(torch.tensor([[1, 1, 1, 0, 0, 1, 0, 0]], dtype=torch.bool))
    assert not is_two_four(torch.tensor([[1, 0, 0, 0, 0, 1, 1, 0]], dtype=torch.bool))


def test_transposable_mask_is_two_four_both_ways_and_ordinary_only_along_rows() -> None:
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    masks = two_four_masks(weight)
    ordinary, transposable = masks["ordinary"], masks["transposable"]
    assert is_two_four(ordinary) and is_two_four(transposable)
    assert is_two_four(transposable.t().contiguous())  # Wᵀ is 2:4: the input-gradient matmul can be sparse
    assert not is_two_four(ordinary.t().contiguous())  # the ordinary mask's transpose is not (random weights)
    # Ordinary 2:4 is the row-only optimum, a relaxation of the transposable one.
    kept = {name: float((weight.abs() * mask).sum()) for name, mask in masks.items()}
    assert kept["transposable"] <= kept["ordinary"] and kept["transposable"] > 0.9 * kept["ordinary"]


def _fake_result() -> SpeedupResult:
    layer, shape = "gate_proj/up_proj", (8192, 2048)

    def t(op: str, variant: str, backend: str, ms: float | None, error: str | None = None) -> Timing:
        rel = None if variant == "dense" or ms is None else 1e-3
        return Timing("llama-3.2-1b", layer, shape, 4096, op, variant, backend, ms, rel, error)

    timings = (
        t("Y=XWᵀ", "dense", "cublas", 2.0),
        t("dX=dY·W", "dense", "cublas", 2.2),
        t("dW=dYᵀX", "dense", "cublas", 2.4),
        t("Y=XWᵀ", "ordinary", "cutlass", 1.6),
        t("Y=XWᵀ", "transposable", "cutlass", 1.25),
        t("dX=dY·W", "transposable", "cutlass", 2.0),
        t("Y=XWᵀ", "ordinary", "cusparselt", None, "RuntimeError: cuSPARSELt not supported"),
        t("Y=XWᵀ", "transposable", "cusparselt", None, "RuntimeError: cuSPARSELt not supported"),
        t("dX=dY·W", "transposable", "cusparselt", None, "RuntimeError: cuSPARSELt not supported"),
    )
    config = {"models": ["llama-3.2-1b"], "backends": ["cutlass", "cusparselt"], "repeats": 30, "inner": 5}
    config["warmup"] = 10
    environment = {"torch": "2.13.0", "cuda": "12.8", "device": "NVIDIA H100", "compute_capability": "9.0"}
    return SpeedupResult(config, timings, environment | {"cusparselt": "no"}, "2025-01-01T00:00:00+00:00")


def test_markdown_shows_speedups_dense_only_ops_and_failures() -> None:
    text = to_markdown(_fake_result())
    rows = {line.split(" | ")[2]: line for line in text.splitlines() if line.startswith("| gate_proj")}
    # dense ms, ordinary (cutlass), transposable (cutlass), ordinary (cusparselt), transposable (cusparselt)
    assert rows["Y=XWᵀ"].endswith("| 2.000 ms | 1.25× | 1.60× | failed | failed |")
    assert rows["dX=dY·W"].endswith("| 2.200 ms | = dense | 1.10× | = dense | failed |")
    assert rows["dW=dYᵀX"].endswith("| 2.400 ms | = dense | = dense | = dense | = dense |")
    assert "NVIDIA H100" in text and "torch 2.13.0, CUDA 12.8" in text
    assert "M > 4 has no tensor-core path today" in text and "16:32" in text
    assert "cuSPARSELt not supported" in text.split("## Failed measurements")[1]
    assert "largest relative difference 1.00e-03" in text


def test_config_refuses_unknown_models_and_odd_token_counts() -> None:
    with pytest.raises(UsageError, match="unknown model shape"):
        SpeedupConfig(models=("gpt2",))
    with pytest.raises(UsageError, match="multiples of 64"):
        SpeedupConfig(tokens=(1000,))
    with pytest.raises(UsageError, match="backends"):
        SpeedupConfig(backends=("triton",))


def test_cli_on_a_cpu_says_it_needs_cuda_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    markdown = tmp_path / "speedup.md"
    result = CliRunner().invoke(app, ["bench", "speedup", "--quick", "--markdown", str(markdown)])
    assert isinstance(result.exception, TsenorError) and result.exception.exit_code == 2
    message = str(result.exception)
    assert "needs a CUDA GPU" in message and "\n" not in message
    assert not markdown.exists()


def test_timed_linear_has_the_gradients_of_f_linear() -> None:
    """The autograd function the MLP block is timed with computes dX = dY·W and dW = dYᵀ·X (dense here)."""
    from tsenor_cli.bench.speedup import _Linear

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    w = weight.detach()
    got = torch.autograd.grad(_Linear.apply(x, weight, lambda a: a @ w.t(), lambda g: g @ w), [x, weight], dy)
    want = torch.autograd.grad(torch.nn.functional.linear(x, weight), [x, weight], dy)
    assert all(torch.allclose(g, w) for g, w in zip(got, want, strict=True))


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], cusparselt: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.backends.cusparselt, "is_available", lambda: cusparselt)


def test_cutlass_is_skipped_off_compute_capability_8(monkeypatch: pytest.MonkeyPatch) -> None:
    """The H100 run (9.0) failed every CUTLASS row: torch's CUTLASS semi-structured kernels are for 8.x."""
    _fake_gpu(monkeypatch, (9, 0))
    assert available_backends(BACKENDS) == (("cusparselt", "cusparselt-direct"), {"cutlass": "not available on 9.0"})
    _fake_gpu(monkeypatch, (8, 6))
    assert available_backends(BACKENDS) == (BACKENDS, {})


def test_cusparselt_paths_are_skipped_without_the_library_or_the_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, (8, 0), cusparselt=False)
    runnable, why = available_backends(BACKENDS)
    assert runnable == ("cutlass",) and set(why) == {"cusparselt", "cusparselt-direct"}
    assert "no cuSPARSELt" in why["cusparselt"]
    _fake_gpu(monkeypatch, (9, 0))
    monkeypatch.delattr(torch, "_cslt_sparse_mm_search")
    runnable, why = available_backends(BACKENDS)
    assert runnable == ("cusparselt",)
    assert "lacks torch._cslt_*" in why["cusparselt-direct"] and why["cutlass"] == "not available on 9.0"


def test_direct_path_computes_the_linear_and_its_input_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct path's operands and transposes, with the cuSPARSELt ops replaced by their dense meaning
    (compress: the weight; sparse_mm(A, B): A·B, transposed with transpose_result; the search: algorithm 0)."""
    from tsenor_cli.bench.speedup import _operators
    from tsenor_cli.kernels import sparse

    searched = []

    def search(packed: torch.Tensor, dense: torch.Tensor, transpose_result: bool = False) -> int:
        searched.append((tuple(packed.shape), tuple(dense.shape)))
        return 0

    def sparse_mm(packed: torch.Tensor, dense: torch.Tensor, transpose_result: bool = False, alg_id: int = 0):
        product = packed @ dense
        return product.t() if transpose_result else product

    monkeypatch.setattr(sparse, "_ALGORITHMS", {})  # searched once a shape per process: none yet
    monkeypatch.setattr(torch, "_cslt_compress", lambda w: w.clone())
    monkeypatch.setattr(torch, "_cslt_sparse_mm_search", search)
    monkeypatch.setattr(torch, "_cslt_sparse_mm", sparse_mm)
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(8, 16, generator=gen, dtype=torch.float64)  # (out, in)
    pruned = weight * two_four_masks(weight)["transposable"]
    x, dy = (
        torch.randn(5, 16, generator=gen, dtype=torch.float64),
        torch.randn(5, 8, generator=gen, dtype=torch.float64),
    )
    forward, backward = _operators(pruned, "cusparselt-direct", True, x, dy)
    assert backward is not None
    torch.testing.assert_close(forward(x), torch.nn.functional.linear(x, pruned))
    torch.testing.assert_close(backward(dy), dy @ pruned)
    # Once per product, at setup, on the tokens padded as the kernels pad them (to a multiple of 8).
    assert searched == [((8, 16), (16, 8)), ((16, 8), (8, 8))]
    assert _operators(pruned, "cusparselt-direct", False, x, dy)[1] is None  # ordinary: dX stays dense


def test_markdown_says_why_a_backend_was_not_timed_and_shows_both_cusparselt_paths() -> None:
    base = _fake_result()
    direct = tuple(
        Timing(t.model, t.layer, t.shape, t.tokens, t.op, t.variant, "cusparselt-direct", t.ms * 2 / 5, 1e-4)
        for t in base.timings
        if t.backend == "cutlass"
    )
    config = base.config | {"backends": ["cutlass", "cusparselt", "cusparselt-direct"]}
    cusparselt = tuple(t for t in base.timings if t.backend != "cutlass")
    result = SpeedupResult(
        config, cusparselt + direct, base.environment, base.date, unavailable={"cutlass": "not available on 9.0"}
    )
    text = to_markdown(result)
    rows = {line.split(" | ")[2]: line for line in text.splitlines() if line.startswith("| gate_proj")}
    # columns: dense, cutlass ord/trans, cusparselt ord/trans, cusparselt-direct ord/trans
    assert rows["Y=XWᵀ"].endswith(
        "| 2.000 ms | not available on 9.0 | not available on 9.0 | failed | failed | 3.12× | 4.00× |"
    )
    assert rows["dX=dY·W"].endswith(
        "| 2.200 ms | = dense | not available on 9.0 | = dense | failed | = dense | 2.75× |"
    )
    assert "cutlass not timed: not available on 9.0." in text
    assert "torch._cslt_sparse_mm" in text and "F.linear(x, W_sparse)" in text

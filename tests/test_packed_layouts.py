"""Every pruned weight packed (docs/reference/packed-format.md, "Stacks and transposed parameters"): a fused
stack of experts (E, rows, cols), a GPT-2 Conv1D weight stored (in, out) and a stack kept in one 2-D
parameter round trip bit for bit, and a tiny MoE and a tiny GPT-2 pruned packed load through
AutoModelForCausalLM equal to their dense prunes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_tiny import make_tiny_llama, sparsegpt_config
from safetensors import safe_open

from tsenor_cli.errors import PackedFormatError
from tsenor_cli.models.checkpoint import Checkpoint
from tsenor_cli.packed.files import PATTERNS_KEY, record_patterns
from tsenor_cli.packed.layout import MatrixPattern, decode, encode, kept_mask, stored_mask
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.runfiles import DenseWeight, PrunedWeight, SparsityRecord
from tsenor_cli.settings import RunContext


def _transposable(rows: int, cols: int, n: int, m: int, seed: int) -> torch.Tensor:
    """A random bf16 (rows, cols) matrix keeping a shifted circulant mask: n per row and column of each tile."""
    generator = torch.Generator().manual_seed(seed)
    r, c = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    mask = ((c - r + seed) % m) < n
    weight = torch.randn(rows, cols, generator=generator).to(torch.bfloat16)
    return torch.where(mask, weight, torch.zeros((), dtype=weight.dtype))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


def test_a_stack_of_experts_packs_each_expert_and_round_trips() -> None:
    experts = torch.stack([_transposable(8, 12, 2, 4, seed) for seed in range(3)])  # (E, out, in)
    pattern = MatrixPattern.of("transposable", 2, 4, (8, 12), experts=3)
    values, code = encode(experts, pattern)
    assert tuple(values.shape) == (3, 8, 3, 2) and tuple(code.shape) == (3, 8, 2)
    # Expert e's values and code are exactly its own matrix's, packed alone.
    for e in range(3):
        alone = encode(experts[e], MatrixPattern.of("transposable", 2, 4, (8, 12)))
        assert torch.equal(_bits(values[e]), _bits(alone[0])) and torch.equal(code[e], alone[1])
    assert torch.equal(_bits(decode(values, code, pattern)), _bits(experts))
    assert torch.equal(kept_mask(code, pattern), experts != 0)


def test_a_conv1d_weight_is_packed_as_the_matrix_it_prunes() -> None:
    """A Conv1D stores (in, out); the pattern runs along the inputs of each output, i.e. on its transpose."""
    matrix = _transposable(8, 16, 2, 4, seed=1)  # (out, in) as pruned
    stored = matrix.T.contiguous()  # (in, out) as the parameter holds it
    pattern = MatrixPattern.of("nm", 2, 4, (8, 16), transposed=True)
    assert pattern.stored_shape() == (16, 8)
    values, code = encode(stored, pattern)
    plain = encode(matrix, MatrixPattern.of("nm", 2, 4, (8, 16)))
    assert torch.equal(_bits(values), _bits(plain[0])) and torch.equal(code, plain[1])
    assert torch.equal(_bits(decode(values, code, pattern)), _bits(stored))
    assert torch.equal(stored_mask(code, pattern), matrix != 0)
    with pytest.raises(PackedFormatError, match="record's shape"):
        encode(matrix, pattern)  # the (out, in) layout is not what the record describes


@pytest.mark.parametrize(("kind", "n", "m"), [("unstructured", 0, 0), ("nm", 16, 32)])
def test_a_transposed_stack_of_every_kind_round_trips(kind: str, n: int, m: int) -> None:
    """Stored (E, in, out); unstructured values are every expert's kept entries in row-major order as pruned."""
    generator = torch.Generator().manual_seed(3)
    matrices = torch.randn(2, 4, 64, generator=generator)  # (E, out, in) as pruned
    if kind == "unstructured":
        matrices = matrices.masked_fill(torch.rand(2, 4, 64, generator=generator) < 0.5, 0.0)
    else:
        top = matrices.abs().view(2, 4, 2, 32).topk(n, -1).indices
        keep = torch.zeros(2, 4, 2, 32, dtype=torch.bool).scatter_(-1, top, True).view(2, 4, 64)
        matrices = matrices.masked_fill(~keep, 0.0)
    stored = matrices.transpose(1, 2).contiguous()
    pattern = MatrixPattern.of(kind, n, m, (4, 64), experts=2, transposed=True)
    values, code = encode(stored, pattern)
    if kind == "unstructured":
        assert torch.equal(values, matrices[matrices != 0])
    assert torch.equal(decode(values, code, pattern).view(torch.int32), stored.view(torch.int32))
    assert torch.equal(kept_mask(code, pattern), matrices != 0)


def test_a_stack_kept_in_one_2d_parameter_is_one_matrix_of_all_rows() -> None:
    """DBRX views an (E·out, in) parameter per expert: the record of its experts fits it as one matrix."""
    flat = torch.cat([_transposable(8, 12, 2, 4, seed) for seed in range(2)])
    pattern = MatrixPattern.of("transposable", 2, 4, (8, 12), experts=2).fitted(tuple(flat.shape))
    assert (pattern.rows, pattern.experts) == (16, 0)
    values, code = encode(flat, pattern)
    assert torch.equal(_bits(decode(values, code, pattern)), _bits(flat))
    with pytest.raises(PackedFormatError, match="record's shape"):
        MatrixPattern.of("nm", 2, 4, (8, 12), experts=2).fitted((8, 24))


def _record(pruned: list[tuple[str, int | None, bool]], dense: list[str]) -> SparsityRecord:
    """A sparsity record of transposable 2:4 pruned (param, expert, transposed) entries of (8, 12) matrices."""
    weights = tuple(
        PrunedWeight(param if expert is None else f"{param}[{expert}]", param, expert, transposed, (8, 12))
        for param, expert, transposed in pruned
    )
    return SparsityRecord(
        "magnitude",
        SparsityPattern.from_nm(2, 4, transposable=True),
        None,
        None,
        weights,
        tuple(DenseWeight(name, "skipped", "no tokens") for name in dense),
        None,
    )


def test_a_stack_is_packed_only_when_every_expert_was_pruned() -> None:
    stack = "model.layers.0.mlp.experts.gate_up_proj"
    whole = record_patterns(
        _record([(stack, e, False) for e in range(4)] + [("h.0.attn.c_attn.weight", None, True)], [])
    )
    assert whole[stack] == MatrixPattern.of("transposable", 2, 4, (8, 12), experts=4)
    assert whole["h.0.attn.c_attn.weight"].transposed and whole["h.0.attn.c_attn.weight"].stored_shape() == (12, 8)
    # Expert 3 left dense (no calibration token reached it): the stack follows no pattern, it stays dense.
    partial = record_patterns(_record([(stack, e, False) for e in range(3)], [f"{stack}[3]"]))
    assert stack not in partial


MODELS = {
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt2": {"model_type": "gpt2"},
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def pruned(
    request: pytest.FixtureRequest, calib: Path, data_ctx: RunContext, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """A tiny MoE or GPT-2 pruned by magnitude (every expert pruned: no routing decides), dense and packed."""
    root = tmp_path_factory.mktemp(request.param)
    model = make_tiny_llama(root / "src", **MODELS[request.param])
    outs = {fmt: root / fmt for fmt in ("dense", "packed")}
    for fmt, out in outs.items():
        cfg = sparsegpt_config(model, calib, out, resume=False, save_format=fmt, method="magnitude")
        prune_model(cfg, data_ctx)
    return outs


def test_every_pruned_weight_is_packed_and_decodes_to_the_dense_prune(pruned: dict[str, Path]) -> None:
    from tsenor_cli.runfiles import read_sparsity

    sparsity = read_sparsity(pruned["packed"])
    assert sparsity is not None
    params = {entry.param for entry in sparsity.pruned}
    assert any(e.expert is not None for e in sparsity.pruned) or any(e.transposed for e in sparsity.pruned)
    with safe_open(str(pruned["packed"] / "model.safetensors"), framework="pt") as handle:
        packed = set(__import__("json").loads(handle.metadata()[PATTERNS_KEY]))
    assert packed == params  # every pruned parameter, stacks and Conv1D included
    dense, decoded = Checkpoint.open(pruned["dense"]), Checkpoint.open(pruned["packed"])
    assert dense.keys() == decoded.keys()
    for key, tensor in dense.iter_read(dense.keys()):
        other = decoded.read([key])[key]
        assert other.dtype == tensor.dtype and torch.equal(other.view(torch.uint8), tensor.view(torch.uint8)), key


def test_verify_checks_packed_stacks_and_conv1d_from_their_code(
    pruned: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each expert's and each Conv1D's tiles are counted from the stored code, as the dense prune's weights."""
    from tsenor_cli.pruning.run.verify import verify_checkpoint

    dense = verify_checkpoint(pruned["dense"])

    def no_decoding(*args: object, **kwargs: object) -> None:
        raise AssertionError("verify decoded a packed matrix")

    monkeypatch.setattr("tsenor_cli.models.checkpoint.decode_matrix", no_decoding)
    report = verify_checkpoint(pruned["packed"])
    assert report.ok and dense.ok and report.layers
    # `under` may differ: a stored mask keeps exactly N where a kept weight is exactly zero.
    assert [(c.name, c.shape, c.groups, c.over) for c in report.layers] == [
        (c.name, c.shape, c.groups, c.over) for c in dense.layers
    ]


def test_auto_model_loads_the_packed_stack_or_conv1d_as_the_dense_prune(pruned: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    import tsenor_cli  # noqa: F401  # registers the packed format

    model, info = AutoModelForCausalLM.from_pretrained(pruned["packed"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    dense = AutoModelForCausalLM.from_pretrained(pruned["dense"]).state_dict()
    loaded = model.state_dict()
    assert loaded.keys() == dense.keys()
    assert all(torch.equal(loaded[k].view(torch.uint8), dense[k].view(torch.uint8)) for k in dense)


@pytest.fixture(scope="module", params=["llava", "mllama"])
def multimodal(
    request: pytest.FixtureRequest, calib: Path, data_ctx: RunContext, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """A tiny vision-language model (Mllama's checkpoint keys are renamed by transformers on load) pruned
    dense and packed."""
    from helpers_tiny import make_tiny_model

    root = tmp_path_factory.mktemp(request.param)
    model = make_tiny_model(root / "src", request.param)
    outs = {fmt: root / fmt for fmt in ("dense", "packed")}
    for fmt, out in outs.items():
        cfg = sparsegpt_config(model, calib, out, resume=False, save_format=fmt, method="magnitude")
        prune_model(cfg, data_ctx)
    return outs


def test_a_packed_vision_language_model_loads_through_its_own_class(multimodal: dict[str, Path]) -> None:
    """The source's class (AutoModelForImageTextToText) and tsenor_cli.load find every key, equal to the dense
    output's tensors."""
    from transformers import AutoModelForImageTextToText

    import tsenor_cli

    model, info = AutoModelForImageTextToText.from_pretrained(multimodal["packed"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    dense = AutoModelForImageTextToText.from_pretrained(multimodal["dense"]).state_dict()
    for loaded in (model.state_dict(), tsenor_cli.load(multimodal["packed"]).state_dict()):
        assert loaded.keys() == dense.keys()
        assert all(torch.equal(loaded[k].view(torch.uint8), dense[k].view(torch.uint8)) for k in dense)


def test_pack_of_a_folder_in_its_source_layout_equals_the_packed_prune(
    multimodal: dict[str, Path], tmp_path: Path
) -> None:
    """`tsenor pack` of the dense output (written under the source checkpoint's keys, which transformers
    renames on load for Mllama) packs the same matrices as the packed prune: equal decoded tensors, and
    the same file bytes (a shard's data lie in safetensors' order, not in the order they came)."""
    from tsenor_cli.pruning.run.packing import pack_folder

    out = pack_folder(multimodal["dense"], tmp_path / "packed")
    made, pruned = Checkpoint.open(out), Checkpoint.open(multimodal["packed"])
    assert {k: i.pattern for k, i in made.tensors.items()} == {k: i.pattern for k, i in pruned.tensors.items()}
    for key, tensor in pruned.iter_read(pruned.keys()):
        assert torch.equal(made.read([key])[key].view(torch.uint8), tensor.view(torch.uint8)), key
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == sorted(p.name for p in multimodal["packed"].glob("*.safetensors"))
    assert all((out / name).read_bytes() == (multimodal["packed"] / name).read_bytes() for name in files)

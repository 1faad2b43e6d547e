"""Mixtures of experts on tiny random models built offline from transformers configs.

Per family: the weight watch (`pruning/block/observe.py`) finds every expert stack with the orientation its
forward uses and the router; the block replay reproduces the model's logits; a 2-block SparseGPT 2:4
prune leaves every expert of every stack at density 0.5 and the routers/gates dense, `verify` passes
through the checkpoint's own keys (transformers 5 writes fused experts back as per-expert keys), the
output loads with AutoModelForCausalLM and generates. Then the statistics themselves: routed rows go to
the expert they were routed to (against a hand-computed reference), and routed statistics reconstruct
a block whose experts see different token distributions better than magnitude pruning. Block refinement
(`--refine block`) trains fused expert stacks with their masks held exactly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import blockwise_forward, full_forward, make_tiny_llama, random_causal_lm

from tsenor_cli.models.structure import discover_structure
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block.gather import MoeOptions, StackInputs, unit_input_stats
from tsenor_cli.pruning.block.observe import Geometry, matrices, observe_block
from tsenor_cli.pruning.methods.method_options import ALPSOptions
from tsenor_cli.pruning.methods.stats import ExpertStats, RowBuffer
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.run.verify import verify_checkpoint
from tsenor_cli.pruning.settings.config import PruneConfig, RefineConfig
from tsenor_cli.replay import block_output, capture_block_inputs, input_key, run_block
from tsenor_cli.runfiles import read_sparsity
from tsenor_cli.settings import RunContext

# model_type → config overrides for 4 experts, top-2 (Llama-4: top-1, every token through every expert).
MOE: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "glm4_moe": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 0,
        "n_group": 1,
        "topk_group": 1,
        "head_dim": 16,
    },
    "llama4_text": {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 64, "head_dim": 16},
    # Multi-head latent attention (low-rank q and kv projections, a rotary and a plain part of each head),
    # a shared expert, grouped top-k routing; block 0 is dense (first_k_dense_replace), block 1 a MoE.
    "deepseek_v3": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    },
    # Experts as three plain 2D parameters (E·I, H) viewed per expert, w2 read transposed; an nn.Linear
    # router. transformers 5.24's DBRX needs d_model (its ffn_config copies it), rope_theta in attn_config
    # and a clip_qkv (None fails in its clamp), as the published checkpoints have.
    "dbrx": {
        "d_model": 64,
        "tie_word_embeddings": False,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # Block 0: gated delta-rule linear attention (a depthwise conv1d beside its projections); block 1:
    # full attention; both a MoE with a shared expert scaled by a 1×hidden shared_expert_gate.
    "qwen3_next": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    },
}
# The stacks each family's experts are stored in, and whether stored (in, out): seen in their forward.
TRANSPOSED = {"gpt_oss": True, "llama4_text": True}
# Expert stacks per MoE block (2: gate_up and down fused as transformers 5 does) and the mixed-orientation
# families: DBRX keeps w1, v1 (read (out, in)) and w2 (read transposed) apart.
STACKS = {"dbrx": 3}
MIXED_ORIENTATION = {"dbrx": {"ffn.experts.mlp.w1": False, "ffn.experts.mlp.v1": False, "ffn.experts.mlp.w2": True}}
# The blocks without experts (DeepSeek-V3's first_k_dense_replace).
DENSE_BLOCKS = {"deepseek_v3": 1}
# Gates (one output per token) beside the router: Qwen2-MoE's and Qwen3-Next's shared_expert_gate.
GATES = {"qwen2_moe": 1, "qwen3_next": 1}
SEQ_LEN = 24


def _ids(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def _first_moe_block(family: str, ids: torch.Tensor) -> tuple[Any, Any, Any, torch.Tensor]:
    """(model, its first MoE block, that block's call, its input (S, T, H)): the dense output of the
    blocks before it."""
    model = random_causal_lm(family, **MOE[family])
    structure = discover_structure(model)
    inputs = capture_block_inputs(structure, ids, torch.device("cpu"))
    index = DENSE_BLOCKS.get(family, 0)
    hidden = inputs.hidden
    for before in range(index):
        out = torch.empty_like(hidden)
        run_block(structure.blocks[before], hidden, inputs.calls[before], out)
        hidden = out
    return model, structure.blocks[index], inputs.calls[index], hidden


@pytest.mark.parametrize("family", sorted(MOE))
def test_watch_finds_expert_stacks_their_orientation_and_the_router(family: str) -> None:
    model, block, call, hidden = _first_moe_block(family, _ids(1, 0))
    seen = observe_block(block, lambda: block_output(block, call, hidden), input_key=input_key)
    stacks = {name: unit for name, unit in seen.units.items() if unit.geometry.experts}
    assert len(stacks) == STACKS.get(family, 2) and all(unit.geometry.experts == 4 for unit in stacks.values())
    orientation = {name: unit.geometry.transposed for name, unit in stacks.items()}
    assert orientation == MIXED_ORIENTATION.get(family, dict.fromkeys(stacks, TRANSPOSED.get(family, False)))
    # The (out, in) of each stack as nn.Linear would hold it: the first reads the hidden states, the
    # last writes them; gate and up are fused in one stack or stored as two.
    *up, down = stacks.values()
    assert all(unit.geometry.in_features == model.config.hidden_size for unit in up)
    assert down.geometry.out_features == model.config.hidden_size
    assert sum(unit.geometry.out_features for unit in up) == 2 * down.geometry.in_features
    routers = [unit for unit in seen.units.values() if unit.role == "router"]
    assert len(routers) == 1 and routers[0].geometry.out_features == 4
    gates = [unit for unit in seen.units.values() if unit.role == "gate"]
    assert len(gates) == GATES.get(family, 0) and all(unit.geometry.out_features == 1 for unit in gates)
    for name, unit in seen.units.items():
        param = block.get_parameter(name)
        assert matrices(param.data, unit.geometry).shape[0] == unit.geometry.count


@pytest.mark.parametrize("family", sorted(MOE))
def test_blockwise_replay_reproduces_the_moe_model(family: str) -> None:
    model = random_causal_lm(family, **MOE[family])
    ids = _ids(2, seed=1)
    expected_hidden, expected_logits = full_forward(model, ids)
    hidden, logits = blockwise_forward(model, ids)
    torch.testing.assert_close(hidden, expected_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)


def _sparsegpt_2_4(source: Path, output: Path, **changes: Any) -> PruneConfig:
    """SparseGPT transposable 2:4 of `source` on 4 × 64 C4 tokens into `output`, with `changes` on top."""
    return PruneConfig(
        model=str(source),
        matrix=MatrixPruneConfig(pattern=SparsityPattern.from_nm(2, 4, transposable=True)),
        method="sparsegpt",
        nsamples=4,
        seqlen=64,
        output=output,
        **changes,
    )


@pytest.fixture(scope="module")
def calib_ctx(data_ctx: RunContext) -> RunContext:
    return data_ctx


@pytest.mark.slow
@pytest.mark.realdata
@pytest.mark.parametrize("family", sorted(MOE))
def test_sparsegpt_2_4_prunes_every_expert_keeps_routers_dense_and_verifies(
    family: str, tmp_path: Path, calib_ctx: RunContext
) -> None:
    from transformers import AutoModelForCausalLM

    source = make_tiny_llama(tmp_path / "src", model_type=family, **MOE[family])
    out = tmp_path / "out"
    report = prune_model(_sparsegpt_2_4(source, out), calib_ctx)
    moe_blocks = 2 - DENSE_BLOCKS.get(family, 0)
    experts = [r for r in report.layers if r.expert is not None]
    # Every expert of every stack of every MoE block, each a matrix of its own.
    assert len(experts) == moe_blocks * STACKS.get(family, 2) * 4
    assert all(r.status == "pruned" and r.density == 0.5 for r in experts)
    routers = [r for r in report.layers if r.reason and r.reason.startswith("router")]
    assert len(routers) == moe_blocks and all(r.status == "ignored" for r in routers)
    gates = [r for r in report.layers if r.reason and r.reason.startswith("gate")]
    assert len(gates) == moe_blocks * GATES.get(family, 0) and all(r.status == "ignored" for r in gates)
    # Every decoder weight matrix is accounted for: pruned or left dense with a reason.
    assert all(r.status == "pruned" or r.reason for r in report.layers)
    verified = verify_checkpoint(out)
    assert verified.ok and len(verified.layers) == len(report.pruned)
    # The saved decoder weights (routers, gates, norms, biases aside) are half zero.
    loaded = AutoModelForCausalLM.from_pretrained(out)
    kept = dense = 0
    for record in report.pruned:
        weight = loaded.get_parameter(record.param)
        if record.expert is not None:
            weight = matrices(weight.data, _geometry(record))[record.expert]
        kept += int(torch.count_nonzero(weight))
        dense += weight.numel()
    assert kept / dense == pytest.approx(0.5, abs=0.03)
    record = read_sparsity(out)
    assert record is not None and len(record.pruned) == len(report.pruned)
    generated = loaded.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 6)


def _geometry(record: Any) -> Geometry:
    return Geometry(4, record.out_features, record.in_features, record.transposed)


def test_routed_rows_go_to_their_expert() -> None:
    """ExpertStats against hand-computed per-expert sums: rows of two experts interleaved, one absent."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 3, generator=gen)
    ids = torch.tensor([2, 0, 2, 2, 0, 3, 0])
    stats = ExpertStats(4, 3, gram=True, device="cpu")
    stats.add(rows[:4], ids[:4])
    stats.add(rows[4:], ids[4:])
    for expert in range(4):
        mine = rows[ids == expert]
        torch.testing.assert_close(stats.gram[expert], mine.T @ mine)  # type: ignore[index]
        torch.testing.assert_close(stats.sq_norms[expert], mine.square().sum(0))
        assert int(stats.tokens[expert]) == mine.shape[0]
    assert int(stats.tokens[1]) == 0


@pytest.mark.parametrize("zero_rows", [True, False])
def test_expert_sums_batched_in_buckets_equal_each_experts_own(zero_rows: bool) -> None:
    """`ExpertStats.add_pieces` pads experts in buckets of similar row counts: with counts from 0 to 40
    over 9 experts (one absent), three pieces and two all-zero rows, every expert's sums equal its own
    rows' XᵀX in float64; tokens count the zero rows only when not `zero_rows`."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.repeat_interleave(torch.arange(9), torch.tensor([3, 0, 40, 1, 7, 25, 2, 12, 5]))
    ids = ids[torch.randperm(ids.numel(), generator=gen)]  # (95,) interleaved
    rows = torch.randn(ids.numel(), 6, generator=gen)
    rows[[4, 50]] = 0
    stats = ExpertStats(9, 6, gram=True, device="cpu", zero_rows=zero_rows)
    stats.add_pieces([rows[:30], rows[30:31], rows[31:]], [ids[:30], ids[30:31], ids[31:]])
    for expert in range(9):
        mine = rows[ids == expert].double()
        torch.testing.assert_close(stats.require_gram()[expert].double(), mine.T @ mine, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stats.sq_norms[expert].double(), mine.square().sum(0), rtol=1e-5, atol=1e-5)
        kept = mine.shape[0] - int((mine == 0).all(1).sum()) if zero_rows else mine.shape[0]
        assert int(stats.tokens[expert]) == kept


def test_row_buffer_adds_what_the_calls_add() -> None:
    """A `RowBuffer` whose budget is reached twice in five calls ends with the sums of five `add` calls."""
    gen = torch.Generator().manual_seed(6)
    direct, buffered = ExpertStats(4, 3, gram=True, device="cpu"), ExpertStats(4, 3, gram=True, device="cpu")
    buffer = RowBuffer(buffered, budget=3 * 9)
    for _ in range(5):
        rows, ids = torch.randn(5, 3, generator=gen), torch.randint(0, 4, (5,), generator=gen)
        direct.add(rows, ids)
        buffer.add(rows, ids)
    assert buffer.flush() is buffered
    torch.testing.assert_close(buffered.require_gram(), direct.require_gram())
    torch.testing.assert_close(buffered.sq_norms, direct.sq_norms)
    assert buffered.tokens.tolist() == direct.tokens.tolist()


@pytest.mark.parametrize("family", sorted(MOE))
def test_statistics_watched_in_scope_equal_the_whole_blocks_watch(family: str) -> None:
    """Each unit's scope is a module holding it, and the statistics watched only inside the scopes equal
    those of a watch over the whole block, every-token ones (--moe-calibration all) included."""
    _, block, call, hidden = _first_moe_block(family, _ids(2, 4))
    seen = observe_block(block, lambda: block_output(block, call, hidden[:1]), input_key=input_key)
    units = {name: unit for name, unit in seen.units.items() if unit.geometry.experts}
    assert all(unit.scope is not None and name.startswith(unit.scope + ".") for name, unit in units.items())
    whole = {name: dataclasses.replace(unit, scope=None) for name, unit in units.items()}
    moe = MoeOptions(calibration="all")
    scoped = unit_input_stats(block, units, hidden, call, moe)
    reference = unit_input_stats(block, whole, hidden, call, moe)
    for name in units:
        got, want = scoped[name], reference[name]
        assert isinstance(got, StackInputs) and isinstance(want, StackInputs)
        # Llama-4's experts see every token already: nothing falls back, no every-token pass.
        assert got.fallback == want.fallback == (frozenset(range(4)) if units[name].routing else frozenset())
        torch.testing.assert_close(got.routed.require_gram(), want.routed.require_gram(), rtol=0, atol=0)
        assert got.routed.tokens.tolist() == want.routed.tokens.tolist()
        assert (got.every is None) == (want.every is None) == (units[name].routing is None)
        if got.every is not None and want.every is not None:
            torch.testing.assert_close(got.every.require_gram(), want.every.require_gram(), rtol=0, atol=0)


def test_every_token_statistics_count_each_token_once() -> None:
    """Under --moe-calibration all, every expert of Qwen3-MoE's first stack gets XᵀX of every token that
    reached the experts, once: one every-token pass per routing module serves both of its stacks."""
    model = random_causal_lm("qwen3_moe", **MOE["qwen3_moe"])
    structure = discover_structure(model)
    inputs = capture_block_inputs(structure, _ids(2, 7), torch.device("cpu"))
    block, call = structure.blocks[0], inputs.calls[0]
    seen = observe_block(block, lambda: block_output(block, call, inputs.hidden[:1]), input_key=input_key)
    units = {name: unit for name, unit in seen.units.items() if unit.geometry.experts}
    first = next(iter(units))
    tokens: list[torch.Tensor] = []
    experts = block.get_submodule(cast(str, units[first].routing))
    handle = experts.register_forward_pre_hook(lambda _m, args: tokens.append(args[0].reshape(-1, 64)))
    try:
        stats = unit_input_stats(block, units, inputs.hidden, call, MoeOptions(calibration="all"))
    finally:
        handle.remove()
    routed_calls = tokens[: inputs.hidden.shape[0]]  # the routed forward's calls; the every-token re-calls follow
    x = torch.cat(routed_calls).double()
    every = cast(StackInputs, stats[first]).every
    assert every is not None
    for expert in range(4):
        torch.testing.assert_close(every.require_gram()[expert].double(), x.T @ x, rtol=1e-5, atol=1e-5)


def test_routed_statistics_equal_each_experts_own_inputs() -> None:
    """The watch's routed statistics of Mixtral's first expert stack equal the Gram matrices of the
    tokens its router picked, computed by hand from the router's own top-k."""
    model = random_causal_lm("mixtral", **MOE["mixtral"])
    structure = discover_structure(model)
    inputs = capture_block_inputs(structure, _ids(2, 3), torch.device("cpu"))
    block, call = structure.blocks[0], inputs.calls[0]
    seen = observe_block(block, lambda: block_output(block, call, inputs.hidden[:1]), input_key=input_key)
    name = next(n for n, u in seen.units.items() if u.geometry.experts)
    expected = torch.zeros(4, 64, 64)
    moe_inputs: list[torch.Tensor] = []
    mlp = block.get_submodule(name.rsplit(".", 2)[0])  # the module holding the router and the experts
    handle = mlp.register_forward_pre_hook(lambda _m, args: moe_inputs.append(args[0].reshape(-1, 64)))
    try:
        stats = unit_input_stats(block, {name: seen.units[name]}, inputs.hidden, call, MoeOptions(min_tokens=1))
    finally:
        handle.remove()
    router = next(u for u in seen.units.values() if u.role == "router")
    weight = block.get_parameter(router.param)
    for x in moe_inputs:
        chosen = torch.topk(x @ weight.T, 2, dim=-1).indices  # (T, 2)
        for expert in range(4):
            mine = x[(chosen == expert).any(-1)]
            expected[expert] += mine.T @ mine
    routed = stats[name]
    assert not isinstance(routed, torch.Tensor) and hasattr(routed, "routed")
    torch.testing.assert_close(routed.routed.gram, expected, rtol=1e-4, atol=1e-4)  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.realdata
def test_routed_statistics_reconstruct_a_moe_block_better_than_magnitude(tmp_path: Path, calib_ctx: RunContext) -> None:
    """On a one-block Mixtral whose experts see different tokens (the router picks by hidden state),
    SparseGPT on each expert's routed statistics gives a block output closer to the dense block's than
    magnitude pruning does, on text the calibration did not see."""
    from transformers import AutoModelForCausalLM

    source = make_tiny_llama(tmp_path / "src", model_type="mixtral", num_layers=1, **MOE["mixtral"])
    ids = torch.randint(3, 49152, (2, 48), generator=torch.Generator().manual_seed(7))
    dense, _ = full_forward(AutoModelForCausalLM.from_pretrained(source).eval(), ids)
    errors = {}
    for method in ("magnitude", "sparsegpt"):
        cfg = PruneConfig(
            model=str(source),
            matrix=MatrixPruneConfig(pattern=SparsityPattern.from_nm(2, 4, transposable=True)),
            method=method,
            nsamples=8,
            seqlen=64,
            output=tmp_path / method,
        )
        prune_model(cfg, calib_ctx)
        pruned, _ = full_forward(AutoModelForCausalLM.from_pretrained(tmp_path / method).eval(), ids)
        errors[method] = float((pruned - dense).square().sum() / dense.square().sum())
    assert errors["sparsegpt"] < errors["magnitude"]


@pytest.mark.slow
@pytest.mark.realdata
@pytest.mark.parametrize("method", ["sparsegpt", "alps"])
def test_experts_pruned_in_chunks_equal_one_by_one(
    method: str, tmp_path: Path, calib_ctx: RunContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The experts of a stack go to the method in batched chunks (`memory.expert_chunk`); a budget that
    allows one expert per chunk gives the same checkpoint (masks equal, weights to round-off) and the
    same per-expert records, so batching changes the speed only."""
    from safetensors.torch import load_file

    from tsenor_cli.pruning.block import memory
    from tsenor_cli.pruning.methods.registry import get_pruner
    from tsenor_cli.runfiles import PRUNE_FILE, PruneReport, read_json

    source = make_tiny_llama(tmp_path / "src", model_type="mixtral", num_layers=1, **MOE["mixtral"])
    assert memory.expert_chunk(128, 64, get_pruner(method)) >= 4  # the default: Mixtral's 4 experts in one call
    outputs = {}
    for label, budget in (("batched", memory.EXPERT_BATCH_BYTES), ("single", 1)):
        monkeypatch.setattr(memory, "EXPERT_BATCH_BYTES", budget)
        cfg = PruneConfig(
            model=str(source),
            matrix=MatrixPruneConfig(
                SparsityPattern.from_nm(2, 4, transposable=True),
                options=ALPSOptions(max_iter=40) if method == "alps" else None,
            ),
            method=method,
            nsamples=4,
            seqlen=32,
            output=tmp_path / label,
        )
        prune_model(cfg, calib_ctx)
        outputs[label] = tmp_path / label
    batched, single = (load_file(outputs[k] / "model.safetensors") for k in ("batched", "single"))
    assert batched.keys() == single.keys()
    for key in batched:
        assert torch.equal(batched[key] != 0, single[key] != 0), key
        torch.testing.assert_close(batched[key], single[key], rtol=1e-4, atol=1e-5)
    reports = {k: PruneReport.from_json(read_json(outputs[k] / PRUNE_FILE)) for k in outputs}
    records = {k: [(r.name, r.tokens, r.reason, r.iterations) for r in reports[k].layers] for k in outputs}
    assert records["batched"] == records["single"]
    assert any(name.endswith("[3]") for name, *_ in records["batched"])


@pytest.mark.slow
@pytest.mark.realdata
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_refinement_trains_fused_experts_with_their_masks_held(
    family: str, tmp_path: Path, calib_ctx: RunContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--refine block` on fused expert stacks (3D parameters; gpt-oss's with biases; DeepSeek-V3's dense
    block 0 and latent attention): every MoE block's stacks are among the masks held, each refined
    parameter's zeros are exactly its mask afterwards, the experts' kept weights trained, no block got
    worse, and `verify` passes."""
    from tsenor_cli.pruning.block import refine

    original = refine.refine_block
    held: list[dict[str, torch.Tensor]] = []
    trained: list[bool] = []

    def watched(job: Any) -> Any:
        block, masks = job.block, job.masks
        before = {name: block.get_parameter(name).detach().clone() for name in masks}
        record = original(job)
        for name, mask in masks.items():
            after = block.get_parameter(name).detach()
            assert torch.equal(after == 0, mask), name
        held.append({name: mask for name, mask in masks.items() if mask.dim() == 3})
        trained.append(record.kept and any(not torch.equal(before[n], block.get_parameter(n)) for n in held[-1]))
        return record

    monkeypatch.setattr(refine, "refine_block", watched)
    source = make_tiny_llama(tmp_path / "src", model_type=family, **MOE[family])
    cfg = _sparsegpt_2_4(source, tmp_path / "out", refine=RefineConfig("block", 2, 1e-3))
    report = prune_model(cfg, calib_ctx)
    assert [b.block for b in report.refinement] == [0, 1]
    assert all(b.error_after < b.error_before if b.kept else b.error_after >= b.error_before for b in report.refinement)
    moe_blocks = 2 - DENSE_BLOCKS.get(family, 0)
    assert sum(bool(stacks) for stacks in held) == moe_blocks  # the 3D expert stacks were held
    assert any(trained)  # and some trained: the check above is not about untouched weights
    assert verify_checkpoint(tmp_path / "out").ok


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--moe-calibration", "every"], "unknown --moe-calibration 'every'; choose one of: routed, all"),
        (["--moe-min-tokens", "0"], "--moe-min-tokens"),
    ],
)
def test_bad_moe_options_are_one_line_exit_2_and_write_nothing(
    flags: list[str], needle: str, tiny: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = invoke(["prune", "--model", str(tiny), "--nm", "2:4", *flags, "--output", str(out)])
    assert result.exit_code == 2
    # typer's range check prints its line; tsenor's own errors are printed by `main` from the exception
    assert needle in result.output + str(result.exception)
    assert not out.exists()


def test_a_stacks_workspace_is_one_chunk_of_experts() -> None:
    """The plan's workspace for a 256-expert stack at DeepSeek-V3's width (2048 × 7168) is one chunk's
    buffers and statistics, not 256 experts' (which would be 256 × 0.6 GB for ALPS), and a stack no
    bigger than a chunk counts every expert."""
    from tsenor_cli.pruning.block.memory import EXPERT_BATCH_BYTES, MethodCost, matrix_workspace, slot_workspace
    from tsenor_cli.pruning.block.slots import LinearSlot
    from tsenor_cli.pruning.methods.registry import get_pruner

    def slot(experts: int, out: int, inp: int) -> LinearSlot:
        return LinearSlot(1, "mlp.experts.down_proj", "model.layers.1.mlp.experts.down_proj", out, inp, experts=experts)

    alps, sparsegpt = MethodCost(get_pruner("alps")), MethodCost(get_pruner("sparsegpt"))
    each = matrix_workspace(2048, 7168, alps)
    big = slot_workspace(slot(256, 2048, 7168), alps)
    chunk = max(1, EXPERT_BATCH_BYTES // each)
    assert big == chunk * (each + 4 * (7168**2 + 7168)) and chunk < 256
    small = slot_workspace(slot(4, 64, 32), sparsegpt)
    assert small == 4 * (matrix_workspace(64, 32, sparsegpt) + 4 * (32**2 + 32))

"""`--loss-aware λ` (pruning/methods/loss_aware.py, pruning/block/curvature.py): the row weights around every
method, the curvature against the model's own gradient, and whole runs (weight 0, streamed against whole,
resumed after a kill; two processes are in tests/test_distributed.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_cli import invoke
from helpers_faults import Killed
from helpers_tiny import LOCAL_CTX, sparsegpt_config
from torch import nn

from tsenor_cli.models.loading import load_model
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block.curvature import CalibrationBatch, loss_curvature
from tsenor_cli.pruning.block.distributed import Team
from tsenor_cli.pruning.block.slots import linear_slots
from tsenor_cli.pruning.methods.loss_aware import prune_weighted, row_weights
from tsenor_cli.pruning.methods.registry import PRUNERS
from tsenor_cli.pruning.methods.stats import InputStats
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.replay import BlockSource, capture_block_inputs
from tsenor_cli.runfiles import PRUNE_FILE
from tsenor_cli.settings import RunContext

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tiny_llama: Callable[..., Path]) -> Path:
    return tiny_llama(num_layers=3)


def _sha(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


# ---------------------------------------------------------------- the wrapper


@pytest.mark.parametrize("method", sorted(PRUNERS))
def test_row_weights_of_one_leave_every_method_bit_for_bit(method: str, device: torch.device) -> None:
    """D = I: the scaled problem is the plain one, and unscaling costs nothing (sqrt(1) = 1)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 32, generator=gen).to(device)
    stats = InputStats.from_inputs(torch.randn(64, 32, generator=gen).to(device))
    cfg = MatrixPruneConfig(SparsityPattern.from_nm(4, 8, transposable=True))
    spec = PRUNERS[method]
    plain = spec.prune_batch(weight.clone(), stats, cfg)[0]
    ones = torch.ones(16, device=device)
    weighted = prune_weighted(spec, weight.clone(), stats, cfg, ones)[0]
    assert torch.equal(plain.mask, weighted.mask)
    assert torch.equal(plain.weight, weighted.weight)
    assert weighted.weight.device == weight.device and weighted.weight.dtype == weight.dtype


def test_row_weights_give_the_transposable_tile_to_the_high_curvature_row() -> None:
    """One 4×4 tile at transposable 2:4 (every row and column keeps 2). Rows 0-2 all prefer columns 0-1,
    which hold only 2 entries each; row 3 prefers columns 2-3. Magnitude, by hand (|w| sums, the same
    order with squares):
    plain: rows 0 and 1 keep their large pair (2.1·2 + 2·2), row 2 its small one (1 + 1), row 3 its pair:
    14.2 against 14.0 for rows 0 and 2 large;
    row 2's curvature 4× the others' (D = diag(1, 1, 4, 1), its |w| doubled): rows 0 and 2 keep their
    large pair, 4.2 + 7.6 + row 1's small 2 + 4 = 17.8, against 17.6 with row 1 large instead of row 0,
    and 16.2 for the plain mask. The kept weights are the dense ones, bit for bit."""
    weight = torch.tensor([[2.1, 2.1, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0], [1.9, 1.9, 1.0, 1.0], [1.0, 1.0, 2.0, 2.0]])
    cfg = MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True), solver="exact")
    spec = PRUNERS["magnitude"]
    large, small = [True, True, False, False], [False, False, True, True]
    plain = spec.prune_batch(weight.clone(), None, cfg)[0]
    assert plain.mask.tolist() == [large, large, small, small]
    curvature = torch.tensor([1.0, 1.0, 4.0, 1.0]) * 0.75  # (1 + λ g/mean g) with λ = 1 is 1 + g/ḡ
    rows = torch.tensor([1.0, 1.0, 4.0, 1.0])
    weighted = prune_weighted(spec, weight.clone(), None, cfg, rows)[0]
    assert weighted.mask.tolist() == [large, small, large, small]
    assert torch.equal(weighted.weight, weight * weighted.mask)
    # The row weights of a curvature: 1 + λ·g/mean g.
    assert torch.allclose(row_weights(curvature, 2.0), 1 + 2.0 * curvature / curvature.mean())
    assert torch.equal(row_weights(torch.zeros(4), 2.0), torch.ones(4))


def test_weighted_alps_and_sparsegpt_lower_the_weighted_error_of_the_heavy_rows() -> None:
    """The weighted problem on a real objective: with row 0..3's weight 50× the others', the methods' error
    on those rows falls below the plain run's, and the total weighted error with it."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 64, generator=gen)
    x = torch.randn(256, 64, generator=gen) @ torch.randn(64, 64, generator=gen)  # correlated inputs
    stats = InputStats.from_inputs(x)
    gram = stats.require_gram()
    cfg = MatrixPruneConfig(SparsityPattern.from_nm(8, 16, transposable=True), solver="flow")
    rows = torch.ones(32)
    rows[:4] = 50.0

    def errors(pruned: torch.Tensor) -> torch.Tensor:  # (out,) ‖X(ŵ_i − w_i)‖²
        delta = pruned - weight
        return ((delta @ gram) * delta).sum(1)

    for method in ("sparsegpt", "alps"):
        spec = PRUNERS[method]
        plain = errors(spec.prune_batch(weight.clone(), stats, cfg)[0].weight)
        weighted = errors(prune_weighted(spec, weight.clone(), stats, cfg, rows)[0].weight)
        assert weighted[:4].sum() < plain[:4].sum(), method
        assert (rows * weighted).sum() < (rows * plain).sum(), method


# ---------------------------------------------------------------- the curvature


def test_curvature_is_the_models_own_loss_gradient_at_each_linear(tiny: Path) -> None:
    """g_i = Σ_t δ_ti² from the block-by-block pre-pass against the whole model's forward and backward with
    hooks on every linear's output (each sample's mean next-token cross-entropy)."""
    loaded = load_model(str(tiny), LOCAL_CTX, dtype=torch.float32, device="cpu")
    model, structure = loaded.model, loaded.structure
    ids = torch.randint(0, 1000, (3, 16), generator=torch.Generator().manual_seed(0))
    slots = linear_slots(structure)
    inputs = capture_block_inputs(structure, ids, CPU)
    source = BlockSource(structure, CPU, offloaded=False)
    found = loss_curvature(model, source, CalibrationBatch(inputs.calls, inputs.hidden, ids), slots, Team.solo(CPU))
    expected: dict[str, torch.Tensor] = {}
    handles = []
    for slot in slots:
        module = model.get_submodule(slot.full_name)

        def hook(_m: nn.Module, _a: object, out: torch.Tensor, name: str = slot.full_name) -> None:
            def add(grad: torch.Tensor) -> None:
                expected[name] = expected.get(name, 0) + grad.reshape(-1, grad.shape[-1]).square().sum(0)

            out.register_hook(add)

        handles.append(module.register_forward_hook(hook))
    try:
        for row in ids:
            logits = model(input_ids=row[None], use_cache=False).logits
            loss = nn.functional.cross_entropy(logits[0, :-1], row[1:])
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    assert found.keys() == expected.keys() and len(found) == 7 * 3
    for name, sums in found.items():
        torch.testing.assert_close(sums, expected[name], rtol=1e-4, atol=1e-10)
        assert bool((sums > 0).all()), name


# ---------------------------------------------------------------- whole runs


def test_weight_zero_is_todays_run_and_streamed_equals_whole(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """λ = 0 is today's checkpoint bit for bit (and today's resume key); λ > 0 changes the masks, streamed
    and whole alike, bit for bit, and the report records it."""
    runs = {
        "today": {},
        "zero": {"loss_aware": 0.0},
        "streamed": {"loss_aware": 4.0, "stream": True},
        "whole": {"loss_aware": 4.0, "stream": False},
    }
    for name, changes in runs.items():
        prune_model(sparsegpt_config(tiny, calib, tmp_path / name, **changes), data_ctx)
    assert (
        sparsegpt_config(tiny, calib, None).result_hash()
        == sparsegpt_config(tiny, calib, None, loss_aware=0.0).result_hash()
    )
    assert _sha(tmp_path / "today") == _sha(tmp_path / "zero")
    assert _sha(tmp_path / "streamed") == _sha(tmp_path / "whole") != _sha(tmp_path / "today")
    settings = json.loads((tmp_path / "streamed" / PRUNE_FILE).read_text())["settings"]
    assert settings["loss_aware"] == 4.0


def test_a_killed_loss_aware_run_resumes_to_the_same_checkpoint(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """The resumed run computes the same curvature from the dense weights (streamed and whole), so its
    remaining blocks are pruned as the uninterrupted run's."""
    for stream in (True, False):
        full, resumed = tmp_path / f"full-{stream}", tmp_path / f"resumed-{stream}"
        prune_model(sparsegpt_config(tiny, calib, full, loss_aware=4.0, stream=stream), data_ctx)

        def kill_after_first(index: int) -> None:
            if index == 0:
                raise Killed

        cfg = sparsegpt_config(tiny, calib, resumed, loss_aware=4.0, stream=stream)
        with pytest.raises(Killed):
            prune_model(cfg, data_ctx, after_block=kill_after_first)
        report = prune_model(cfg, data_ctx)
        assert report.resumed_from_block == 1
        assert _sha(resumed) == _sha(full)


def test_a_fraction_reads_the_first_samples_and_all_of_them_is_todays_run(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--loss-aware-fraction f: the pass reads the first ⌈f·nsamples⌉ calibration samples, the same tokens the
    blocks' loop starts with, and nothing else; f = 1 (or a fraction giving every sample) keeps the
    checkpoint and the resume key of a run without the setting, a smaller one changes the row weights."""
    from tsenor_cli.pruning.run import loss_aware

    read: dict[str, torch.Tensor] = {}
    calibrated = loss_aware.capture_start

    def capture(source: BlockSource, calib_data: object, shard: slice, *args: object, **kwargs: object) -> object:
        read["ids"] = calib_data.input_ids[shard]  # type: ignore[attr-defined]
        read["all"] = calib_data.input_ids  # type: ignore[attr-defined]
        return calibrated(source, calib_data, shard, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loss_aware, "capture_start", capture)
    runs = {"all": 1.0, "every": 0.9, "half": 0.5, "one": 0.1}  # of 4 samples: 4, 4, 2, 1
    seen = {}
    for name, fraction in runs.items():
        prune_model(sparsegpt_config(tiny, calib, tmp_path / name, loss_aware=4.0, loss_aware_fraction=fraction),
                    data_ctx)  # fmt: skip
        seen[name] = read["ids"]
        assert torch.equal(read["ids"], read["all"][: seen[name].shape[0]])
    assert [seen[name].shape[0] for name in runs] == [4, 4, 2, 1]
    hashes = {name: sparsegpt_config(tiny, calib, None, loss_aware=4.0, loss_aware_fraction=f).result_hash()
              for name, f in runs.items()}  # fmt: skip
    assert hashes["all"] == hashes["every"] == sparsegpt_config(tiny, calib, None, loss_aware=4.0).result_hash()
    assert len({hashes["all"], hashes["half"], hashes["one"]}) == 3
    assert _sha(tmp_path / "all") == _sha(tmp_path / "every") != _sha(tmp_path / "half")
    settings = json.loads((tmp_path / "half" / PRUNE_FILE).read_text())["settings"]
    assert settings["loss_aware_fraction"] == 0.5


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5"])
def test_a_bad_fraction_is_one_line_and_writes_nothing(tiny: Path, calib: Path, tmp_path: Path, value: str) -> None:
    out = tmp_path / "out"
    args = ["prune", str(tiny), "--nm", "2:4", "--calib-data", str(calib), "--nsamples", "2", "--seqlen", "16"]
    result = invoke([*args, "--loss-aware", "1", "--loss-aware-fraction", value, "--output", str(out)])
    assert result.exit_code == 2, result.output
    assert "--loss-aware-fraction" in str(result.exception) and not out.exists()


def test_a_fraction_that_leaves_a_process_without_a_sample_is_refused(tiny: Path, calib: Path) -> None:
    """Two processes, 4 samples, a quarter of them: the pass would give one process none."""
    from tsenor_cli.errors import UsageError

    cfg = sparsegpt_config(tiny, calib, None, loss_aware=1.0, loss_aware_fraction=0.25)
    cfg.check_samples(1, "one process")
    with pytest.raises(UsageError, match=r"--loss-aware-fraction 0.25 leaves the loss pass 1 samples.*at least 0.5"):
        cfg.check_samples(2, "--nproc 2")
    sparsegpt_config(tiny, calib, None, loss_aware_fraction=0.25).check_samples(2, "--nproc 2")  # no pass: no limit


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_weight_is_one_line_and_writes_nothing(tiny: Path, calib: Path, tmp_path: Path, value: str) -> None:
    out = tmp_path / "out"
    args = ["prune", str(tiny), "--nm", "2:4", "--calib-data", str(calib), "--nsamples", "2", "--seqlen", "16"]
    result = invoke([*args, "--loss-aware", value, "--output", str(out)])
    assert result.exit_code == 2, result.output
    assert "--loss-aware" in str(result.exception) and not out.exists()


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_the_plan_counts_the_tensors_of_the_curvature_pass(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fraction: float
) -> None:
    """The dry run's `curvature` part against what the pass holds in a run: the checkpoints `_forward`
    keeps, then at once either the last output and the gradient or one replayed segment's inputs and the
    gradient; the head's logits, (T, V) float32 three times; the per-sample sums. Without --loss-aware the
    part is 0 and the total unchanged. 3 blocks: segments of 2 (⌈√3⌉), checkpoints at blocks 0 and 2. With
    half the samples (--loss-aware-fraction 0.5) the hidden states and the sums are of those 2 of 4."""
    from tsenor_cli.pruning.block import curvature
    from tsenor_cli.pruning.plan.plan import plan_model

    held: dict[str, list[int]] = {"checkpoints": [], "segments": []}
    forward, replay = curvature._forward, curvature._replay

    def kept(*args: object) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        checkpoints, last = forward(*args)  # type: ignore[arg-type]
        held["checkpoints"] = sorted(checkpoints)
        held["copy"] = [last.numel() * last.element_size()]
        return checkpoints, last

    def segment(*args: object) -> list[torch.Tensor]:
        inputs = replay(*args)  # type: ignore[arg-type]
        held["segments"].append(len(inputs))
        return inputs

    monkeypatch.setattr(curvature, "_forward", kept)
    monkeypatch.setattr(curvature, "_replay", segment)
    cfg = sparsegpt_config(tiny, calib, tmp_path / "out", loss_aware=4.0, loss_aware_fraction=fraction)
    plain = plan_model(sparsegpt_config(tiny, calib, tmp_path / "out"), data_ctx).host_memory
    host = plan_model(cfg, data_ctx).host_memory
    prune_model(cfg, data_ctx)
    assert held["checkpoints"] == [0, 2] and held["segments"] == [1, 2]  # the last segment first
    assert plain.curvature == 0 and host.curvature > 0 and host.total >= plain.total
    copies = len(held["checkpoints"]) + max(2, *held["segments"])  # 4: every peak of the pass, counted above
    logits = 3 * cfg.seqlen * 49152 * 4  # the tiny model's head: the SmolLM2 tokenizer's vocabulary
    rows = int(cfg.nsamples * fraction)
    hidden = json.loads((tiny / "config.json").read_text())["hidden_size"]
    assert held["copy"][0] == rows * cfg.seqlen * hidden * 4  # (S, T, H) float32 of the samples the pass reads
    sums = rows * sum(_outputs(tiny)) * 4
    assert host.curvature == copies * held["copy"][0] + logits + sums


def _outputs(model: Path) -> list[int]:
    """The out_features of every nn.Linear in the model's blocks."""
    loaded = load_model(str(model), LOCAL_CTX, dtype=torch.float32, device="cpu")
    return [slot.out_features for slot in linear_slots(loaded.structure)]

"""`tsenor prune --distill-steps N` (tsenor_cli/compress.py): the prune and the whole-model distillation after it in
one command. Against the two commands it stands for (the same bytes), resumed after a stop in either stage,
with --nproc 2, the quality recipes as shipped, and the refusals that must come before any work."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers_cli import invoke

from tsenor_cli.compress import compress, distill_config
from tsenor_cli.errors import DoesNotFitError, Interrupted, OutputExistsError, UsageError
from tsenor_cli.finetune import plan as finetune_plan
from tsenor_cli.interrupt import StopRequest
from tsenor_cli.pruning.run.launch import stage_arguments
from tsenor_cli.pruning.run.verify import verify_checkpoint
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.pruning.settings.recipe import build_config, overlay, read_recipe
from tsenor_cli.runfiles import EVAL_FILE, FINETUNE_FILE, PRUNE_FILE, pruned_stage
from tsenor_cli.settings import DistributedContext, RunContext

REPO = Path(__file__).resolve().parents[1]
# A small prune whose distillation is three steps of two windows of the calibration text.
SMALL = ["--nm", "8:16", "--method", "sparsegpt", "--nsamples", "4", "--seqlen", "32"]
DISTILL = ["--distill-steps", "3", "--distill-batch-size", "2", "--distill-warmup", "1"]


def _sha(folder: Path) -> str:
    """One hash of every safetensors file of a checkpoint folder."""
    files = sorted(folder.glob("*.safetensors"))
    assert files, folder
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def _cfg(model: Path, calib: Path, output: Path, *, resume: bool = True, **values: Any) -> PruneConfig:
    recipe = {"model": str(model), "nm": "8:16", "method": "sparsegpt", "calib_data": str(calib), "nsamples": 4}
    recipe |= {"seqlen": 32, "distill_steps": 3, "distill_batch_size": 2, "distill_warmup": 1, "output": str(output)}
    return build_config(recipe | values, force=False, resume=resume, command=None)


def test_one_command_writes_what_the_prune_and_the_finetune_it_stands_for_write(
    tiny_llama: Any, calib: Path, data_dir: Path, tmp_path: Path
) -> None:
    model = tiny_llama(num_layers=2)
    out = tmp_path / "out"
    shards = ["--max-shard-size", "5MB"]  # the distilled output's shards, as the prune's
    result = invoke(["prune", str(model), *SMALL, "--data", str(calib), *DISTILL, *shards, "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "then distilled for 3 steps" in result.output
    assert len(list(out.glob("*.safetensors"))) > 1  # the embeddings alone fill one shard
    assert not pruned_stage(out).exists()  # the stage goes once the output holds the distilled model
    assert verify_checkpoint(out).ok
    # The two commands: the plain prune, then tsenor finetune with the flags --distill-* stand for.
    pruned, tuned = tmp_path / "pruned", tmp_path / "tuned"
    assert invoke(["prune", str(model), *SMALL, "--data", str(calib), "--output", str(pruned)]).exit_code == 0
    flags = ["--teacher", str(model), "--data", str(calib), "--seqlen", "32", "--max-steps", "3", "--batch-size", "2"]
    flags += ["--warmup", "1", "--lr", "3e-4", "--ppl", "none", "--save-every", "50", *shards]
    finetuned = invoke(["finetune", str(pruned), *flags, "--output", str(tuned)])
    assert finetuned.exit_code == 0, finetuned.output
    assert _sha(out) == _sha(tuned) != _sha(pruned)
    prune_report = json.loads((out / PRUNE_FILE).read_text())
    assert (
        prune_report["settings"]["result_hash"]
        == json.loads((pruned / PRUNE_FILE).read_text())["settings"]["result_hash"]
    )
    distilled = json.loads((out / FINETUNE_FILE).read_text())
    assert distilled["steps"] == 3 and distilled["settings"]["teacher"] == str(model)
    assert distilled["settings"]["lr"] == 3e-4 and distilled["pruned_nonzero"] == 0
    # Run again: finished with the same settings, nothing to do but --eval (of the distilled checkpoint);
    # other distillation settings: refused at once.
    evaluate = ["--eval", "--ppl", "wikitext2", "--max-windows", "2", "--data-dir", str(data_dir)]
    again = invoke(["prune", str(model), *SMALL, "--data", str(calib), *DISTILL, *shards, *evaluate, "-o", str(out)])
    assert again.exit_code == 0 and "nothing to do" in again.output, again.output
    assert json.loads((out / EVAL_FILE).read_text())["source"] == str(out.resolve())
    other = invoke(
        ["prune", str(model), *SMALL, "--data", str(calib), *DISTILL, "--distill-lr", "1e-4", "-o", str(out)]
    )
    assert other.exit_code == OutputExistsError.exit_code and "already holds a tsenor run" in str(other.exception)
    assert not pruned_stage(out).exists()  # refused before the prune
    assert _sha(out) == _sha(tuned)


def test_a_stop_in_either_stage_resumes_to_the_same_bytes(
    tiny_llama: Any, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """Stopped (SIGTERM's request) after block 1 of the prune, and after step 2 of the distillation with its
    state saved every step: each rerun continues where the run stopped and writes the uninterrupted bytes."""
    model = tiny_llama(num_layers=2)
    whole = _cfg(model, calib, tmp_path / "whole")
    compress(whole, data_ctx)
    for when in ("block 1/2", "step 1/3"):  # a stop asked during step 2 ends it after step 2
        cfg = _cfg(model, calib, tmp_path / when.split()[0], distill_save_every=1)
        stop = StopRequest()

        def say(line: str, stop: StopRequest = stop, when: str = when) -> None:
            if line.startswith(when):
                stop.request("SIGTERM")

        with pytest.raises(Interrupted) as stopped:
            compress(cfg, data_ctx, stop=stop, progress=say)
        assert stopped.value.exit_code == 75, stopped.value
        assert not (tmp_path / when.split()[0] / "model.safetensors").exists()
        resumed: list[str] = []
        outcome = compress(cfg, data_ctx, progress=resumed.append)
        if when.startswith("block"):
            assert any(line.startswith("resuming after block 1/2") for line in resumed), resumed
        else:
            assert any("holds this run's prune, finished" in line for line in resumed), resumed
            assert any(line.startswith("resuming after step 2/3") for line in resumed), resumed
            assert outcome.distill is not None and outcome.distill.resumed_from_step == 2
        assert _sha(cfg.output) == _sha(whole.output), when  # type: ignore[arg-type]
        assert not pruned_stage(cfg.output).exists()  # type: ignore[arg-type]


def test_nproc_two_prunes_in_the_ranks_and_distils_here(
    tiny_llama: Any, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """The 16:32 quality recipe as shipped (calibration and steps made small on the command line), through the
    CLI: one process, and --nproc 2 (the ranks prune the stage, the launching process distils), the same bytes."""
    model = tiny_llama(num_layers=2)
    recipe = read_recipe(REPO / "configs" / "quality-16x32.yaml")
    assert recipe["distill_steps"] > 0 and recipe["distill_dtype"] == "bf16" and recipe["distill_freeze_embeddings"]
    args = ["prune", str(model), "--config", str(REPO / "configs" / "quality-16x32.yaml"), "--data", str(calib)]
    # 8 samples: the recipe's loss pass reads a quarter of them, at least one per rank.
    args += ["--nsamples", "8", "--seqlen", "32", "--distill-steps", "2", "--distill-batch-size", "2"]
    args += ["--data-dir", str(data_ctx.data_dir), "--offline"]
    one = invoke([*args, "--output", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output
    done = subprocess.run(
        [sys.executable, "-m", "tsenor_cli", *args, "--nproc", "2", "--json", "--output", str(tmp_path / "two")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)  # one JSON document: the ranks print none
    assert summary["prune"]["settings"]["processes"] == 2 and summary["distill"]["steps"] == 2
    assert _sha(tmp_path / "two") == _sha(tmp_path / "one")
    assert not pruned_stage(tmp_path / "two").exists()
    frozen = json.loads((tmp_path / "one" / FINETUNE_FILE).read_text())["settings"]
    assert frozen["freeze_embeddings"] is True and frozen["bf16"] is True


def test_refusals_come_before_any_work(
    tiny_llama: Any, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_llama(num_layers=2)
    cfg = _cfg(model, calib, tmp_path / "out")
    ranks = replace(data_ctx, distributed=DistributedContext(1, 2, 1))
    with pytest.raises(UsageError, match="under torchrun; start the ranks with --nproc K"):
        compress(cfg, ranks)
    with pytest.raises(UsageError, match="--device 'cuda:1': use cpu or cuda"):
        distill_config(replace(cfg, device="cuda:1"), 32)
    with pytest.raises(UsageError, match="--distill-warmup 4 exceeds --distill-steps 3"):
        _cfg(model, calib, tmp_path / "out", distill_warmup=4)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="not a tsenor run"):
        compress(replace(cfg, output=tmp_path / "other"), data_ctx)
    with pytest.raises(UsageError, match="would overwrite the input checkpoint"):
        compress(replace(cfg, output=model), data_ctx)
    # A distillation that cannot fit here: refused from the config, before any weight is read.
    monkeypatch.setattr(finetune_plan, "available_host_bytes", lambda: 1 << 20)
    with pytest.raises(DoesNotFitError, match="available; pass a smaller --distill-batch-size or --seqlen"):
        compress(cfg, data_ctx)
    assert not any(p.name.endswith(".pruned") for p in tmp_path.iterdir())  # nothing pruned
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "out").exists()


def test_the_dry_run_plans_both_stages_and_the_ranks_get_the_stage(
    tiny_llama: Any, calib: Path, tmp_path: Path
) -> None:
    model = tiny_llama(num_layers=2)
    base = ["prune", str(model), *SMALL, "--data", str(calib), *DISTILL, "--output", str(tmp_path / "o"), "--dry-run"]
    text = invoke(base)
    assert text.exit_code == 0, text.output
    assert (
        "then the distillation (--distill-steps):" in text.output
        and "micro-batch: 2 windows x 32 tokens" in text.output
    )
    plan = json.loads(invoke([*base, "--json"]).output)
    assert plan["distill"]["batch"] == 2 and plan["distill"]["teacher_params"] == plan["distill"]["params"]
    assert not (tmp_path / "o").exists()
    args = ["prune", "m", "--eval", "--tasks", "piqa", "-o", "x", "--json", "--config", "r.yaml"]
    # The typed distillation flags are the launching process's: the ranks would only warn that they ignore them.
    args += ["--distill-steps", "8", "--distill-lr=1e-4", "--distill-freeze-embeddings", "--distill-dtype", "bf16"]
    args += ["--seed", "1"]
    assert stage_arguments(args, Path("/w/.x.pruned")) == [
        "prune", "m", "--config", "r.yaml", "--seed", "1", "--output", "/w/.x.pruned", "--distill-steps", "0",
    ]  # fmt: skip


def test_distill_settings_without_steps_warn(caplog: pytest.LogCaptureFixture) -> None:
    cfg = build_config({"model": "m", "nm": "2:4", "distill_lr": 1e-4}, force=False, resume=True, command=None)
    assert not cfg.distill.on and cfg.distill.lr == 1e-4
    assert "ignoring --distill-lr: only --distill-steps N > 0 reads it" in caplog.text


def test_a_stage_turned_off_over_a_recipe_reads_none_of_its_settings(caplog: pytest.LogCaptureFixture) -> None:
    # `--config configs/quality-16x32.yaml --distill-steps 0`: the recipe's advice, and the --nproc ranks' stage.
    recipe = read_recipe(Path("configs/quality-16x32.yaml"))
    merged = overlay(recipe, {"model": "m", "distill_steps": 0, "refine": "none"})
    assert not {k for k in merged if k.startswith(("distill_", "refine_"))} - {"distill_steps"}
    assert merged["loss_aware"] == recipe["loss_aware"] and merged["model"] == "m"
    cfg = build_config(merged, force=False, resume=True, command=None)
    assert not cfg.distill.on and not cfg.refine.on and "ignoring" not in caplog.text
    # A setting typed beside the stage turned off is still named.
    build_config(overlay(recipe, {"model": "m", "distill_steps": 0, "distill_lr": 1e-4}), force=False, resume=True,
                 command=None)  # fmt: skip
    assert "ignoring --distill-lr: only --distill-steps N > 0 reads it" in caplog.text
    # The stage kept on keeps the recipe's settings.
    assert overlay(recipe, {"distill_steps": 8})["distill_lr"] == recipe["distill_lr"]


def test_the_python_api_distils_from_a_path_and_refuses_a_model_in_memory(
    tiny_llama: Any, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    import tsenor_cli

    model = tiny_llama(num_layers=2)
    settings: dict[str, Any] = {"nm": "8:16", "method": "sparsegpt", "calib_data": str(calib), "nsamples": 4}
    settings |= {"seqlen": 32, "distill_steps": 2, "distill_batch_size": 2, "distill_warmup": 1}
    report = tsenor_cli.prune(model, tmp_path / "out", ctx=data_ctx, **settings)
    assert report.totals()["layers_pruned"] == 14
    assert json.loads((tmp_path / "out" / FINETUNE_FILE).read_text())["steps"] == 2
    with pytest.raises(UsageError, match="distill_steps runs from a checkpoint path"):
        tsenor_cli.prune(AutoModelForCausalLM.from_pretrained(model), tmp_path / "mem", ctx=data_ctx, **settings)
    assert not (tmp_path / "mem").exists()


def test_a_packed_distilling_prune_writes_a_packed_distilled_checkpoint(
    tiny_llama: Any, calib: Path, tmp_path: Path
) -> None:
    """--save-format packed: the stage is packed, the distillation reads it and writes its output packed
    (its masks fixed), and it holds the dense one-command run's weights."""
    from tsenor_cli.packed.files import declares_packed

    model = tiny_llama(num_layers=2)
    base = ["prune", str(model), *SMALL, "--data", str(calib), *DISTILL]
    assert invoke([*base, "--output", str(tmp_path / "dense")]).exit_code == 0
    packed = invoke([*base, "--save-format", "packed", "--output", str(tmp_path / "packed")])
    assert packed.exit_code == 0, packed.output
    assert declares_packed(tmp_path / "packed") and not declares_packed(tmp_path / "dense")
    assert verify_checkpoint(tmp_path / "packed").ok
    unpacked = invoke(["unpack", str(tmp_path / "packed"), "-o", str(tmp_path / "unpacked")])
    assert unpacked.exit_code == 0, unpacked.output
    assert _sha(tmp_path / "unpacked") == _sha(tmp_path / "dense")

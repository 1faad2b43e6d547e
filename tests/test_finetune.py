"""`tsenor finetune`: the transposable mask stays fixed while a tiny pruned LLaMA trains (Trainer + callback)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import LOCAL_CTX, make_tiny_llama, sparsegpt_config
from safetensors.torch import load_file, save_file
from torch import nn

from tsenor_cli.cli.finetune import summary
from tsenor_cli.errors import Interrupted, TsenorError
from tsenor_cli.finetune.run import FinetuneConfig, finetune, last_complete_checkpoint
from tsenor_cli.fixedmask import FixedMask
from tsenor_cli.interrupt import StopRequest
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.run.seams import BlockContext, BlockHook
from tsenor_cli.pruning.run.verify import verify_checkpoint
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.runfiles import RESUME_DIR, SCHEMA_VERSION, SPARSITY_FILE, FinetuneReport, SchemaError, read_sparsity
from tsenor_cli.settings import RunContext

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. "


def _magnitude_prune(src: Path, out: Path, n: int, m: int, data_ctx: RunContext, **changes: Any) -> Path:
    """`src` pruned by magnitude to transposable n:m (the exact solver, 2 samples of 16 tokens) into `out`."""
    cfg = PruneConfig(
        model=str(src),
        matrix=MatrixPruneConfig(SparsityPattern.from_nm(n, m, transposable=True), solver="exact"),
        method="magnitude",
        nsamples=2,
        seqlen=16,
        output=out,
        **changes,
    )
    prune_model(cfg, data_ctx)
    return out


@pytest.fixture(scope="module")
def pruned(tmp_path_factory: pytest.TempPathFactory, data_ctx: RunContext) -> Path:
    """A tiny random LLaMA pruned to transposable 8:16 by magnitude (calibration text from the data folder
    only feeds the block inputs, which magnitude ignores)."""
    root = tmp_path_factory.mktemp("finetune")
    return _magnitude_prune(make_tiny_llama(root / "src"), root / "pruned", 8, 16, data_ctx, calib_data="wikitext2")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "repeat.txt"
    path.write_text(TEXT * 60)  # ~1k tokens: a few dozen 32-token windows of the same sentence
    return path


def _config(pruned: Path, output: Path, text_file: Path, **overrides: object) -> FinetuneConfig:
    values: dict[str, object] = {
        "run_dir": pruned,
        "output": output,
        "data": str(text_file),
        "seqlen": 32,
        "max_steps": 4,
        "lr": 1e-2,  # large, so every kept weight moves in a few steps
        "batch_size": 2,
        "ppl_datasets": (),
        "save_every": 0,
    }
    values.update(overrides)
    return FinetuneConfig(**values)  # type: ignore[arg-type]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _weights_hash(path: Path) -> str:
    tensors = _weights(path)
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def _pruned_modules(path: Path) -> list[str]:
    record = read_sparsity(path)
    assert record is not None
    return list(record.pruned_modules)


def _check_mask_kept(pruned: Path, out: Path) -> None:
    """Every pruned weight is exactly 0 after training, and (nearly) every kept weight moved."""
    before, after = _weights(pruned), _weights(out)
    modules = _pruned_modules(pruned)
    assert len(modules) == 14
    for module in modules:
        name = f"{module}.weight"
        zero = before[name] == 0  # (out, in) the mask the run recorded
        assert 0.45 < float(zero.float().mean()) < 0.55  # 8:16
        assert int(after[name][zero].count_nonzero()) == 0, module
        moved = float((after[name][~zero] != before[name][~zero]).float().mean())
        assert moved > 0.9, (module, moved)
    assert verify_checkpoint(out).ok


def test_fixed_mask_zeroes_gradients_and_weights() -> None:
    """The hooks alone keep Adam from moving pruned weights; without them a step moves them (control)."""
    torch.manual_seed(0)
    for attached in (False, True):
        model = nn.Sequential(nn.Linear(16, 16, bias=False))
        with torch.no_grad():
            model[0].weight[:, ::2] = 0.0
        pruned = model[0].weight.detach() == 0  # (16, 16)
        fixed = FixedMask(model, {"0.weight": pruned.clone()})
        if attached:
            fixed.attach()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
        model(torch.randn(8, 16)).pow(2).sum().backward()
        grad = model[0].weight.grad
        assert grad is not None
        assert (int(grad[pruned].count_nonzero()) == 0) == attached
        optimizer.step()
        assert (fixed.nonzero_pruned() == 0) == attached
        fixed.apply()
        assert fixed.nonzero_pruned() == 0 and int(model[0].weight[~pruned].count_nonzero()) == int((~pruned).sum())
        fixed.detach()


@pytest.mark.realdata
def test_finetune_cli_keeps_the_mask_and_lowers_the_loss(pruned: Path, text_file: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ft"
    args = ["finetune", str(pruned), "--output", str(out), "--data", str(text_file), "--seqlen", "32"]
    args += ["--max-steps", "6", "--lr", "1e-2", "--batch-size", "2", "--ppl", "wikitext2", "--max-windows", "1"]
    args += ["--eval-every", "2", "--save-every", "3", "--json"]
    result = invoke(args)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ft"]  # no temp or state leftovers
    _check_mask_kept(pruned, out)
    report = json.loads((out / "finetune.json").read_text())
    assert report["schema_version"] == SCHEMA_VERSION
    read_back = FinetuneReport.from_json(report)  # the schema reads what finetune wrote, unchanged
    assert read_back.to_json() == report and read_back.loss_curve[0][0] == 1
    assert report["steps"] == 6 and report["tokens"] == 6 * 2 * 32 and report["pruned_nonzero"] == 0
    losses = [loss for _, loss in report["loss_curve"]]
    assert [step for step, _ in report["loss_curve"]] == [1, 2, 3, 4, 5, 6]
    assert losses[-1] < losses[0] - 2.0  # nats: one repeated sentence, the model learns it
    assert [step for step, _ in report["ppl_curve"]["wikitext2"]] == [0, 2, 4, 6]
    assert report["ppl_curve"]["wikitext2"][0][1] == report["ppl_before"]["wikitext2"]
    assert report["ppl_curve"]["wikitext2"][-1][1] == report["ppl_after"]["wikitext2"]
    assert (
        json.loads((out / "eval.json").read_text())["perplexity"]["wikitext2"]["ppl"]
        == report["ppl_after"]["wikitext2"]
    )
    assert (out / "tsenor_report.json").read_bytes() == (pruned / "tsenor_report.json").read_bytes()
    source_meta = json.loads((pruned / "config.json").read_text())["tsenor_sparsity"]
    assert json.loads((out / "config.json").read_text())["tsenor_sparsity"] == source_meta
    assert (out / SPARSITY_FILE).read_bytes() == (pruned / SPARSITY_FILE).read_bytes()
    for png in ("finetune_loss.png", "finetune_ppl.png"):
        assert (out / png).read_bytes().startswith(b"\x89PNG")
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32
    verified = invoke(["verify", str(out)])
    assert verified.exit_code == 0 and "satisfy 8:16" in verified.output


@pytest.mark.parametrize("overrides", [{"dtype": "bf16"}, {"grad_accum": 2}], ids=["bf16", "grad_accum2"])
def test_mask_holds_under_bf16_and_gradient_accumulation(
    pruned: Path, text_file: Path, tmp_path: Path, overrides: dict[str, object]
) -> None:
    report = finetune(_config(pruned, tmp_path / "ft", text_file, **overrides), LOCAL_CTX)
    _check_mask_kept(pruned, tmp_path / "ft")
    assert report.steps == 4 and report.pruned_nonzero == 0
    assert report.tokens == 4 * 2 * int(overrides.get("grad_accum", 1)) * 32  # type: ignore[call-overload]


@pytest.mark.realdata
def test_resume_after_an_interruption_equals_an_uninterrupted_run(
    pruned: Path, text_file: Path, tmp_path: Path, data_ctx: RunContext
) -> None:
    def cfg(output: Path, resume: bool) -> FinetuneConfig:
        return _config(
            pruned,
            output,
            text_file,
            max_steps=4,
            save_every=2,
            resume=resume,
            ppl_datasets=("wikitext2",),
            max_windows=1,
            eval_every=2,  # the step-2 perplexity is evaluated before the kill and must survive it
        )

    full = finetune(cfg(tmp_path / "full", resume=False), data_ctx)

    class Killed(RuntimeError):
        pass

    def kill_at_two(step: int) -> None:
        if step == 2:
            raise Killed

    out = tmp_path / "resumed"
    with pytest.raises(Killed):
        finetune(cfg(out, resume=True), data_ctx, after_save=kill_at_two)
    assert sorted(p.name for p in out.iterdir()) == [RESUME_DIR]
    assert (out / RESUME_DIR / "checkpoint-2" / "model.safetensors").is_file()
    # A later checkpoint the kill (or a full disk) cut short while Trainer wrote it: passed over.
    cut = out / RESUME_DIR / "checkpoint-4"
    cut.mkdir()
    (cut / "config.json").write_text((out / RESUME_DIR / "checkpoint-2" / "config.json").read_text())
    (cut / "trainer_state.json").write_text('{"global_step": 4, "log_hist')
    # Without --resume the half-done folder is refused, not silently overwritten.
    refused = invoke(["finetune", str(pruned), "--output", str(out), "--ppl", "none", "--max-steps", "1"])
    assert refused.exit_code == 4 and "--resume" in str(refused.exception)
    messages: list[str] = []
    resumed = finetune(cfg(out, resume=True), data_ctx, progress=messages.append)
    assert resumed.resumed_from_step == 2
    assert any("resuming after step 2/4" in m for m in messages)
    assert any(m.startswith(f"passing over {cut}: it was not written to the end") for m in messages)
    assert not any(m.startswith("step 1/4") for m in messages)  # steps 1-2 were not redone
    assert not (out / RESUME_DIR).exists()
    # Bit-identical on CPU: Trainer restores the optimizer, scheduler, RNG and data order.
    assert _weights_hash(out) == _weights_hash(tmp_path / "full")
    assert resumed.loss_curve == full.loss_curve and resumed.ppl_curve == full.ppl_curve
    assert resumed.ppl("before") == full.ppl("before") and [s for s, _ in resumed.ppl_curve["wikitext2"]] == [0, 2, 4]


@pytest.mark.realdata
def test_the_last_step_is_checkpointed_only_when_an_evaluation_follows_it(
    pruned: Path, text_file: Path, tmp_path: Path, data_ctx: RunContext
) -> None:
    """Trainer checkpoints the last step; without an evaluation after training the output is written right
    after it, so tsenor does not (a kill in between resumes from step 2 to the same bytes, as tested above)."""
    saved: dict[tuple[str, ...], list[int]] = {}
    for ppl in ((), ("wikitext2",)):
        saved[ppl] = []
        cfg = _config(pruned, tmp_path / f"out{len(ppl)}", text_file, save_every=2, ppl_datasets=ppl, max_windows=1)
        finetune(cfg, data_ctx, after_save=saved[ppl].append)
        assert not (tmp_path / f"out{len(ppl)}" / RESUME_DIR).exists()
    assert saved == {(): [2], ("wikitext2",): [2, 4]}


def test_resume_takes_the_newest_checkpoint_written_to_the_end(tmp_path: Path) -> None:
    def checkpoint(step: int, state: str | None) -> Path:
        path = tmp_path / f"checkpoint-{step}"
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"weights")
        if state is not None:
            (path / "trainer_state.json").write_text(state)
        return path

    said: list[str] = []
    assert last_complete_checkpoint(tmp_path, said.append) is None  # nothing saved yet
    checkpoint(2, json.dumps({"global_step": 2}))
    whole = checkpoint(10, json.dumps({"global_step": 10}))
    checkpoint(12, None)  # stopped before trainer_state.json
    checkpoint(14, '{"global_step": 14, "log_hi')  # stopped while writing it
    checkpoint(16, json.dumps({"global_step": 4}))  # another step's state copied in: not this checkpoint's
    (tmp_path / "checkpoint-x").mkdir()
    (tmp_path / "checkpoint-20").write_text("a file, not a checkpoint")
    assert last_complete_checkpoint(tmp_path, said.append) == whole  # 10 > 2 numerically, not as text
    assert [m.split(":")[0] for m in said] == [f"passing over {tmp_path / f'checkpoint-{n}'}" for n in (16, 14, 12)]


@pytest.mark.realdata
def test_bad_run_dirs_get_one_line_errors_and_nothing_written(pruned: Path, text_file: Path, tmp_path: Path) -> None:
    dense = make_tiny_llama(tmp_path / "dense")
    no_report = tmp_path / "no_report"
    shutil.copytree(pruned, no_report)
    (no_report / "tsenor_report.json").unlink()
    tampered = tmp_path / "tampered"
    shutil.copytree(pruned, tampered)
    tensors = load_file(str(tampered / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][0, :16] = 0.5  # a full row of one 16×16 tile: 16 kept > N = 8
    save_file(tensors, str(tampered / "model.safetensors"), metadata={"format": "pt"})
    mismatched = tmp_path / "mismatched"
    shutil.copytree(pruned, mismatched)
    report = json.loads((mismatched / "tsenor_report.json").read_text())
    report["pattern"]["n"] = 4  # the report says 4:16, config.json and the zeros say 8:16
    (mismatched / "tsenor_report.json").write_text(json.dumps(report))
    cases = {
        "dense": (dense, 2, "dense checkpoint"),
        "no_report": (no_report, 3, "records no sparsity pattern"),
        "tampered": (tampered, 6, "contradict the recorded 8:16 (transposable) pattern"),
        "mismatched": (mismatched, 6, "record different patterns"),
        "missing": (tmp_path / "missing", 3, "does not exist"),
    }
    for label, (run_dir, code, words) in cases.items():
        out = tmp_path / f"out_{label}"
        result = invoke(["finetune", str(run_dir), "--output", str(out), "--data", str(text_file), "--ppl", "none"])
        message = str(result.exception)
        assert result.exit_code == code, (label, result.output)
        assert words in message and "\n" not in message and "; " in message, (label, message)
        assert not out.exists(), label
    assert "model.layers.1.mlp.up_proj" in str(invoke(["finetune", str(tampered), "-o", str(tmp_path / "x")]).exception)
    assert not (tmp_path / "x").exists()


@pytest.mark.realdata
def test_a_finetune_into_an_output_in_use_is_refused(pruned: Path, text_file: Path, tmp_path: Path) -> None:
    """finetune takes the same output lock as prune: a second writer gets one line, exit 4, nothing written."""
    from tsenor_cli.outputs import output_lock

    out = tmp_path / "ft"
    args = ["finetune", str(pruned), "--output", str(out), "--data", str(text_file), "--seqlen", "32"]
    with output_lock(out):  # another run holds it
        busy = invoke([*args, "--max-steps", "1", "--batch-size", "2", "--ppl", "none"])
    assert busy.exit_code == 4 and "is in use by another tsenor run" in str(busy.exception)
    assert not out.exists()


def test_the_command_of_a_finished_run_rerun_does_nothing(
    pruned: Path, text_file: Path, tmp_path: Path, data_ctx: RunContext
) -> None:
    """A batch job requeued after the final rename reruns its command: a finished run of the same settings is
    left as it is, exit 0 (it was refused as "already holds a tsenor run", exit 4), as a prune's is; other
    settings, or a source pruned again since, are still refused without --force."""
    from tsenor_cli.errors import OutputExistsError

    source = tmp_path / "source"
    shutil.copytree(pruned, source)
    out = tmp_path / "ft"
    first = finetune(_config(source, out, text_file), LOCAL_CTX)
    files = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}
    lines: list[str] = []
    again = finetune(_config(source, out, text_file, resume=True), LOCAL_CTX, lines.append)
    assert (again.steps, again.loss_curve) == (first.steps, first.loss_curve)
    assert {path.name: path.stat().st_mtime_ns for path in out.iterdir()} == files
    assert lines[-1] == f"{out} already holds this run, finished with the same settings; nothing to do"
    # The command's last line says so too (it said "wrote OUT in S s" over the untouched folder).
    assert summary(first).splitlines()[-1] == f"wrote {out} in {first.seconds:.1f} s"
    assert (
        summary(again).splitlines()[-1]
        == f"{out} already held this run (fine-tuned in {first.seconds:.1f} s); nothing written"
    )
    with pytest.raises(OutputExistsError):
        finetune(_config(source, out, text_file, max_steps=5), LOCAL_CTX)
    _magnitude_prune(pruned.parent / "src", source, 4, 8, data_ctx, calib_data="wikitext2", force=True)
    with pytest.raises(OutputExistsError):
        finetune(_config(source, out, text_file), LOCAL_CTX)


def test_two_torchrun_processes_train_as_one_with_their_batches_together(
    pruned: Path, text_file: Path, tmp_path: Path
) -> None:
    """`torchrun --nproc-per-node 2 -m tsenor_cli finetune` (Trainer's DDP, gloo on the CPU) against one
    process whose micro-batch holds both ranks' windows: the same loss curve, the same weights up to the
    order of the gradient sum, the mask held, the output written and reported once."""
    common = ["finetune", str(pruned), "--data", str(text_file), "--seqlen", "32", "--max-steps", "3",
              "--ppl", "none", "--save-every", "0", "--offline"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "tsenor_cli"]
    done = subprocess.run(
        [*launch, *common, "--batch-size", "2", "--output", str(tmp_path / "ddp")],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # The main process alone reports (both printed their summary and progress, the second's "wrote" false).
    assert done.stdout.count("wrote ") == 1 and done.stderr.count("training data:") == 1
    one = invoke([*common, "--batch-size", "4", "--output", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output
    ddp, single = (json.loads((tmp_path / name / "finetune.json").read_text()) for name in ("ddp", "one"))
    assert (ddp["world_size"], single["world_size"], ddp["tokens"]) == (2, 1, single["tokens"])
    assert [step for step, _ in ddp["loss_curve"]] == [1, 2, 3]
    for (_, a), (_, b) in zip(ddp["loss_curve"], single["loss_curve"], strict=True):
        assert a == pytest.approx(b, rel=1e-6)
    trained, alone = _weights(tmp_path / "ddp"), _weights(tmp_path / "one")
    assert max(float((trained[k] - alone[k]).abs().max()) for k in alone) < 1e-6
    _check_mask_kept(pruned, tmp_path / "ddp")


def test_c4_training_documents_are_not_the_c4_evaluation_documents(
    smollm2_path: Path, data_dir: Path, data_ctx: RunContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline, `eval --ppl c4` reads documents 0-499 of the C4 sample; training must read none of them."""
    from transformers import AutoTokenizer

    from tsenor_cli.data import sources
    from tsenor_cli.data.eval_text import eval_token_stream
    from tsenor_cli.finetune.data import training_windows

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    encoded: list[str] = []
    real_encode = sources.encode

    def spy(tok: object, text: str) -> torch.Tensor:
        encoded.append(text)
        return real_encode(tok, text)

    monkeypatch.setattr(sources, "encode", spy)
    eval_token_stream("c4", tokenizer, data_ctx, seqlen=64)
    (eval_text,) = encoded
    train = training_windows("c4", tokenizer, seqlen=64, windows=10**6, seed=0, ctx=data_ctx)
    assert train.documents is not None and len(train.documents) == 500  # all of them: far fewer tokens than asked
    assert train.windows.shape == (int(train.windows.numel()) // 64, 64) and train.windows.shape[0] > 1000
    assert not any(doc in eval_text for doc in train.documents)
    # The same test finds the evaluation documents: every document of the sample is in exactly one half.
    everything = sources.read_text_records(data_dir / sources.C4_SAMPLE)
    in_eval = [doc in eval_text for doc in everything]
    assert sum(in_eval) == sources.C4_EVAL_DOCS and set(everything) - set(train.documents) == {
        doc for doc, hit in zip(everything, in_eval, strict=True) if hit
    }


def test_training_windows_are_consecutive_pieces_of_the_document_stream(smollm2_path: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tsenor_cli.data.calibration import document_separator, shuffled_documents
    from tsenor_cli.data.sources import encode_documents
    from tsenor_cli.finetune.data import training_windows

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    docs = [f"Document number {i} says {'something ' * (i % 7 + 1)}." for i in range(200)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    stream = encode_documents(tokenizer, shuffled_documents(tuple(docs), 3), document_separator(tokenizer))
    text = training_windows(str(path), tokenizer, seqlen=16, windows=5, seed=3, ctx=LOCAL_CTX)
    assert torch.equal(text.windows, stream[:80].view(5, 16))  # only the documents the 5 windows need were read
    assert text.documents is not None and 0 < len(text.documents) < len(docs)
    everything = training_windows(str(path), tokenizer, seqlen=16, windows=10**6, seed=3, ctx=LOCAL_CTX)
    assert torch.equal(everything.windows.flatten(), stream[: everything.windows.numel()])
    assert everything.windows.numel() > stream.numel() - 16
    with pytest.raises(TsenorError, match="fewer than one window"):
        training_windows(str(path), tokenizer, seqlen=10**6, windows=1, seed=3, ctx=LOCAL_CTX)


def test_study_markdown_has_one_row_per_run_with_before_and_after() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_study", SCRIPTS / "finetune_study.py")
    assert spec is not None and spec.loader is not None
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    settings = {"max_steps": 200, "batch_size": 4, "grad_accum": 1, "seqlen": 512, "lr": 2e-5, "scheduler": "linear"}
    settings |= {"warmup": 20, "max_grad_norm": 1.0, "seed": 0, "bf16": False, "device": "cpu", "max_windows": 8}
    settings |= {"eval_every": 20}

    def record(pattern: str, kind: str, before: float, after: float) -> dict[str, object]:
        return {
            "settings": settings,
            "data": "offline C4 documents 500-999",
            "versions": {"torch": "2.13"},
            "pattern": {"pattern": pattern, "kind": kind},
            "steps": 200,
            "tokens": 409600,
            "epochs": 1.67,
            "seconds_per_step": 3.25,
            "loss_curve": [[1, 4.5], [200, 3.25]],
            "ppl_before": {"wikitext2": before},
            "ppl_after": {"wikitext2": after},
        }

    runs = {"transposable": record("16:32", "transposable", 45.1, 30.5), "ordinary": record("16:32", "nm", 36.0, 27.25)}
    text = study.render_markdown(runs, "scripts/finetune_study.py --run a=b")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    head = "| run | pattern | steps | tokens | passes | s/step | cross-entropy first → last | WT2 before"
    assert rows[0].startswith(head)
    assert (
        rows[1] == "| transposable | 16:32 transposable | 200 | 409600 | 1.67 | 3.25 | 4.500 → 3.250 | 45.10 → 30.50 |"
    )
    assert rows[2].endswith("| 36.00 → 27.25 |") and len(rows) == 3
    assert "(first 8 windows), every 20 steps" in text and "finetune_ppl_vs_steps.png" in text
    assert "loss: cross-entropy (no teacher)" in text and "dense" not in text
    # With a teacher the table shows the cross-entropy part, not the distillation loss; with the dense
    # model's perplexity, the share of the increase removed (by hand: (45.1 − 30.5) / (45.1 − 20) = 58.2%).
    settings |= {"teacher": "smollm2-135m", "distill_weight": 1.0, "distill_temperature": 1.0}
    for r in runs.values():
        r["ce_curve"] = [[1, 4.25], [200, 3.5]]
    text = study.render_markdown(runs, "cmd", dense={"wikitext2": 20.0})
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert "| 4.250 → 3.500 |" in rows[1] and "distillation from the dense smollm2-135m (weight 1" in text
    assert rows[-2] == "| transposable | 20.00, 45.10 → 30.50, 58.2% |"
    assert rows[-1] == "| ordinary | 20.00, 36.00 → 27.25, 54.7% |"
    assert "Perplexity ratio transposable/ordinary, before → after: WT2 1.253× → 1.119×." in text


def test_finetune_file_schema_errors_name_the_field() -> None:
    """A finetune.json with a broken curve or a missing field is one SchemaError line naming it."""
    good = {
        "schema_version": SCHEMA_VERSION,
        "settings": {},
        "run_dir": "r",
        "pattern": {},
        "data": "c4",
        "data_source": {},
        "windows": 1,
        "steps": 1,
        "tokens": 8,
        "epochs": 1.0,
        "world_size": 1,
        "loss_curve": [[1, 2.5]],
        "ppl_curve": {"wikitext2": [[0, 9]]},
        "eval_before": None,
        "eval_after": None,
        "pruned_nonzero": 0,
        "seconds": 1.0,
        "seconds_per_step": 1.0,
        "resumed_from_step": None,
        "output": "o",
        "command": None,
    }
    report = FinetuneReport.from_json(good)
    assert report.ppl_curve == {"wikitext2": [(0, 9.0)]} and report.schema_version == SCHEMA_VERSION
    with pytest.raises(SchemaError, match="loss_curve: expected a list of"):
        FinetuneReport.from_json({**good, "loss_curve": [[1]]})
    with pytest.raises(SchemaError, match="missing field 'steps'"):
        FinetuneReport.from_json({k: v for k, v in good.items() if k != "steps"})


# ---------------------------------------------------------------- distillation (--teacher)


def test_distillation_loss_by_hand() -> None:
    """Hand-worked values: KL with temperature, the cross-entropy part, the mix, and 0 for identical logits."""
    from tsenor_cli.finetune.distill import distillation_loss

    student = torch.tensor([[[0.0, 0.0, 0.0], [9.0, 9.0, 9.0]]])  # (1, 2, 3); the last position has no target
    teacher = torch.tensor([[[2.0 * torch.log(torch.tensor(3.0)), 0.0, 0.0], [0.0, 5.0, 1.0]]])
    ids = torch.tensor([[0, 1]])  # position 0 predicts token 1
    # At τ = 2 the teacher's first row is softmax(log 3, 0, 0) = (3/5, 1/5, 1/5), the student's uniform.
    p = torch.tensor([0.6, 0.2, 0.2])
    kl = float((p * (p / (1 / 3)).log()).sum())
    loss = distillation_loss(student, teacher, ids, weight=1.0, temperature=2.0)
    assert float(loss.kl) == pytest.approx(4.0 * kl, rel=1e-5)  # τ² · KL
    assert float(loss.ce) == pytest.approx(float(torch.log(torch.tensor(3.0))), rel=1e-6)
    assert float(loss.total) == pytest.approx(float(loss.kl), rel=1e-6)
    mixed = distillation_loss(student, teacher, ids, weight=0.25, temperature=2.0)
    assert float(mixed.total) == pytest.approx(0.25 * 4.0 * kl + 0.75 * float(loss.ce), rel=1e-5)
    logits = torch.randn(2, 5, 7, dtype=torch.bfloat16)
    same = distillation_loss(logits, logits.clone(), torch.randint(0, 7, (2, 5)), weight=1.0, temperature=1.0)
    assert same.total.dtype == torch.float32 and float(same.total) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(("weight", "temperature"), [(1.0, 1.0), (0.3, 2.0), (0.5, 1.0)])
def test_the_loss_by_chunks_equals_the_whole_logits_loss_with_its_gradients(
    weight: float, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`head_distillation_loss` (the output layer and the loss 3 positions at a time, the gradient in closed
    form) against `distillation_loss` of the whole logits under autograd: the three values, and the
    gradients of the hidden states, the head's weight and its bias."""
    from tsenor_cli.finetune import distill

    monkeypatch.setattr(distill, "CHUNK_BYTES", 4 * 11 * 3)  # 3 of the 16 positions a chunk
    assert distill.chunk_rows(11) == 3
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 5, generator=gen, requires_grad=True)  # (B, T, H)
    head_w = torch.randn(11, 5, generator=gen, requires_grad=True)  # (V, H)
    head_b = torch.randn(11, generator=gen, requires_grad=True)
    taught, teacher_w = torch.randn(2, 9, 5, generator=gen), torch.randn(11, 5, generator=gen)
    ids = torch.randint(0, 11, (2, 9), generator=gen)
    settings = {"weight": weight, "temperature": temperature}

    whole = distill.distillation_loss(hidden @ head_w.T + head_b, taught @ teacher_w.T, ids, **settings)
    expected = torch.autograd.grad(whole.total, (hidden, head_w, head_b))
    chunked = distill.head_distillation_loss(
        distill.LastHidden(hidden, distill.OutputHead(head_w, head_b)),
        distill.LastHidden(taught, distill.OutputHead(teacher_w, None)),
        ids,
        **settings,
    )
    got = torch.autograd.grad(chunked.total, (hidden, head_w, head_b))
    for name in ("total", "kl", "ce"):
        mine, theirs = getattr(chunked, name).detach(), getattr(whole, name).detach()
        assert float(mine) == pytest.approx(float(theirs), rel=1e-5), name
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert not chunked.kl.requires_grad and not chunked.ce.requires_grad
    # Under bf16 autocast both output layers' products run in bf16, as autocast runs a linear (the whole-logits
    # loss of bf16 products is the reference), the weight's gradient one product per group of 2 chunks.
    monkeypatch.setattr(distill, "GROUP_BYTES", 2 * 11 * 6)
    assert distill.group_rows(11, 3, 2) == 6

    def low_logits(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = (states.bfloat16() @ weight.bfloat16().T).float()
        return out + bias if bias is not None else out

    whole_low = distill.distillation_loss(
        low_logits(hidden, head_w, head_b), low_logits(taught, teacher_w), ids, **settings
    )
    expected_low = torch.autograd.grad(whole_low.total, (hidden, head_w, head_b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = distill.head_distillation_loss(
            distill.LastHidden(hidden, distill.OutputHead(head_w, head_b)),
            distill.LastHidden(taught, distill.OutputHead(teacher_w, None)),
            ids,
            **settings,
        )
    low_grads = torch.autograd.grad(low.total, (hidden, head_w, head_b))
    for name in ("total", "kl", "ce"):
        mine, theirs = getattr(low, name).detach(), getattr(whole_low, name).detach()
        assert float(mine) == pytest.approx(float(theirs), rel=1e-5), name
    assert float(low.total.detach()) != float(chunked.total.detach())  # the products did run in bf16
    for mine, theirs in zip(low_grads, expected_low, strict=True):
        # the weight's gradient: three group products each rounded to bf16, against one
        torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=1e-4)
    assert all(grad.dtype == torch.float32 for grad in low_grads)


def test_hidden_state_loss_by_hand() -> None:
    """SquareHead's term: the mean over the layers' outputs (the embeddings' entry is skipped) of
    ‖h_s − h_t‖² / ‖h_t‖²; 0 for the teacher's own states."""
    from tsenor_cli.finetune.distill import hidden_state_loss

    embedded = torch.zeros(1, 1, 2)
    teacher = [embedded, torch.tensor([[[3.0, 4.0]]]), torch.tensor([[[1.0, 0.0]]])]  # ‖·‖² 25 and 1
    student = [embedded + 7.0, torch.tensor([[[3.0, 9.0]]]), torch.tensor([[[1.0, 2.0]]])]  # errors 25 and 4
    assert float(hidden_state_loss(student, teacher)) == pytest.approx((25 / 25 + 4 / 1) / 2)
    assert float(hidden_state_loss(teacher, teacher)) == 0.0
    with pytest.raises(ValueError, match="2 student hidden states against 3"):
        hidden_state_loss(student[:2], teacher)


def test_a_model_whose_logits_are_not_its_output_layers_is_seen(tmp_path: Path) -> None:
    """`head_mismatch` on a tiny LLaMA: None as it is, in fp32 and in bf16; a reason once its logits are scaled
    after the output layer (as a soft cap would change them), or its output layer adds more than its bias,
    so the whole-logits loss is kept for it."""
    from transformers import AutoModelForCausalLM

    from tsenor_cli.finetune.distill import head_mismatch, last_hidden

    model = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "m"))
    vocab = model.config.vocab_size
    assert head_mismatch(model, vocab) is None
    with torch.no_grad(), last_hidden(model) as taken:
        out = model(input_ids=torch.tensor([[1, 2, 3]]))
    assert out.logits.shape == (1, 0, vocab) and taken[0].shape == (1, 3, model.config.hidden_size)

    def scaled(_module: nn.Module, _args: object, output: object) -> object:
        output.logits = output.logits * 2.0  # type: ignore[attr-defined]
        return output

    # bf16 (a --dtype bf16 teacher): the fp32 layer of the loss differs by bf16's rounding alone.
    assert head_mismatch(model.to(torch.bfloat16), vocab) is None
    model.to(torch.float32)
    hook = model.register_forward_hook(scaled)
    assert "differ from its output layer" in str(head_mismatch(model, vocab))
    hook.remove()

    def shifted(_module: nn.Module, _args: object, output: torch.Tensor) -> torch.Tensor:
        return output + 1.0  # a layer that adds more than its bias

    model.get_output_embeddings().register_forward_hook(shifted)
    assert "more than weight · hidden + bias" in str(head_mismatch(model, vocab))


@pytest.fixture(scope="module")
def teacher(pruned: Path, text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A teacher that knows the training text: `pruned` fine-tuned on it without a teacher (the random
    tiny model itself predicts nearly uniform logits, so its distance to any student is tiny)."""
    out = tmp_path_factory.mktemp("teacher") / "ft"
    finetune(_config(pruned, out, text_file, max_steps=6), LOCAL_CTX)
    return out


def test_distilling_keeps_the_mask_and_learns_from_the_teacher_alone(
    pruned: Path, teacher: Path, text_file: Path, tmp_path: Path
) -> None:
    """With --distill-weight 1 the labels are never used, yet the student's cross-entropy on the text the
    teacher learned falls: what it learns comes from the teacher's distributions."""
    out = tmp_path / "ft"
    report = finetune(_config(pruned, out, text_file, teacher=str(teacher), max_steps=6), LOCAL_CTX)
    _check_mask_kept(pruned, out)
    assert report.settings["teacher"] == str(teacher) and report.settings["distill_weight"] == 1.0
    assert [s for s, _ in report.ce_curve] == [s for s, _ in report.loss_curve] == [1, 2, 3, 4, 5, 6]
    kl, ce = [v for _, v in report.loss_curve], [v for _, v in report.ce_curve]
    assert kl[-1] < 0.5 * kl[0] and ce[-1] < ce[0] - 0.5, (kl, ce)  # measured: KL 0.096 → 0.020, CE 11.0 → 10.1
    assert FinetuneReport.from_json(report.to_json()).ce_curve == report.ce_curve
    plain = finetune(_config(pruned, tmp_path / "plain", text_file, max_steps=6), LOCAL_CTX)  # same windows
    assert plain.ce_curve == [] and report.ce_curve[0][1] == pytest.approx(plain.loss_curve[0][1], rel=1e-5)


def test_distilling_by_chunks_trains_as_the_whole_logits_do(
    pruned: Path, teacher: Path, text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same 3 steps with the loss by chunks (the default) and with the whole logits (as for a model whose
    logits `head_mismatch` rejects, which says so): the same loss curves and weights, to fp32 rounding."""
    from tsenor_cli.finetune import distill

    said: list[str] = []
    lines: list[str] = []
    settings = {"teacher": str(teacher), "max_steps": 3, "distill_weight": 0.5}
    chunked = finetune(_config(pruned, tmp_path / "chunked", text_file, **settings), LOCAL_CTX, progress=said.append)
    assert not any("whole logits" in line for line in said)
    monkeypatch.setattr(distill, "head_mismatch", lambda _model, _vocab: "a test's reason")
    whole = finetune(_config(pruned, tmp_path / "whole", text_file, **settings), LOCAL_CTX, progress=lines.append)
    assert "distillation forms the whole logits of every batch: a test's reason" in lines
    for mine, theirs in ((chunked.loss_curve, whole.loss_curve), (chunked.ce_curve, whole.ce_curve)):
        assert [s for s, _ in mine] == [s for s, _ in theirs] == [1, 2, 3]
        assert [v for _, v in mine] == pytest.approx([v for _, v in theirs], rel=1e-4)
    # AdamW divides each gradient by its own running size, so an entry whose gradient is near 0 turns fp32
    # rounding into up to a step of lr (1e-2) in either direction; measured: 1 entry of 4096 off by 9.5e-5.
    ours, reference = _weights(tmp_path / "chunked"), _weights(tmp_path / "whole")
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-3)
        assert float((ours[name] - tensor).abs().gt(1e-5).float().mean()) < 0.01, name


def test_a_bf16_distillation_runs_its_loss_under_the_training_autocast(
    pruned: Path, teacher: Path, text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """accelerate puts bf16 autocast around the model's forward alone; the loss by chunks runs under it too
    (its output layers' products in bf16, as the whole-logits loss takes them from the forward), and not in
    an fp32 run. The bf16 loss curve is the whole-logits one to bf16's rounding."""
    from tsenor_cli.finetune import distill

    seen: list[object] = []
    loss_by_chunks = distill.head_distillation_loss

    def watched(*args: Any, **kwargs: Any) -> distill.DistillLoss:
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return loss_by_chunks(*args, **kwargs)

    monkeypatch.setattr(distill, "head_distillation_loss", watched)
    settings = {"teacher": str(teacher), "max_steps": 2}
    low = finetune(_config(pruned, tmp_path / "bf16", text_file, dtype="bf16", **settings), LOCAL_CTX)
    assert seen == [torch.bfloat16, torch.bfloat16]
    finetune(_config(pruned, tmp_path / "fp32", text_file, **settings), LOCAL_CTX)
    assert seen[2:] == [None, None]
    monkeypatch.setattr(distill, "head_mismatch", lambda _model, _vocab: "a test's reason")
    whole = finetune(_config(pruned, tmp_path / "whole", text_file, dtype="bf16", **settings), LOCAL_CTX)
    assert len(seen) == 4  # the whole-logits loss takes its logits from the forward
    assert [v for _, v in low.loss_curve] == pytest.approx([v for _, v in whole.loss_curve], rel=2e-2)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_freeze_embeddings_keeps_the_embeddings_and_the_output_layer_bit_for_bit(
    pruned: Path, teacher: Path, text_file: Path, tmp_path: Path, dtype: str
) -> None:
    """--freeze-embeddings: the input embeddings and the output layer (found through transformers'
    get_input_embeddings/get_output_embeddings) come out bit for bit; the decoder blocks train, their masks
    held; the setting is in the report and the resume key, and a run without it keeps its old key."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ft"
    cfg = _config(pruned, out, text_file, teacher=str(teacher), freeze_embeddings=True, dtype=dtype)
    report = finetune(cfg, LOCAL_CTX)
    _check_mask_kept(pruned, out)
    before, after = _weights(pruned), _weights(out)
    model = AutoModelForCausalLM.from_pretrained(pruned)
    fixed = {
        name
        for layer in (model.get_input_embeddings(), model.get_output_embeddings())
        for name, _ in layer.named_parameters(prefix=_module_name(model, layer))
    }
    assert fixed & set(after)  # a tied output layer is stored once, as the embeddings
    for name in after:
        assert torch.equal(after[name], before[name]) == (name in fixed), name
    assert report.settings["freeze_embeddings"] is True
    assert "freeze_embeddings" not in dataclasses.replace(cfg, freeze_embeddings=False).result_fields()


def test_freeze_embeddings_on_a_model_that_names_no_embeddings_is_one_line(
    pruned: Path, text_file: Path, tmp_path: Path
) -> None:
    """A model whose get_input_embeddings/get_output_embeddings name nothing (transformers raises
    NotImplementedError) gets a UsageError naming the flag, not a traceback; without the flag nothing is frozen."""
    from tsenor_cli.finetune.plan import frozen_parameters

    class Bare(nn.Module):
        def get_input_embeddings(self) -> nn.Module:
            raise NotImplementedError

        def get_output_embeddings(self) -> None:
            return None

    cfg = _config(pruned, tmp_path / "ft", text_file, freeze_embeddings=True)
    with pytest.raises(TsenorError, match="--freeze-embeddings: Bare names no input embeddings"):
        frozen_parameters(Bare(), cfg)
    assert frozen_parameters(Bare(), dataclasses.replace(cfg, freeze_embeddings=False)) == []


def _module_name(model: nn.Module, layer: nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is layer)


def test_the_hidden_state_term_adds_to_the_loss_and_trains(
    pruned: Path, teacher: Path, text_file: Path, tmp_path: Path
) -> None:
    """--distill-hidden 1: the first step's loss is the plain distillation loss plus the (positive)
    hidden-state term on the same windows, its cross-entropy part the same; the mask holds."""
    settings = {"teacher": str(teacher), "max_steps": 6}
    plain = finetune(_config(pruned, tmp_path / "plain", text_file, **settings), LOCAL_CTX)
    out = tmp_path / "hidden"
    both = finetune(_config(pruned, out, text_file, distill_hidden=1.0, **settings), LOCAL_CTX)
    _check_mask_kept(pruned, out)
    assert both.settings["distill_hidden"] == 1.0 and plain.settings["distill_hidden"] == 0.0
    assert both.ce_curve[0][1] == pytest.approx(plain.ce_curve[0][1], rel=1e-6)
    assert both.loss_curve[0][1] > plain.loss_curve[0][1] + 1e-3
    assert both.loss_curve[-1][1] < 0.5 * both.loss_curve[0][1], both.loss_curve


def test_distillation_loss_is_the_same_with_gradient_accumulation(
    pruned: Path, teacher: Path, text_file: Path, tmp_path: Path
) -> None:
    """2 windows in one micro-batch and 2 micro-batches of 1 see the same windows at step 1: same loss."""
    one = finetune(_config(pruned, tmp_path / "a", text_file, teacher=str(teacher), max_steps=1), LOCAL_CTX)
    two = finetune(
        _config(pruned, tmp_path / "b", text_file, teacher=str(teacher), max_steps=1, batch_size=1, grad_accum=2),
        LOCAL_CTX,
    )
    assert two.loss_curve[0][1] == pytest.approx(one.loss_curve[0][1], rel=1e-5)
    assert two.ce_curve[0][1] == pytest.approx(one.ce_curve[0][1], rel=1e-5)


def test_bad_teacher_settings_get_one_line_errors_and_nothing_written(
    pruned: Path, text_file: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    other_vocab = make_tiny_llama(tmp_path / "other_vocab", vocab_size=50000)
    other_tokenizer = tmp_path / "other_tokenizer"
    shutil.copytree(pruned.parent / "src", other_tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(other_tokenizer)
    tokenizer.add_tokens(["<tsenor-extra>"])  # same logits count, one id means something else
    tokenizer.save_pretrained(other_tokenizer)
    base = ["finetune", str(pruned), "--data", str(text_file), "--seqlen", "32", "--ppl", "none", "--max-steps", "1"]
    cases = {
        "logits": (["--teacher", str(other_vocab)], 2, "50000 output logits"),
        "tokenizer": (["--teacher", str(other_tokenizer)], 2, "different tokenizer"),
        "missing": (["--teacher", str(tmp_path / "nowhere")], 3, "does not exist"),
        "weight_without_teacher": (["--distill-weight", "0.5"], 2, "need --teacher"),
        "hidden_without_teacher": (["--distill-hidden", "1"], 2, "need --teacher"),
        "hidden_negative": (["--teacher", str(pruned.parent / "src"), "--distill-hidden", "-1"], 2, "--distill-hidden"),
        "weight_zero": (["--teacher", str(pruned.parent / "src"), "--distill-weight", "0"], 2, "must be in (0, 1]"),
        "temperature": (["--teacher", str(pruned.parent / "src"), "--distill-temperature", "-1"], 2, "positive"),
    }
    for label, (extra, code, words) in cases.items():
        out = tmp_path / f"out_{label}"
        result = invoke([*base, "--output", str(out), *extra])
        message = str(result.exception)
        assert result.exit_code == code, (label, result.output)
        assert words in message and "\n" not in message and "; " in message, (label, message)
        assert not out.exists(), label


# ---- issue 30: signals and the evaluation before fine-tuning --------------------------------------------


def _stop_at(line_start: str, stop: StopRequest, signal_name: str | None = None) -> Callable[[str], None]:
    """A progress sink that asks the run to stop (`signal_name`, or Ctrl-C when None) at the first line
    starting with `line_start`: a signal arriving while the run is there."""

    def say(message: str) -> None:
        if message.startswith(line_start):
            if signal_name is None:
                raise KeyboardInterrupt
            stop.request(signal_name)

    return say


def test_a_stop_signal_saves_the_step_and_ctrl_c_says_what_was_saved(
    pruned: Path, text_file: Path, tmp_path: Path
) -> None:
    """SIGTERM while training (as `stop_on_signals` records it): the step in hand finishes, a checkpoint
    of it is saved, one line says so (exit 75), and --resume continues to the weights of an uninterrupted
    run. Ctrl-C stops at once and names the last checkpoint (exit 130); with --save-every 0 nothing."""
    full = finetune(_config(pruned, tmp_path / "full", text_file, save_every=100), LOCAL_CTX)
    out = tmp_path / "stopped"
    stop = StopRequest()
    with pytest.raises(Interrupted) as stopped:
        # Requested during step 2 (its line is logged after step 1): training stops once step 2 is done.
        finetune(
            _config(pruned, out, text_file, save_every=100), LOCAL_CTX, _stop_at("step 1/4", stop, "SIGTERM"), stop=stop
        )
    state = out / RESUME_DIR
    assert stopped.value.exit_code == 75
    assert str(stopped.value) == (
        f"stopped by SIGTERM after step 2/4; the resume state holds step 2 ({state / 'checkpoint-2'}): rerun "
        "the same command with --resume to continue"
    )
    resumed = finetune(_config(pruned, out, text_file, save_every=100, resume=True), LOCAL_CTX)
    assert resumed.resumed_from_step == 2 and resumed.loss_curve == full.loss_curve
    assert _weights_hash(out) == _weights_hash(tmp_path / "full")

    out = tmp_path / "ctrl-c"
    with pytest.raises(Interrupted) as interrupted:
        finetune(_config(pruned, out, text_file, save_every=2), LOCAL_CTX, _stop_at("step 3/4", StopRequest()))
    assert interrupted.value.exit_code == 130
    assert str(interrupted.value) == (
        f"interrupted at step 4/4; the resume state holds step 2 ({out / RESUME_DIR / 'checkpoint-2'}): "
        "rerun the same command with --resume to continue"
    )
    with pytest.raises(Interrupted) as nothing:
        finetune(_config(pruned, tmp_path / "none", text_file), LOCAL_CTX, _stop_at("step 1/4", StopRequest()))
    assert str(nothing.value) == "interrupted at step 2/4; nothing was saved (--save-every 0): rerunning starts over"
    assert not (tmp_path / "none").exists()


@pytest.mark.realdata
def test_a_stop_signal_during_an_evaluation_stops_at_once(
    pruned: Path, text_file: Path, tmp_path: Path, data_ctx: RunContext
) -> None:
    """An evaluation has no safe point and would outlast the scheduler's grace period: a stop signal during
    it stops the run at once (exit 75), saying what was saved."""
    stop = StopRequest()
    out = tmp_path / "ft"
    cfg = _config(pruned, out, text_file, ppl_datasets=("wikitext2",), max_windows=2, save_every=2)
    with pytest.raises(Interrupted) as stopped:
        finetune(cfg, data_ctx, _stop_at("wikitext2: window 1/2", stop, "SIGTERM"), stop=stop)
    assert stopped.value.exit_code == 75
    assert str(stopped.value) == (
        "stopped by SIGTERM while evaluating the checkpoint before fine-tuning; nothing was saved: rerunning "
        "starts over"
    )


@pytest.mark.slow
def test_sigterm_to_a_real_finetune_saves_the_step_and_resume_continues(
    pruned: Path, text_file: Path, tmp_path: Path
) -> None:
    """`tsenor finetune` used to die silently on SIGTERM: now it finishes the step in hand, saves it, prints
    one line and exits 75; the same command with --resume continues from that step."""
    out = tmp_path / "ft"
    args = ["finetune", str(pruned), "--output", str(out), "--data", str(text_file), "--seqlen", "32"]
    args += ["--max-steps", "300", "--batch-size", "2", "--ppl", "none", "--save-every", "1000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tsenor_cli", *args], stderr=subprocess.PIPE, text=True, env={**os.environ}
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("step 3/300"):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 75, rest
    last = rest.strip().splitlines()[-1]
    match = re.fullmatch(
        r"stopped by SIGTERM after step (\d+)/300; the resume state holds step (\d+) \((.*)\): rerun the same "
        r"command with --resume to continue",
        last,
    )
    assert match is not None and match[1] == match[2] and Path(match[3]).is_dir(), last
    result = invoke([*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "finetune.json").read_text())["resumed_from_step"] == int(match[1])


@pytest.mark.realdata
def test_the_prunes_own_evaluation_is_reused_as_before_when_its_settings_match(
    pruned: Path, text_file: Path, tmp_path: Path, data_ctx: RunContext
) -> None:
    """RUN_DIR/eval.json of the same evaluation (datasets, windows, window length, float32, device kind)
    is the "before" of fine-tuning instead of evaluating again, and gives what the evaluation gives;
    other settings, or weights written since it, evaluate again, with an estimate of how long it takes."""
    run = tmp_path / "run"
    shutil.copytree(pruned, run)
    evaluated = invoke(["eval", "--model", str(run), "--ppl", "wikitext2", "--max-windows", "1", "--output", str(run)])
    assert evaluated.exit_code == 0, evaluated.output

    def run_finetune(name: str, max_windows: int) -> tuple[FinetuneReport, list[str]]:
        said: list[str] = []
        cfg = _config(
            run, tmp_path / name, text_file, max_steps=1, ppl_datasets=("wikitext2",), max_windows=max_windows
        )
        return finetune(cfg, data_ctx, said.append), said

    reused, said = run_finetune("reused", 1)
    assert (
        f"evaluation before fine-tuning: {run / 'eval.json'} (the same evaluation of this checkpoint), not run again"
        in said
    )
    assert not any(line.startswith("evaluating the pruned checkpoint") for line in said)
    other, said = run_finetune("other", 2)  # another window count: evaluated
    assert any(line.startswith("evaluating the pruned checkpoint before fine-tuning") for line in said)
    assert "perplexity: 2 windows of 512 tokens (wikitext2 2)" in said
    estimate = (
        r"wikitext2: window 1/2 took [0-9.]+ s; the perplexity evaluation takes about [0-9.]+ (s|min|h) \(2 windows; .*"
    )
    assert any(re.fullmatch(estimate, line) for line in said), said
    assert other.eval_before is not None and other.eval_before["max_windows"] == 2
    (run / "model.safetensors").touch()  # the weights written since the evaluation: it is not theirs
    fresh, said = run_finetune("fresh", 1)
    assert any(line.startswith("evaluating the pruned checkpoint before fine-tuning") for line in said)
    assert reused.ppl("before") == fresh.ppl("before")  # the reused number is the one evaluation gives


# ---- `--data calibration`: the prune's own calibration windows (issue 49) -----------------------------------


class _FirstInputs(BlockHook):
    """A block hook that keeps block 0's calibration inputs (the embedded tokens, for a LLaMA)."""

    def __init__(self) -> None:
        self.inputs: torch.Tensor | None = None

    def before(self, block: BlockContext) -> None:
        if block.index == 0:
            self.inputs = block.inputs.detach().clone()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory, calibration_text: Path) -> tuple[Path, torch.Tensor]:
    """A tiny LLaMA pruned by the shared SparseGPT test prune (it reads data: 4 windows of 32 tokens of a
    file) with seed 1; and the hidden states its block 0 received (the embedded calibration tokens)."""
    root = tmp_path_factory.mktemp("calibrated")
    cfg = sparsegpt_config(make_tiny_llama(root / "src"), calibration_text, root / "pruned", seed=1)
    first = _FirstInputs()
    prune_model(cfg, LOCAL_CTX, hooks=[first])
    assert first.inputs is not None
    return root / "pruned", first.inputs


def test_calibration_windows_are_the_tokens_the_prune_read(calibrated: tuple[Path, torch.Tensor]) -> None:
    """Embedding the windows `--data calibration` trains on gives exactly block 0's calibration inputs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tsenor_cli.finetune.data import calibration_windows
    from tsenor_cli.finetune.masks import read_run_sparsity

    run, first_inputs = calibrated
    report = read_run_sparsity(run).report
    text = calibration_windows(report, AutoTokenizer.from_pretrained(run), ctx=LOCAL_CTX)
    assert tuple(text.windows.shape) == (4, 32)
    assert text.description == f"the prune's calibration windows: {report.calibration}"
    dense = AutoModelForCausalLM.from_pretrained(run.parent / "src")
    with torch.no_grad():
        embedded = dense.get_input_embeddings()(text.windows)
    assert torch.equal(embedded, first_inputs.to(embedded.dtype))


def test_finetune_on_calibration_trains_on_the_prunes_windows(
    calibrated: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    run, _ = calibrated
    out = tmp_path / "ft"
    args = ["finetune", str(run), "--output", str(out), "--data", "calibration", "--max-steps", "4"]
    args += ["--batch-size", "2", "--lr", "1e-2", "--ppl", "none", "--save-every", "0"]
    args += ["--teacher", str(run.parent / "src")]
    result = invoke([*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "finetune.json").read_text())
    # 4 windows of the prune's 32 tokens (not --seqlen's default 512), read twice by 4 steps of 2
    assert report["windows"] == 4 and report["tokens"] == 4 * 2 * 32 and report["epochs"] == 2.0
    assert report["data"].startswith("the prune's calibration windows: ")
    assert report["settings"]["data"] == "calibration"
    assert verify_checkpoint(out).ok


def test_bad_calibration_data_gets_one_line_errors_and_nothing_written(
    calibrated: tuple[Path, torch.Tensor], pruned: Path, tmp_path: Path
) -> None:
    run, _ = calibrated
    moved = tmp_path / "moved"  # the report names calibration text other than what the file gives now
    shutil.copytree(run, moved)
    report = json.loads((moved / "tsenor_report.json").read_text())
    report["calibration"] = report["calibration"].replace("4 random", "8 random")
    (moved / "tsenor_report.json").write_text(json.dumps(report))
    edited = tmp_path / "edited"  # the file the prune read has other bytes now
    shutil.copytree(run, edited)
    report = json.loads((edited / "tsenor_report.json").read_text())
    report["calibration_source"]["files"][0]["sha256"] = "0" * 64
    (edited / "tsenor_report.json").write_text(json.dumps(report))
    cases = {
        "seqlen": (run, ["--seqlen", "32"], "does not apply to --data calibration"),
        "stand_in": (pruned, [], "read no calibration text"),
        "other_text": (moved, [], "but the prune calibrated on"),
        "other_bytes": (edited, [], "changed since the prune read it"),
    }
    for label, (folder, extra, words) in cases.items():
        out = tmp_path / f"out_{label}"
        args = ["finetune", str(folder), "--output", str(out), "--data", "calibration", "--ppl", "none", *extra]
        result = invoke([*args, "--max-steps", "1"])
        message = str(result.exception)
        assert result.exit_code == 2, (label, result.output)
        assert words in message and "\n" not in message, (label, message)
        assert not out.exists(), label


def _storage_bytes_of_a_real_forward(model: nn.Module, ids: torch.Tensor) -> int:
    """The storages a real CPU forward with the model's own loss keeps for backward, each once, its
    parameters' excepted: what `finetune.plan.saved_bytes` stands for, counted without its watch."""
    own = {id(p.untyped_storage()) for p in model.parameters()}
    kept: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if id(storage) not in own:
            kept.setdefault(id(storage), storage)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(storage.nbytes() for storage in kept.values())


def test_the_plan_sees_on_the_meta_device_what_a_real_forward_keeps(tmp_path: Path) -> None:
    """`saved_bytes` on the meta device (where SDPA runs its math path, counted as the fused kernels keep
    it) against the storages a real CPU forward keeps for backward: equal to the byte, at three sizes, and
    linear in the tokens (no (T, T) probabilities counted)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tsenor_cli.finetune.plan import saved_bytes

    src = make_tiny_llama(tmp_path / "m")
    real = AutoModelForCausalLM.from_pretrained(src).train()
    config = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config).train()
    for batch, seqlen in ((2, 64), (2, 128), (4, 128)):
        actual = _storage_bytes_of_a_real_forward(real, torch.randint(0, config.vocab_size, (batch, seqlen)))
        watched = saved_bytes(meta, batch, seqlen, distill=False)
        assert watched.saved == actual, (batch, seqlen, watched, actual)
        linears = {id(p): p.numel() for m in real.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
        assert watched.cast == sum(linears.values())  # what bf16 autocast copies: the linears' parameters
    at = {n: saved_bytes(meta, 2, n, distill=True).saved for n in (64, 128, 256)}
    assert at[256] - at[128] == 2 * (at[128] - at[64])  # linear in the tokens


@pytest.mark.parametrize(
    ("model_type", "experts"),
    [
        ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16}),
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ],
)
def test_the_plan_watches_fused_expert_stacks_as_a_real_forward_keeps_them(
    model_type: str, experts: dict[str, Any], tmp_path: Path
) -> None:
    """torch's meta kernel of the grouped expert product takes bf16 only: the plan of every fused-experts
    MoE said "activations not estimated" and left them out of the memory it checks. Watched with the stacks
    in bf16 and counted at float32's width, it equals a real CPU forward's storages to the byte."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tsenor_cli.finetune.plan import saved_bytes

    src = make_tiny_llama(tmp_path / "m", model_type=model_type, num_layers=2, **experts)
    real = AutoModelForCausalLM.from_pretrained(src).train()
    config = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config).train()
    assert any(p.dim() == 3 for p in meta.parameters())  # the experts are fused stacks
    for batch, seqlen in ((2, 64), (4, 128)):
        actual = _storage_bytes_of_a_real_forward(real, torch.randint(0, config.vocab_size, (batch, seqlen)))
        assert saved_bytes(meta, batch, seqlen, distill=False).saved == actual, (batch, seqlen)
    assert all(p.dtype == torch.float32 for p in meta.parameters())  # the stacks given back as they were


def test_the_training_estimate_by_hand() -> None:
    """`training_estimate`'s terms from a workload worked by hand: float32 weights, gradients and two AdamW
    moments a parameter, the teacher at its width, a byte a pruned weight, autocast's bf16 copies, and the
    distillation loss's chunks beside its two gradients (under bf16 its gradient group and bf16 copies too)."""
    from tsenor_cli.pruning.block.memory import LOSS_CHUNKS, TRAINING_SLACK, TrainingWorkload, training_estimate

    work = TrainingWorkload(
        params=1000, pruned=300, teacher=1000, teacher_width=2, saved=5000, cast=600, tokens=8, vocab=50,
        hidden=4, chunk=100,
    )  # fmt: skip
    est = training_estimate(work)
    assert (est.weights, est.gradients, est.optimizer, est.teacher, est.masks) == (4000, 4000, 8000, 2000, 300)
    assert est.activations == 5000 + 1200
    assert est.loss == LOSS_CHUNKS * 100 + 4 * (8 + 50) * 4
    assert est.allocator == round(TRAINING_SLACK * 6200)
    assert est.total == 4000 + 4000 + 8000 + 2000 + 300 + 6200 + est.loss + est.allocator
    plain = training_estimate(dataclasses.replace(work, teacher=0, chunk=0, cast=0))
    assert (plain.teacher, plain.loss, plain.activations) == (0, 0, 5000)
    # bf16: the gradient group, and the bf16 copies of the layer, of a group's product and of the states
    low = training_estimate(dataclasses.replace(work, group=300))
    frozen = training_estimate(dataclasses.replace(work, frozen=200))  # no gradient, no moments for those
    assert (frozen.weights, frozen.gradients, frozen.optimizer) == (4000, 3200, 6400)
    assert low.loss == est.loss + 300 + 2 * (50 * 4 + 50 * 4 + 8 * 4)


def test_finetune_dry_run_prints_the_plan_writes_nothing_and_refuses_what_cannot_fit(
    pruned: Path, text_file: Path, tmp_path: Path
) -> None:
    """`tsenor finetune --dry-run`: the plan as text and JSON, its sum the estimate's, nothing written; a
    micro-batch that cannot fit ends as the run would, exit 5 with one line, before anything is read."""
    out = tmp_path / "ft"
    args = ["finetune", str(pruned), "--output", str(out), "--data", str(text_file), "--seqlen", "32"]
    text = invoke([*args, "--dry-run", "--teacher", str(pruned)])
    assert text.exit_code == 0, text.output
    assert "fine-tuning plan" in text.output and "distillation loss" in text.output and "peak about" in text.output
    plan = json.loads(invoke([*args, "--dry-run", "--json"]).output)
    memory = plan["memory"]
    assert memory["total"] == sum(memory[k] for k in ("weights", "gradients", "optimizer", "teacher", "masks",
                                                      "activations", "loss", "allocator"))  # fmt: skip
    assert plan["fits"] and plan["batch"] == 4 and plan["seqlen"] == 32 and memory["teacher"] == 0
    assert memory["weights"] == 4 * plan["params"] and memory["masks"] == plan["pruned"] > 0
    assert not out.exists()
    huge = invoke([*args, "--batch-size", "100000000", "--dry-run"])
    assert huge.exit_code == 5 and "pass a smaller --batch-size" in str(huge.exception)
    refused = invoke([*args, "--batch-size", "100000000", "--max-steps", "1"])
    assert refused.exit_code == 5 and not out.exists()


def test_finetune_in_bf16_on_a_cpu_without_bf16_instructions_says_so(
    pruned: Path, text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an AVX2 CPU bf16 autocast makes a step several times slower than fp32 (`tsenor_cli/precision.py`):
    the plan says so, naming both commands' flags; in fp32, or on a CPU with the instructions, nothing."""
    from tsenor_cli import precision

    args = ["finetune", str(pruned), "--output", str(tmp_path / "ft"), "--data", str(text_file), "--seqlen", "32",
            "--dry-run"]  # fmt: skip
    for flags, dtype, said in ((frozenset({"avx2"}), "bf16", True), (frozenset({"avx2"}), "fp32", False),
                               (frozenset({"avx2", "amx_bf16"}), "bf16", False)):  # fmt: skip
        monkeypatch.setattr(precision, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(precision, "_warned", set())
        result = invoke([*args, "--dtype", dtype])
        assert result.exit_code == 0, result.output
        line = "training under bf16 autocast: this CPU has no bf16 matrix instructions"
        assert (line in result.stderr) is said, result.stderr
        assert (
            not said or "pass --dtype fp32 to tsenor finetune (--distill-dtype fp32 to tsenor prune)" in result.stderr
        )


def test_the_plan_of_a_model_whose_forward_cannot_run_on_the_meta_device_says_so(
    tmp_path: Path, data_ctx: RunContext
) -> None:
    """A tiny Mixtral pruned by magnitude: its fused experts' grouped products have no meta kernel in this
    transformers, so the plan either counts its activations or names why it could not, and leaves them out
    of the total, never a silent zero."""
    source = make_tiny_llama(tmp_path / "src", model_type="mixtral", num_layers=1, num_local_experts=4,
                             num_experts_per_tok=2)  # fmt: skip
    pruned = _magnitude_prune(source, tmp_path / "pruned", 8, 16, data_ctx)
    from tsenor_cli.finetune.plan import plan_finetune

    plan = plan_finetune(FinetuneConfig(run_dir=pruned, output=tmp_path / "ft", seqlen=16, batch_size=2), data_ctx)
    if plan.unwatched is None:
        assert plan.estimate.activations > 0
    else:
        assert plan.estimate.activations == 0 and plan.work.saved == 0
        assert "activations not estimated" in plan.summary()[0] and plan.unwatched in plan.summary()[0]
        assert json.loads(json.dumps(plan.to_dict()))["activations_unwatched"] == plan.unwatched


@pytest.fixture(scope="module")
def pruned_moe(tmp_path_factory: pytest.TempPathFactory, data_ctx: RunContext) -> Path:
    """A tiny Mixtral (transformers' fused experts: one (E, 2I, H) and one (E, H, I) parameter per block)
    pruned to transposable 2:4 by magnitude."""
    root = tmp_path_factory.mktemp("finetune-moe")
    src = make_tiny_llama(root / "src", model_type="mixtral", num_layers=1, num_local_experts=4,
                          num_experts_per_tok=2)  # fmt: skip
    return _magnitude_prune(src, root / "pruned", 2, 4, data_ctx)


def test_finetune_of_a_model_with_fused_experts_keeps_each_expert_s_mask(
    pruned_moe: Path, text_file: Path, tmp_path: Path
) -> None:
    """The stacks' pruned matrices stay exactly 0 and their kept weights train (once refused: the masks
    were looked up as `<module>.weight`, which a stack of experts is not)."""
    record = read_sparsity(pruned_moe)
    assert record is not None and any(entry.expert is not None for entry in record.pruned)
    out = tmp_path / "ft"
    finetune(_config(pruned_moe, out, text_file), LOCAL_CTX)
    before, after = _weights(pruned_moe), _weights(out)
    stacks = sorted({entry.param for entry in record.pruned if entry.expert is not None})
    assert stacks and all(key in before for key in stacks)
    for key in stacks:
        zero = before[key] == 0
        assert 0.45 < float(zero.float().mean()) < 0.55
        assert int(after[key][zero].count_nonzero()) == 0, key
        assert float((after[key][~zero] != before[key][~zero]).float().mean()) > 0.9, key
    assert verify_checkpoint(out).ok


def test_an_expert_the_prune_left_dense_is_not_masked(pruned_moe: Path) -> None:
    """Of a stack, only the recorded experts' matrices are masked: an expert the run left dense (no
    calibration token reached it) keeps its zeros free to train."""
    from transformers import AutoModelForCausalLM

    from tsenor_cli.finetune.masks import pruned_masks, read_run_sparsity

    sparsity = read_run_sparsity(pruned_moe)
    stack = next(entry.param for entry in sparsity.record.pruned if entry.expert is not None)
    kept = tuple(e for e in sparsity.record.pruned if e.param != stack or e.expert in (0, 2))
    partial = dataclasses.replace(sparsity, record=dataclasses.replace(sparsity.record, pruned=kept))
    model = AutoModelForCausalLM.from_pretrained(pruned_moe)
    weight = model.get_parameter(stack).detach()
    with torch.no_grad():
        weight[1].zero_()  # zeros in a dense expert: not pruned positions
    mask = pruned_masks(model, partial)[stack]
    assert mask.shape == weight.shape and mask.dtype == torch.bool
    assert torch.equal(mask[[0, 2]], weight[[0, 2]] == 0) and not mask[[1, 3]].any()

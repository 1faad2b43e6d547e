"""Multimodal models and mixed block lists on tiny random checkpoints built offline (`helpers_tiny.MULTIMODAL`).

Gemma-3, LLaVA, Qwen2-VL, Qwen2.5-VL, Idefics3, SmolVLM and Mllama (a vision tower, a projector and a
text decoder) load whole with their own class; the engine finds their language model, calibrates it
on text alone and prunes its blocks, while the vision tower and projector stay dense. Jamba (Mamba and
attention blocks) and Mllama (self- and cross-attention blocks) keep blocks of several classes in one
list; Mllama's cross-attention block, which its text-only forward skips, is pruned from the text that
reaches it where its own forward gets, else by magnitude (`pruning/block/idle.py`). For each: the
replayed blocks give the whole model's logits, a 2-block SparseGPT 2:4 prune verifies, loads with the
source's class and generates, and `tsenor eval --ppl` runs on it. Block refinement trains the language
model's blocks that run on text and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import (
    LOCAL_CTX,
    MULTIMODAL,
    PROCESSOR_FILE,
    blockwise_forward,
    full_forward,
    make_tiny_model,
    random_model,
)
from safetensors.torch import load_file
from torch import nn

from tsenor_cli.errors import IncompatibleModelError
from tsenor_cli.models.loading import (
    LoadedModel,
    auto_class,
    config_value,
    embedding_rows,
    load_model,
    meta_model,
    processor_files,
)
from tsenor_cli.models.structure import discover_structure
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block.idle import MAGNITUDE_REASON, TEXT_REASON
from tsenor_cli.pruning.block.outside import OUTSIDE_BLOCK
from tsenor_cli.pruning.block.outside import REASON as OUTSIDE_REASON
from tsenor_cli.pruning.methods import magnitude
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.run.verify import verify_checkpoint
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.replay import BlockCall, capture_block_calls, capture_block_inputs, run_block
from tsenor_cli.runfiles import PruneReport

FAMILIES = sorted(MULTIMODAL)
# model_type → (the language model, the modules outside it that stay dense), as dotted names in the model.
LANGUAGE_MODELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gemma3": ("model.language_model", ("model.vision_tower", "model.multi_modal_projector")),
    "llava": ("model.language_model", ("model.vision_tower", "model.multi_modal_projector")),
    "qwen2_vl": ("model.language_model", ("model.visual",)),
    "qwen2_5_vl": ("model.language_model", ("model.visual",)),
    "idefics3": ("model.text_model", ("model.vision_model", "model.connector")),
    "smolvlm": ("model.text_model", ("model.vision_model", "model.connector")),
    "mllama": ("model.language_model", ("model.vision_model", "model.multi_modal_projector")),
    "jamba": ("model", ()),
}
# The blocks each text-only forward skips: Mllama's cross-attention block (its config's cross_attention_layers).
IDLE = {"mllama": {1}}
SEQ_LEN = 24
PATTERN = SparsityPattern.from_nm(2, 4, transposable=True)


def _ids(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 1000, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name.startswith(f"{prefix}.") for prefix in prefixes)


class _Lazy(dict[str, Any]):
    """A dict that builds a missing entry with `make(key)` on first use."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, key: str) -> Any:
        self[key] = self.make(key)
        return self[key]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Saved tiny checkpoints by family (SmolLM2 tokenizer, vocabulary 49152, a processor file)."""
    root = tmp_path_factory.mktemp("multimodal")
    return _Lazy(lambda family: make_tiny_model(root / family, family))


@pytest.fixture(scope="module")
def pruned(
    checkpoints: dict[str, Path], calibration_text: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, PruneReport]]:
    """Per family: (the output folder, the report) of a SparseGPT 2:4 transposable prune of its checkpoint."""
    root = tmp_path_factory.mktemp("pruned")

    def prune(family: str) -> tuple[Path, PruneReport]:
        cfg = PruneConfig(
            model=str(checkpoints[family]),
            matrix=MatrixPruneConfig(PATTERN),
            method="sparsegpt",
            calib_data=str(calibration_text),
            nsamples=2,
            seqlen=SEQ_LEN,
            output=root / family,
        )
        return root / family, prune_model(cfg, LOCAL_CTX)

    return _Lazy(prune)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_language_model_is_found(family: str, checkpoints: dict[str, Path]) -> None:
    """The loaded class is the saved one; the blocks are the text decoder's, on the meta device as after
    loading; every parameter is the language model's, the output head's, or in a module listed outside."""
    loaded = load_model(str(checkpoints[family]), LOCAL_CTX)
    model, structure = loaded.model, loaded.structure
    assert type(model).__name__ == model.config.architectures[0]
    name, outside = LANGUAGE_MODELS[family]
    assert (structure.base_name, structure.outside) == (name, outside)
    assert structure.base is model.get_submodule(name)
    assert structure.blocks_name == f"{name}.layers"
    assert len(structure) == config_value(model.config, "num_hidden_layers")
    head = {id(p) for p in model.get_output_embeddings().parameters()}
    for param_name, param in model.named_parameters():
        assert _under(param_name, (name, *outside)) or id(param) in head, param_name
    meta = discover_structure(meta_model(model.config))
    assert (meta.base_name, meta.blocks_name, meta.outside, meta.linears) == (
        name,
        structure.blocks_name,
        outside,
        structure.linears,
    )
    if family != "jamba":  # a vision tower: its encoder layers are a block list too, never chosen
        assert any(_under(n, outside) for n, m in model.named_modules() if isinstance(m, nn.ModuleList))


@pytest.mark.parametrize("family", FAMILIES)
def test_blockwise_replay_reproduces_the_whole_model(family: str) -> None:
    """The text-only replay of the language model's blocks gives the whole model's last hidden states and
    logits; a skipped block is recorded as idle and replays as the identity the model's forward makes it."""
    model = random_model(family)
    ids = _ids(3, seed=1)
    expected_hidden, expected_logits = full_forward(model, ids)
    hidden, logits = blockwise_forward(model, ids)
    torch.testing.assert_close(hidden, expected_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    structure = discover_structure(model)
    calls = capture_block_calls(structure, SEQ_LEN)
    idle = IDLE.get(family, set())
    assert {index for index, call in enumerate(calls) if call.idle} == idle
    kinds = {type(block).__name__ for block in structure.blocks}
    assert len(kinds) == (2 if family in ("jamba", "mllama") else 1)  # mixed lists are taken whole
    for index in idle:
        sample = capture_block_inputs(structure, _ids(1, seed=2), torch.device("cpu")).hidden
        out = torch.empty_like(sample)
        run_block(structure.blocks[index], sample, calls[index], out)
        assert torch.equal(out, sample)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_block_prune_verifies_loads_and_generates(
    family: str, checkpoints: dict[str, Path], pruned: dict[str, tuple[Path, PruneReport]]
) -> None:
    from transformers import AutoTokenizer

    source = checkpoints[family]
    out, report = pruned[family]
    structure = discover_structure(random_model(family))
    idle = IDLE.get(family, set())
    statuses = {record.name: record for record in report.layers}
    expected = {structure.full_name(index, local) for index, names in enumerate(structure.linears) for local in names}
    # Every linear has its record; the other matrices (Jamba's experts and router, Mamba's convolution)
    # have theirs too: pruned, or left dense with the reason.
    assert expected <= set(statuses)
    for name, record in statuses.items():
        block = int(name.removeprefix(f"{structure.blocks_name}.").split(".")[0])
        if name not in expected:
            assert record.status == "pruned" or record.reason, name
        else:
            assert record.status == "pruned" and record.density == pytest.approx(0.5), name
        if block in idle:  # Mllama's cross-attention: its forward on text stops after q_proj
            how = TEXT_REASON if name.endswith(".q_proj") else MAGNITUDE_REASON
            assert str(record.reason).startswith(how), (name, record.reason)
            assert (record.recon_error is not None) == (how == TEXT_REASON), name
    verified = verify_checkpoint(out)
    assert verified.ok and len(verified.layers) == sum(r.status == "pruned" for r in report.layers)

    model = auto_class(json_config(out)).from_pretrained(out).eval()
    dense = auto_class(json_config(source)).from_pretrained(source).eval()
    assert type(model) is type(dense)
    name, outside = LANGUAGE_MODELS[family]
    before, after = dense.state_dict(), model.state_dict()
    for key, tensor in before.items():
        if _under(key, outside):  # vision tower, projector: untouched
            assert torch.equal(after[key], tensor), key
    assert (out / PROCESSOR_FILE[0]).read_text() == PROCESSOR_FILE[1]
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("the image shows a model", return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, prompt.shape[1] + 3)
    assert torch.equal(generated[:, : prompt.shape[1]], prompt)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_class_that_loads_the_source_loads_the_output(
    family: str, checkpoints: dict[str, Path], pruned: dict[str, tuple[Path, PruneReport]]
) -> None:
    """Issue 41 item 7: the output is written in the source's key layout, so each class that loads the
    source (Mllama: MllamaForConditionalGeneration, and text only MllamaForCausalLM) finds the same keys
    in the output, none missing; `tsenor verify` checks the same through each class's key map."""
    from tsenor_cli.models.loading import loading_classes

    source = checkpoints[family]
    out, _ = pruned[family]
    classes = loading_classes(json_config(source))
    assert classes and (family != "mllama" or {c.__name__ for c in classes} >= {"MllamaForCausalLM"})
    for cls in classes:
        dense, dense_info = cls.from_pretrained(source, output_loading_info=True)
        model, info = cls.from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not dense_info["missing_keys"], cls.__name__
        assert sorted(info["unexpected_keys"]) == sorted(dense_info["unexpected_keys"]), cls.__name__
        assert model.state_dict().keys() == dense.state_dict().keys()
        assert any(not torch.equal(model.state_dict()[k], v) for k, v in dense.state_dict().items())  # pruned
    verified = verify_checkpoint(out)
    assert {load.name for load in verified.loads} >= {cls.__name__ for cls in classes}
    assert verified.ok and all(load.ok for load in verified.loads)


def test_verify_finds_the_weights_a_class_would_miss(
    checkpoints: dict[str, Path], pruned: dict[str, tuple[Path, PruneReport]], tmp_path: Path
) -> None:
    """A Mllama output under the model's own names (what tsenor wrote before): MllamaForCausalLM maps none
    of them and would start from random text weights; verify says so and fails (exit 6)."""
    import shutil

    from safetensors.torch import save_file

    out, _ = pruned["mllama"]
    own = tmp_path / "own-names"
    shutil.copytree(out, own)
    layout = {key: name for name, key in (verify_checkpoint(out).loads[0].layout or {}).items()}
    tensors = load_file(str(own / "model.safetensors"))
    save_file({layout.get(k, k): v for k, v in tensors.items()}, str(own / "model.safetensors"), {"format": "pt"})
    verified = verify_checkpoint(own)
    text_only = next(load for load in verified.loads if load.name == "MllamaForCausalLM")
    assert not verified.ok and not text_only.ok and all(c.ok for c in verified.layers)
    assert len(text_only.missing) > 10 and text_only.missing[0].startswith(("model.", "lm_head"))
    result = invoke(["verify", str(own)])
    assert result.exit_code == 6
    assert "MllamaForCausalLM finds" in str(result.exception) and "at random" in str(result.exception)


@pytest.mark.parametrize("family", ["qwen2_vl", "mllama"])
def test_refinement_trains_the_language_model_only(
    family: str, checkpoints: dict[str, Path], calibration_text: Path, tmp_path: Path
) -> None:
    """`--refine block` on a vision-language model: Qwen2-VL's blocks (3D rotary positions in the recorded
    call) and Mllama's self-attention blocks are refined and verify; Mllama's cross-attention block, which
    the text-only forward skips, is pruned but gets no refinement record (no forward of the model gives
    it outputs to refine towards); the vision tower and the projector stay bit-identical to the source."""
    from tsenor_cli.pruning.settings.config import RefineConfig

    source = checkpoints[family]
    out = tmp_path / "refined"
    cfg = PruneConfig(
        model=str(source),
        matrix=MatrixPruneConfig(PATTERN),
        method="sparsegpt",
        calib_data=str(calibration_text),
        nsamples=4,
        seqlen=SEQ_LEN,
        output=out,
        refine=RefineConfig("block", 2, 1e-3),
    )
    report = prune_model(cfg, LOCAL_CTX)
    idle = IDLE.get(family, set())
    structure = discover_structure(random_model(family))
    assert [b.block for b in report.refinement] == [i for i in range(len(structure.blocks)) if i not in idle]
    assert all(b.error_after < b.error_before if b.kept else b.error_after >= b.error_before for b in report.refinement)
    assert any(b.kept for b in report.refinement)
    assert verify_checkpoint(out).ok
    before = auto_class(json_config(source)).from_pretrained(source).state_dict()
    after = auto_class(json_config(out)).from_pretrained(out).state_dict()
    _, outside = LANGUAGE_MODELS[family]
    untouched = [key for key in before if _under(key, outside)]
    assert untouched and all(torch.equal(after[key], before[key]) for key in untouched)
    idle_linears = [r for r in report.layers if r.block in idle]
    assert all(r.status == "pruned" for r in idle_linears) and len(idle_linears) == (7 if idle else 0)


@pytest.mark.parametrize("killed_after", [0, 1])
def test_a_run_killed_around_the_skipped_block_resumes_to_the_same_checkpoint(
    killed_after: int,
    checkpoints: dict[str, Path],
    calibration_text: Path,
    pruned: dict[str, tuple[Path, PruneReport]],
    tmp_path: Path,
) -> None:
    """Mllama killed before (after block 0) or after (after block 1) its skipped block: the resumed run
    writes the uninterrupted run's weights and records."""
    full, full_report = pruned["mllama"]

    class Killed(RuntimeError):
        pass

    def kill(index: int) -> None:
        if index == killed_after:
            raise Killed

    cfg = _mllama_sparsegpt(checkpoints["mllama"], calibration_text, tmp_path / "resumed")
    with pytest.raises(Killed):
        prune_model(cfg, LOCAL_CTX, after_block=kill)
    report = prune_model(cfg, LOCAL_CTX)
    assert report.resumed_from_block == killed_after + 1
    assert [(r.name, r.status, r.reason, r.recon_error) for r in report.layers] == [
        (r.name, r.status, r.reason, r.recon_error) for r in full_report.layers
    ]
    expected, got = (
        load_file(str(full / "model.safetensors")),
        load_file(str(tmp_path / "resumed" / "model.safetensors")),
    )
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[key], got[key]) for key in expected)


def json_config(folder: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


@pytest.mark.realdata
@pytest.mark.parametrize("family", FAMILIES)
def test_perplexity_eval_runs_on_the_pruned_model(
    family: str, pruned: dict[str, tuple[Path, PruneReport]], data_dir: Path, tmp_path: Path
) -> None:
    out, _ = pruned[family]
    args = ["eval", "--model", str(out), "--ppl", "wikitext2", "--seqlen", "32", "--max-windows", "2"]
    result = invoke([*args, "--output", str(tmp_path), "--data-dir", str(data_dir), "--offline"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "eval.json").read_text())
    assert record["model_type"] == family
    ppl = record["perplexity"]["wikitext2"]
    assert ppl["windows"] == 2 and ppl["tokens"] == 2 * 31
    assert 1.0 < ppl["ppl"] < float("inf")


@pytest.mark.parametrize("family", ["llava", "mllama"])
def test_a_tokenizer_larger_than_the_vocabulary_is_one_line_exit_5(
    family: str, tmp_path: Path, calibration_text: Path
) -> None:
    """The SmolLM2 tokenizer's 49152 ids against a 1024-row embedding: refused before any weight is read
    by prune and by eval, nothing written. Mllama's embedding has 8 rows outside its vocab_size (for its
    image token): those rows count."""
    text_config = {**MULTIMODAL[family]["text_config"], "vocab_size": 1024}
    source = make_tiny_model(tmp_path / "src", family, text_config=text_config)
    rows = 1024 + (8 if family == "mllama" else 0)
    assert embedding_rows(meta_model(json_config(source))) == rows
    out = tmp_path / "out"
    prune = ["prune", "--model", str(source), "--method", "sparsegpt", "--nm", "2:4", "--nsamples", "2"]
    prune += ["--seqlen", "16", "--calib-data", str(calibration_text), "--output", str(out)]
    for args in (prune, ["eval", "--model", str(source), "--ppl", "wikitext2", "--output", str(out)]):
        result = invoke(args)
        message = str(result.exception)
        assert result.exit_code == 5 and isinstance(result.exception, IncompatibleModelError), result.output
        assert f"has 49152 ids but its model's token embedding has {rows} rows" in message
        assert "\n" not in message and "; " in message
        assert not out.exists()


def test_the_auto_class_is_the_one_the_checkpoint_was_saved_with() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    def config(model_type: str, architecture: str | None) -> Any:
        built = AutoConfig.for_model(model_type)
        built.architectures = [architecture] if architecture else None
        return built

    # AutoModelForCausalLM builds MllamaForCausalLM (the text model alone) for an Mllama config.
    assert auto_class(config("mllama", "MllamaForConditionalGeneration")) is AutoModelForImageTextToText
    assert auto_class(config("mllama", "MllamaForCausalLM")) is AutoModelForCausalLM
    assert auto_class(config("mllama", None)) is AutoModelForCausalLM  # unknown: the causal-LM class first
    # Gemma-3's causal-LM class is its multimodal one; LLaVA has only an image-text-to-text class.
    assert auto_class(config("gemma3", "Gemma3ForConditionalGeneration")) is AutoModelForCausalLM
    assert auto_class(config("llava", None)) is AutoModelForImageTextToText
    assert auto_class(config("llama", "LlamaForCausalLM")) is AutoModelForCausalLM


def test_config_values_come_from_the_text_config() -> None:
    from transformers import AutoConfig

    gemma3 = AutoConfig.for_model("gemma3", **MULTIMODAL["gemma3"])
    assert getattr(gemma3, "hidden_size", None) is None  # the top config has none
    assert config_value(gemma3, "hidden_size") == 64
    assert config_value(gemma3, "max_position_embeddings") == 512
    assert config_value(gemma3, "mm_tokens_per_image") == 4  # only the top config has it
    llama = AutoConfig.for_model("llama", hidden_size=96)
    assert config_value(llama, "hidden_size") == 96
    assert config_value(llama, "no_such_value") is None


def test_dry_run_plans_the_language_model(checkpoints: dict[str, Path]) -> None:
    result = invoke(["prune", "--model", str(checkpoints["gemma3"]), "--nm", "2:4", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert len(plan["layers"]) == 14 and plan["blocks"] == 2 and plan["incompatible"] == 0
    assert all(layer["name"].startswith("model.language_model.layers.") for layer in plan["layers"])
    assert plan["seqlen"] <= 512 and plan["estimated_device_bytes"] > 0


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.proj(hidden)


class _VisionBlock(_Block):
    pass


class _GatedBlock(_Block):
    """A block of another class that the text forward skips (as Mllama's cross-attention layers)."""


class _Text(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_Block(8), _GatedBlock(8), _Block(8)])

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            if not isinstance(layer, _GatedBlock):
                hidden = layer(hidden)
        return hidden


class _Towers(nn.Module):
    """A vision tower with more blocks than the text decoder, both of classes named in _no_split_modules."""

    _no_split_modules = ("_Block", "_VisionBlock", "_GatedBlock")

    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.ModuleList([_VisionBlock(8) for _ in range(5)])
        self.text = _Text()
        self.head = nn.Linear(8, 16)

    def get_input_embeddings(self) -> nn.Module:
        return self.text.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def test_the_text_decoder_wins_over_a_larger_vision_tower_and_its_skipped_block_is_idle() -> None:
    model = _Towers()
    structure = discover_structure(model)
    assert (structure.base_name, structure.blocks_name, structure.outside) == ("text", "text.layers", ("vision",))
    assert structure.base is model.text and len(structure) == 3
    calls = capture_block_calls(structure, 5)
    assert [call.idle for call in calls] == [False, True, False]
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    replayed = capture_block_inputs(structure, ids, torch.device("cpu")).hidden
    for index, block in enumerate(structure.blocks):  # the skipped block passes its input on unchanged
        out = torch.empty_like(replayed)
        run_block(block, replayed, calls[index], out)
        replayed = out
    with torch.no_grad():
        torch.testing.assert_close(replayed, model.text(ids))
        # Had the skipped block run, the output would differ: its replay is not the block's own output.
        assert not torch.allclose(model.text.layers[1](replayed), replayed)
    # Without the token embedding the largest list would be taken: the vision tower's.
    model.get_input_embeddings = None  # type: ignore[assignment,method-assign]
    assert discover_structure(model).blocks_name == "vision"


def test_a_block_list_that_never_runs_on_text_is_refused_in_one_line() -> None:
    model = _Text()
    model.layers = nn.ModuleList([_GatedBlock(8), _GatedBlock(8)])
    with pytest.raises(IncompatibleModelError, match=r"^the forward of _Text never ran a block of layers on text"):
        capture_block_calls(discover_structure(model), 4)


def test_an_idle_call_survives_the_move_to_a_device_and_differs_from_a_running_one() -> None:
    idle = BlockCall.empty_idle().to(torch.device("cpu"))
    assert idle.idle and idle.args == () and idle.kwargs == {}
    from tsenor_cli.replay import call_difference

    assert call_difference(idle, BlockCall((), {})) == "decision to run the block at all"
    assert call_difference(idle, BlockCall.empty_idle()) is None


def test_processor_files_of_a_hub_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A hub id: each processor file is fetched as the model's own files are; one the model lacks is
    skipped, one the offline cache lacks is named in a warning."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    (tmp_path / "preprocessor_config.json").write_text("{}")
    asked: list[tuple[str, str, bool]] = []

    def fake_download(repo_id: str, filename: str, *, local_files_only: bool) -> str:
        asked.append((repo_id, filename, local_files_only))
        if filename == "preprocessor_config.json":
            return str(tmp_path / filename)
        if filename == "processor_config.json":
            raise LocalEntryNotFoundError("not cached")
        raise EntryNotFoundError("no such file")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    warnings: list[str] = []
    monkeypatch.setattr("tsenor_cli.models.loading.logger.warning", lambda *args: warnings.append(args[0] % args[1:]))
    found = processor_files("org/model", False, LOCAL_CTX)
    assert found == {"preprocessor_config.json": b"{}"}
    assert {local for _, _, local in asked} == {True} and len(asked) == 4
    assert len(warnings) == 1 and "processor_config.json not in the local HF cache" in warnings[0]


def test_loaded_model_carries_the_processor_files(checkpoints: dict[str, Path]) -> None:
    loaded: LoadedModel = load_model(str(checkpoints["llava"]), LOCAL_CTX)
    assert dict(loaded.processor_files) == {PROCESSOR_FILE[0]: PROCESSOR_FILE[1].encode()}
    assert loaded.max_positions == 512
    saved = load_file(str(checkpoints["llava"] / "model.safetensors"))
    # The source keeps transformers' legacy names; load_model maps them onto the module tree.
    assert any(key.startswith("language_model.model.layers.") for key in saved)
    assert loaded.structure.blocks_name == "model.language_model.layers"


@pytest.mark.parametrize(("family", "pattern"), [("gemma3", "re:.*multi_modal_proj"), ("llava", "lm_head")])
@pytest.mark.parametrize("dry_run", [False, True])
def test_targets_naming_only_weights_tsenor_leaves_dense_are_refused_in_one_line(
    family: str, pattern: str, dry_run: bool, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Gemma-3's projector is a bare parameter and the output head is no vision weight: a --targets pattern
    naming only such weights is one line (exit 2), before any weight is read, nothing written."""
    out = tmp_path / "out"
    args = ["prune", "--model", str(checkpoints[family]), "--nm", "2:4", "--targets", pattern, "--output", str(out)]
    result = invoke([*args, "--dry-run"] if dry_run else args)
    message = str(result.exception)
    assert result.exit_code == 2, result.output
    assert message.startswith(f"--targets {pattern!r} names only weights outside the decoder blocks (e.g. ")
    assert "vision tower" in message and "\n" not in message
    assert not out.exists()


def test_targets_prune_the_vision_tower_by_magnitude(
    checkpoints: dict[str, Path], calibration_text: Path, tmp_path: Path
) -> None:
    """--targets naming LLaVA's vision tower prunes its linears from their magnitudes (the text calibration
    never reaches them), whatever the method: each keeps exactly the largest-magnitude transposable 2:4
    entries of its dense weight, its record says why, the dry run lists it, verify passes; the language
    model, not targeted, is unchanged."""
    from transformers import AutoTokenizer

    source, out = checkpoints["llava"], tmp_path / "out"
    args = [
        "prune",
        "--model",
        str(source),
        "--method",
        "sparsegpt",
        "--nm",
        "2:4",
        "--targets",
        "model.vision_tower.*",
    ]
    args += ["--nsamples", "2", "--seqlen", "16", "--calib-data", str(calibration_text), "--output", str(out)]
    dense = auto_class(json_config(source)).from_pretrained(source).eval()
    linears = {n for n, m in dense.named_modules() if n.startswith("model.vision_tower.") and isinstance(m, nn.Linear)}
    assert linears

    dry = invoke([*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    listed = {line.split()[0] for line in dry.output.splitlines() if OUTSIDE_REASON in line}
    assert listed == linears and not out.exists()

    ran = invoke(args)
    assert ran.exit_code == 0, ran.output
    report = PruneReport.from_json(json.loads((out / "tsenor_report.json").read_text()))
    outside = [r for r in report.layers if r.block == OUTSIDE_BLOCK]
    assert {r.name for r in outside} == linears
    assert all(r.status == "pruned" and r.reason == OUTSIDE_REASON and r.density == 0.5 for r in outside)
    assert not [r for r in report.layers if r.block >= 0 and r.status == "pruned"]
    verified = verify_checkpoint(out)
    assert verified.ok and {layer.name for layer in verified.layers} == linears

    model = auto_class(json_config(out)).from_pretrained(out).eval()
    before, after = dense.state_dict(), model.state_dict()
    for key, tensor in before.items():
        name = key.removesuffix(".weight")
        if name not in linears:
            assert torch.equal(after[key], tensor), key
            continue
        expected = magnitude.prune(tensor, None, MatrixPruneConfig(PATTERN)).weight
        assert torch.equal(after[key], expected), key
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("the image shows a model", return_tensors="pt").input_ids
    with torch.no_grad():
        assert model.generate(prompt, max_new_tokens=3, do_sample=False).shape == (1, prompt.shape[1] + 3)


def test_a_targeted_vision_linear_the_pattern_cannot_take_is_one_line_exit_5(
    checkpoints: dict[str, Path], calibration_text: Path, tmp_path: Path
) -> None:
    """32:64 cannot tile the 32-wide vision tower: refused in one line before any weight is read (dry run
    too), nothing written; with --skip-incompatible each such linear is recorded skipped with the reason."""
    out = tmp_path / "out"
    args = ["prune", "--model", str(checkpoints["llava"]), "--nm", "32:64", "--targets", "model.vision_tower.*"]
    args += ["--nsamples", "2", "--seqlen", "16", "--calib-data", str(calibration_text), "--output", str(out)]
    for attempt in ([*args, "--dry-run"], args):
        result = invoke(attempt)
        message = str(result.exception)
        assert result.exit_code == 5 and isinstance(result.exception, IncompatibleModelError), result.output
        assert message.startswith("--targets selects model.vision_tower.") and "\n" not in message
        assert not out.exists()
    assert invoke([*args, "--skip-incompatible"]).exit_code == 0
    report = PruneReport.from_json(json.loads((out / "tsenor_report.json").read_text()))
    outside = [r for r in report.layers if r.block == OUTSIDE_BLOCK]
    assert outside and all(r.status == "skipped" and r.reason for r in outside)


def _mllama_sparsegpt(model: Path, calibration_text: Path, output: Path, **options: Any) -> PruneConfig:
    """SparseGPT at PATTERN on 2 × SEQ_LEN tokens of the tiny Mllama, into `output` (with `options`)."""
    return PruneConfig(
        model=str(model),
        matrix=MatrixPruneConfig(PATTERN),
        method="sparsegpt",
        calib_data=str(calibration_text),
        nsamples=2,
        seqlen=SEQ_LEN,
        output=output,
        **options,
    )

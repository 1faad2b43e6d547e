"""`tsenor eval --stream`: perplexity block by block equals the whole-model evaluation, one block resident,
and every bad checkpoint is one line with nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import ARCHITECTURES, LOCAL_CTX, make_tiny_llama, make_tiny_model

from tsenor_cli.errors import BadInputError, InputNotFoundError, UsageError
from tsenor_cli.evaluation.perplexity import Windows, perplexity
from tsenor_cli.evaluation.streamed import BlockCallbacks, streamed_perplexity
from tsenor_cli.models.checkpoint import INDEX_NAME
from tsenor_cli.models.loading import LoadOptions, load_model
from tsenor_cli.runfiles import EVAL_FILE
from tsenor_cli.settings import RunContext

SEQLEN = 48


def _ids(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 49000, (1, tokens), generator=torch.Generator().manual_seed(seed))


def _resident_blocks(loaded: object) -> list[int]:
    blocks = loaded.structure.blocks  # type: ignore[attr-defined]
    return [i for i, block in enumerate(blocks) if any(p.device.type != "meta" for p in block.parameters())]


def _both(folder: Path, ids: torch.Tensor, max_windows: int | None = None) -> tuple[float, float, list[list[int]]]:
    """(whole-model ppl, streamed ppl, the blocks holding weights after each block of the streamed pass)."""
    whole = perplexity(load_model(str(folder), LOCAL_CTX).model, ids, Windows(SEQLEN, max_windows), device="cpu")
    streamed_model = load_model(str(folder), LOCAL_CTX, stream=True)
    assert _resident_blocks(streamed_model) == []  # nothing of a block is read by the load
    resident: list[list[int]] = []
    streamed = streamed_perplexity(
        streamed_model,
        ids,
        Windows(SEQLEN, max_windows),
        device=torch.device("cpu"),
        blocks=BlockCallbacks(done=lambda _done, _total: resident.append(_resident_blocks(streamed_model))),
    )
    assert (streamed.windows, streamed.tokens) == (whole.windows, whole.tokens)
    return whole.ppl, streamed.ppl, resident


@pytest.mark.parametrize("tied", [True, False])
def test_streamed_ppl_equals_whole_model_ppl_one_block_at_a_time(tmp_path: Path, tied: bool) -> None:
    folder = make_tiny_llama(tmp_path / "m", num_layers=3, tie_word_embeddings=tied)
    whole, streamed, resident = _both(folder, _ids(5 * SEQLEN), max_windows=4)
    assert streamed == pytest.approx(whole, rel=1e-5)
    assert resident == [[], [], []]  # each block released before the next one is read


def test_sharded_checkpoint_streams_the_same(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "m", num_layers=3)
    sharded = tmp_path / "sharded"
    shutil.copytree(folder, sharded)
    (sharded / "model.safetensors").unlink()
    load_model(str(folder), LOCAL_CTX).model.save_pretrained(sharded, max_shard_size="1MB")
    assert (sharded / INDEX_NAME).is_file()
    whole, streamed, _ = _both(sharded, _ids(3 * SEQLEN, seed=1))
    assert streamed == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_every_family_streams_to_the_whole_model_ppl(tmp_path: Path, family: str) -> None:
    folder = make_tiny_llama(tmp_path / "m", model_type=family, **ARCHITECTURES[family])
    whole, streamed, _ = _both(folder, _ids(2 * SEQLEN, seed=2))
    assert streamed == pytest.approx(whole, rel=1e-5)


@pytest.mark.slow
@pytest.mark.realmodel
@pytest.mark.realdata
def test_real_smollm2_streamed_ppl_equals_whole(data_ctx: RunContext) -> None:
    from tsenor_cli.data.eval_text import eval_token_stream

    whole_model = load_model("smollm2-135m", data_ctx)
    text = eval_token_stream("wikitext2", whole_model.tokenizer, data_ctx, seqlen=512)
    whole = perplexity(whole_model.model, text.input_ids, Windows(512, max_windows=3), device="cpu")
    del whole_model
    loaded = load_model("smollm2-135m", data_ctx, stream=True)
    streamed = streamed_perplexity(loaded, text.input_ids, Windows(512, max_windows=3), device=torch.device("cpu"))
    assert streamed.ppl == pytest.approx(whole.ppl, rel=1e-5)
    assert 5 < whole.ppl < 100  # a real model on real text


@pytest.mark.realdata
def test_cli_stream_matches_whole_and_refuses_bad_checkpoints(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = make_tiny_llama(tmp_path / "m", num_layers=2, max_position_embeddings=256)
    common = ["--data-dir", str(data_dir), "--offline", "--ppl", "wikitext2", "--seqlen", "64", "--max-windows", "2"]

    def ppl(model: Path, *extra: str) -> float:
        result = invoke(["eval", "--model", str(model), *common, "--json", *extra])
        assert result.exit_code == 0, result.output
        return float(json.loads(result.stdout[result.stdout.index("{") :])["perplexity"]["wikitext2"]["ppl"])

    assert ppl(folder, "--stream") == pytest.approx(ppl(folder), rel=1e-5)

    def refused(model: Path, error: type[Exception], message: str, *extra: str) -> None:
        out = tmp_path / "out"
        result = invoke(["eval", "--model", str(model), *common, "--output", str(out), *extra])
        assert isinstance(result.exception, error), result.output
        assert message in str(result.exception) and "\n" not in str(result.exception)
        assert result.exit_code == error.exit_code  # type: ignore[attr-defined]
        assert not (out / EVAL_FILE).exists()

    refused(folder, UsageError, "--stream evaluates perplexity only", "--stream", "--tasks", "piqa")
    refused(folder, UsageError, "pass one of them", "--stream", "--device-map", "auto")
    refused(folder, UsageError, "pass --device-map auto", "--device-map", "balanced")
    sharded = tmp_path / "sharded"
    shutil.copytree(folder, sharded)
    (sharded / "model.safetensors").unlink()
    load_model(str(folder), LOCAL_CTX).model.save_pretrained(sharded, max_shard_size="2MB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    shards[-1].write_bytes(shards[-1].read_bytes()[:-64])
    refused(sharded, BadInputError, "is truncated or corrupt", "--stream")
    shards[-1].unlink()
    refused(sharded, InputNotFoundError, f"names the shard {shards[-1].name}, which is missing", "--stream")


def test_a_checkpoint_under_other_names_is_loaded_whole_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Tensors stored under other names than the modules' that transformers renames on load (LLaVA's legacy
    ``language_model.model.…``, the layout its save_pretrained writes) cannot be read block by block:
    streaming being the default, the load goes on whole, with one line naming the first missing tensor,
    before any weight is read. The names are a renaming transformers knows, so the checkpoint matches its
    config (`models/conformance.py`)."""
    from safetensors import safe_open

    folder = make_tiny_model(tmp_path / "m", "llava")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        assert any(key.startswith("language_model.model.layers.") for key in handle.keys())  # noqa: SIM118
    with caplog.at_level("WARNING", logger="tsenor"):
        loaded = load_model(str(folder), LOCAL_CTX, stream=True)
    assert loaded.checkpoint is None and _resident_blocks(loaded) == list(range(len(loaded.structure)))
    lines = [r.getMessage() for r in caplog.records if "block by block" in r.getMessage()]
    assert len(lines) == 1 and "holds no tensor model." in lines[0] and "loaded whole" in lines[0]


def test_names_transformers_does_not_rename_are_refused_streamed_or_whole(tmp_path: Path) -> None:
    """Names that are no renaming transformers knows (every key under a made-up prefix) were loaded whole
    with a warning, and transformers then initialised every weight at random: the checkpoint does not
    match its config, refused in one line (exit 7) before any weight is read, streamed or not."""
    from safetensors.torch import save_file

    from tsenor_cli.errors import CheckpointMismatchError

    folder = make_tiny_llama(tmp_path / "m", num_layers=2)
    renamed = tmp_path / "renamed"
    shutil.copytree(folder, renamed)
    model = load_model(str(folder), LOCAL_CTX).model
    legacy = {f"legacy.{k}": v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(legacy, str(renamed / "model.safetensors"))
    for stream in (True, False):
        with pytest.raises(CheckpointMismatchError) as caught:
            load_model(str(renamed), LOCAL_CTX, stream=stream)
        message = str(caught.value)
        assert "config.json describes 2 decoder block(s), the weights hold 0" in message
        assert "tensor(s) of the model missing from the weights (model.embed_tokens.weight" in message
        assert caught.value.exit_code == 7 and "\n" not in message


def test_pickle_checkpoint_is_loaded_whole_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = make_tiny_llama(tmp_path / "m", num_layers=2)
    model = load_model(str(folder), LOCAL_CTX).model
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    with caplog.at_level("WARNING", logger="tsenor"):
        loaded = load_model(str(folder), LOCAL_CTX, stream=True)
    assert loaded.checkpoint is None and _resident_blocks(loaded) == [0, 1]
    assert "streaming needs safetensors, so it is loaded whole" in caplog.text


def test_device_map_auto_loads_the_whole_model_where_accelerate_places_it(tmp_path: Path) -> None:
    """--device-map auto (zero-shot on models larger than one GPU): here, with no GPU, all on the CPU,
    the same perplexity as the plain load."""
    folder = make_tiny_llama(tmp_path / "m", num_layers=2)
    mapped = load_model(str(folder), LOCAL_CTX, options=LoadOptions(device_map="auto"))
    assert {p.device.type for p in mapped.model.parameters()} == {"cuda" if torch.cuda.is_available() else "cpu"}
    ids = _ids(2 * SEQLEN, seed=3)
    plain = perplexity(load_model(str(folder), LOCAL_CTX).model, ids, Windows(SEQLEN), device="cpu")
    device = next(mapped.model.parameters()).device
    assert perplexity(mapped.model, ids, Windows(SEQLEN), device=device).ppl == pytest.approx(plain.ppl, rel=1e-5)

"""Calibration windows and evaluation token streams (offline data folder and user files)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from tsenor_cli.data import sources
from tsenor_cli.data.calibration import calibration_batches, random_windows
from tsenor_cli.data.eval_text import eval_token_stream
from tsenor_cli.errors import InputNotFoundError, UsageError

pytestmark = pytest.mark.usefixtures("hub_off")


@pytest.fixture
def hub_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the offline paths; never try the hub."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer():
    from helpers_tiny import smollm2_dir
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir())


def is_window_of(stream: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """stream (N,), windows (B, S) → (B,) bool: each window equals some contiguous slice of stream."""
    all_slices = stream.unfold(0, windows.shape[1], 1)  # (N - S + 1, S)
    return (all_slices[None, :, :] == windows[:, None, :]).all(-1).any(-1)


def test_random_windows_hand_case() -> None:
    stream = torch.arange(100)
    windows = random_windows(stream, 6, 10, torch.Generator().manual_seed(3))
    assert windows.shape == (6, 10)
    # each window is 10 consecutive integers starting in [0, 89]
    assert torch.equal(windows - windows[:, :1], torch.arange(10).expand(6, 10))
    assert int(windows[:, 0].min()) >= 0 and int(windows[:, 0].max()) <= 89


@pytest.mark.realdata
def test_wikitext_rows_reproduce_hf_rows(data_dir: Path) -> None:
    rows = sources.wikitext_rows(data_dir / sources.WIKITEXT2_TEST)
    assert len(rows) == 4358
    # data README: HF rows joined with "\n" are the 1,292,013-byte HF-joined text
    assert len("\n".join(rows).encode("utf-8")) == 1_292_013
    assert rows[0] == "" and rows[1] == " = Robert Boulter = \n"


@pytest.mark.realdata
def test_eval_streams_offline(tokenizer, data_dir: Path) -> None:
    wt2 = eval_token_stream("wikitext2", tokenizer, seqlen=2048, data_dir=data_dir)
    assert wt2.offline and wt2.input_ids.dim() == 2 and wt2.input_ids.shape[0] == 1
    assert "wiki.test.raw" in wt2.description
    text = tokenizer.decode(wt2.input_ids[0])
    assert text == "\n\n".join(sources.wikitext_rows(data_dir / sources.WIKITEXT2_TEST))

    ptb = eval_token_stream("ptb", tokenizer, seqlen=2048, data_dir=data_dir)
    sentences = (data_dir / sources.PTB_TEST).read_text(encoding="utf-8").strip("\n").split("\n")
    assert len(sentences) == 3761
    assert tokenizer.decode(ptb.input_ids[0]) == " ".join(s.strip() for s in sentences)

    c4 = eval_token_stream("c4", tokenizer, seqlen=64, data_dir=data_dir)
    assert c4.input_ids.shape == (1, 256 * 64)  # cut to 256 windows of seqlen
    assert "NOT the c4 validation shard" in c4.description and c4.offline


@pytest.mark.realdata
def test_calibration_offline_ptb(tokenizer, data_dir: Path) -> None:
    # one call only: tokenizing the 5 MB PTB train text takes several seconds
    data = calibration_batches("ptb", tokenizer, nsamples=4, seqlen=32, seed=0, data_dir=data_dir)
    assert data.input_ids.shape == (4, 32) and data.offline and "ptb.train.txt" in data.source_description
    words = {w for w in tokenizer.batch_decode(data.input_ids.view(-1, 1)) if w.strip().isalpha()}
    vocab = set((data_dir / sources.PTB_TRAIN).read_text(encoding="utf-8").split())
    assert {w.strip() for w in words} & vocab  # real PTB words come out


@pytest.mark.realdata
@pytest.mark.parametrize("source", ["c4", "wikitext2"])
def test_calibration_offline_sources(tokenizer, data_dir: Path, source: str) -> None:
    a = calibration_batches(source, tokenizer, nsamples=4, seqlen=32, seed=0, data_dir=data_dir)
    b = calibration_batches(source, tokenizer, nsamples=4, seqlen=32, seed=0, data_dir=data_dir)
    c = calibration_batches(source, tokenizer, nsamples=4, seqlen=32, seed=1, data_dir=data_dir)
    assert a.input_ids.shape == (4, 32) and a.input_ids.dtype == torch.long
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.offline and "offline" in a.source_description
    if source == "wikitext2":
        assert "VALIDATION" in a.source_description  # train split is not in the data folder


@pytest.mark.realdata
def test_c4_calibration_is_disjoint_from_c4_eval(tokenizer, data_dir: Path) -> None:
    calib = calibration_batches("c4", tokenizer, nsamples=8, seqlen=24, seed=5, data_dir=data_dir)
    docs = sources.read_text_records(data_dir / sources.C4_SAMPLE)
    calib_stream = sources.encode_documents(tokenizer, docs[sources.C4_EVAL_DOCS :], tokenizer.eos_token_id)
    eval_stream = eval_token_stream("c4", tokenizer, seqlen=2048, data_dir=data_dir).input_ids[0]
    assert is_window_of(calib_stream, calib.input_ids).all()
    assert not is_window_of(eval_stream, calib.input_ids).any()


def write_records(path: Path, docs: list[str]) -> Path:
    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(lines)
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps([{"text": d} for d in docs]), encoding="utf-8")
    else:
        path.write_text(lines, encoding="utf-8")
    return path


DOCS = [f"Document number {i} talks about sparse matrices and optimal transport. " * 3 for i in range(12)]


@pytest.mark.parametrize("suffix", [".jsonl", ".json.gz", ".parquet", ".json"])
def test_calibration_from_record_files(tokenizer, tmp_path: Path, suffix: str) -> None:
    path = write_records(tmp_path / f"docs{suffix}", DOCS)
    assert sources.read_text_records(path) == tuple(DOCS)
    data = calibration_batches(str(path), tokenizer, nsamples=5, seqlen=16, seed=2)
    stream = sources.encode_documents(tokenizer, tuple(DOCS), tokenizer.eos_token_id)
    assert data.input_ids.shape == (5, 16)
    # documents are shuffled, so windows crossing a boundary may not be in the unshuffled stream; the
    # tokens themselves must all come from the documents
    assert torch.isin(data.input_ids, stream).all()
    assert str(path) in data.source_description


def test_calibration_from_txt(tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(DOCS), encoding="utf-8")
    data = calibration_batches(str(path), tokenizer, nsamples=3, seqlen=20, seed=0)
    stream = sources.encode_documents(tokenizer, (" ".join(DOCS),), tokenizer.eos_token_id)
    assert is_window_of(stream, data.input_ids).all()


def test_bad_data_paths(tokenizer, tmp_path: Path) -> None:
    with pytest.raises(InputNotFoundError, match="does not exist"):
        calibration_batches(str(tmp_path / "missing.jsonl"), tokenizer)
    with pytest.raises(UsageError, match="is not a file"):
        calibration_batches(str(tmp_path), tokenizer)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(UsageError, match="line 2 is not valid JSON"):
        calibration_batches(str(bad_json), tokenizer)
    no_text = tmp_path / "notext.jsonl"
    no_text.write_text('{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(UsageError, match="no string `text` field"):
        calibration_batches(str(no_text), tokenizer)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(UsageError, match="cannot read"):
        calibration_batches(str(binary), tokenizer)
    not_gzip = tmp_path / "fake.json.gz"
    not_gzip.write_text('{"text": "plain"}\n', encoding="utf-8")
    with pytest.raises(UsageError, match="cannot read"):
        calibration_batches(str(not_gzip), tokenizer)
    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_bytes(b"not parquet at all")
    with pytest.raises(UsageError, match="as parquet"):
        calibration_batches(str(bad_parquet), tokenizer)
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    with pytest.raises(UsageError, match="need more than --seqlen 2048"):
        calibration_batches(str(short), tokenizer)
    unsupported = tmp_path / "data.csv"
    unsupported.write_text("text\nhello\n", encoding="utf-8")
    with pytest.raises(UsageError, match="unsupported data file"):
        calibration_batches(str(unsupported), tokenizer)
    with pytest.raises(UsageError, match="unknown calibration source 'c5'"):
        calibration_batches("c5", tokenizer)


def test_no_data_folder(tokenizer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TSENOR_DATA_DIR", raising=False)
    for source in ("c4", "wikitext2", "ptb"):
        with pytest.raises(InputNotFoundError, match="set TSENOR_DATA_DIR"):
            calibration_batches(source, tokenizer, nsamples=1, seqlen=8)
        with pytest.raises(InputNotFoundError, match="set TSENOR_DATA_DIR"):
            eval_token_stream(source, tokenizer, seqlen=8)  # type: ignore[arg-type]
    with pytest.raises(InputNotFoundError, match=r"wiki\.test\.raw does not exist"):
        eval_token_stream("wikitext2", tokenizer, seqlen=8, data_dir=tmp_path)


def test_hub_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not sources.hub_enabled()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert sources.hub_enabled()

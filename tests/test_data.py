"""Calibration windows and evaluation token streams (offline data folder and user files)."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest
import torch
from helpers_tiny import LOCAL_CTX

from tsenor_cli.data import sources
from tsenor_cli.data.calibration import calibration_batches, random_windows
from tsenor_cli.data.eval_text import eval_token_stream
from tsenor_cli.errors import InputNotFoundError, UsageError
from tsenor_cli.runfiles import DataFile, DataSource
from tsenor_cli.settings import RunContext


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
def test_eval_streams_offline(tokenizer, data_dir: Path, data_ctx: RunContext) -> None:
    wt2 = eval_token_stream("wikitext2", tokenizer, data_ctx, seqlen=2048)
    assert wt2.input_ids.dim() == 2 and wt2.input_ids.shape[0] == 1
    # the source names the file read and its sha256, recomputed here from the bytes
    wiki = data_dir / sources.WIKITEXT2_TEST
    assert wt2.source.kind == "offline" and wt2.source.hub is None
    assert [(f.path, f.sha256) for f in wt2.source.files] == [
        (str(wiki.resolve()), hashlib.sha256(wiki.read_bytes()).hexdigest())
    ]
    assert "wiki.test.raw" in wt2.description
    text = tokenizer.decode(wt2.input_ids[0])
    assert text == "\n\n".join(sources.wikitext_rows(data_dir / sources.WIKITEXT2_TEST))

    ptb = eval_token_stream("ptb", tokenizer, data_ctx, seqlen=2048)
    sentences = (data_dir / sources.PTB_TEST).read_text(encoding="utf-8").strip("\n").split("\n")
    assert len(sentences) == 3761
    assert tokenizer.decode(ptb.input_ids[0]) == " ".join(s.strip() for s in sentences)

    c4 = eval_token_stream("c4", tokenizer, data_ctx, seqlen=64)
    assert c4.input_ids.shape == (1, 256 * 64)  # cut to 256 windows of seqlen
    assert "NOT the c4 validation shard" in c4.description and c4.source.kind == "offline"
    assert [f.path for f in c4.source.files] == [str((data_dir / sources.C4_SAMPLE).resolve())]


@pytest.mark.realdata
def test_calibration_offline_ptb(tokenizer, data_dir: Path, data_ctx: RunContext) -> None:
    # one call only: tokenizing the 5 MB PTB train text takes several seconds
    data = calibration_batches("ptb", tokenizer, data_ctx, nsamples=4, seqlen=32, seed=0)
    assert data.input_ids.shape == (4, 32) and "ptb.train.txt" in data.source_description
    assert data.source.kind == "offline" and data.source.files[0].path.endswith(sources.PTB_TRAIN)
    words = {w for w in tokenizer.batch_decode(data.input_ids.view(-1, 1)) if w.strip().isalpha()}
    vocab = set((data_dir / sources.PTB_TRAIN).read_text(encoding="utf-8").split())
    assert {w.strip() for w in words} & vocab  # real PTB words come out


@pytest.mark.realdata
@pytest.mark.parametrize("source", ["c4", "wikitext2"])
def test_calibration_offline_sources(tokenizer, data_dir: Path, data_ctx: RunContext, source: str) -> None:
    a = calibration_batches(source, tokenizer, data_ctx, nsamples=4, seqlen=32, seed=0)
    b = calibration_batches(source, tokenizer, data_ctx, nsamples=4, seqlen=32, seed=0)
    c = calibration_batches(source, tokenizer, data_ctx, nsamples=4, seqlen=32, seed=1)
    assert a.input_ids.shape == (4, 32) and a.input_ids.dtype == torch.long
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.source.kind == "offline" and "offline" in a.source_description
    if source == "wikitext2":
        assert "VALIDATION" in a.source_description  # train split is not in the data folder


@pytest.mark.realdata
def test_c4_calibration_is_disjoint_from_c4_eval(tokenizer, data_dir: Path, data_ctx: RunContext) -> None:
    calib = calibration_batches("c4", tokenizer, data_ctx, nsamples=8, seqlen=24, seed=5)
    docs = sources.read_text_records(data_dir / sources.C4_SAMPLE)
    calib_stream = sources.encode_documents(tokenizer, docs[sources.C4_EVAL_DOCS :], tokenizer.eos_token_id)
    eval_stream = eval_token_stream("c4", tokenizer, data_ctx, seqlen=2048).input_ids[0]
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
    data = calibration_batches(str(path), tokenizer, LOCAL_CTX, nsamples=5, seqlen=16, seed=2)
    stream = sources.encode_documents(tokenizer, tuple(DOCS), tokenizer.eos_token_id)
    assert data.input_ids.shape == (5, 16)
    # documents are shuffled, so windows crossing a boundary may not be in the unshuffled stream; the
    # tokens themselves must all come from the documents
    assert torch.isin(data.input_ids, stream).all()
    assert str(path) in data.source_description
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert data.source == DataSource(kind="file", files=(DataFile(str(path.resolve()), digest),))


def test_calibration_from_txt(tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(DOCS), encoding="utf-8")
    data = calibration_batches(str(path), tokenizer, LOCAL_CTX, nsamples=3, seqlen=20, seed=0)
    stream = sources.encode_documents(tokenizer, (" ".join(DOCS),), tokenizer.eos_token_id)
    assert is_window_of(stream, data.input_ids).all()


def test_bad_data_paths(tokenizer, tmp_path: Path) -> None:
    with pytest.raises(InputNotFoundError, match="does not exist"):
        calibration_batches(str(tmp_path / "missing.jsonl"), tokenizer, LOCAL_CTX)
    with pytest.raises(UsageError, match="is not a file"):
        calibration_batches(str(tmp_path), tokenizer, LOCAL_CTX)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(UsageError, match="line 2 is not valid JSON"):
        calibration_batches(str(bad_json), tokenizer, LOCAL_CTX)
    no_text = tmp_path / "notext.jsonl"
    no_text.write_text('{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(UsageError, match="no string `text` field"):
        calibration_batches(str(no_text), tokenizer, LOCAL_CTX)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(UsageError, match="cannot read"):
        calibration_batches(str(binary), tokenizer, LOCAL_CTX)
    not_gzip = tmp_path / "fake.json.gz"
    not_gzip.write_text('{"text": "plain"}\n', encoding="utf-8")
    with pytest.raises(UsageError, match="cannot read"):
        calibration_batches(str(not_gzip), tokenizer, LOCAL_CTX)
    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_bytes(b"not parquet at all")
    with pytest.raises(UsageError, match="as parquet"):
        calibration_batches(str(bad_parquet), tokenizer, LOCAL_CTX)
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    with pytest.raises(UsageError, match="need more than --seqlen 2048"):
        calibration_batches(str(short), tokenizer, LOCAL_CTX)
    unsupported = tmp_path / "data.csv"
    unsupported.write_text("text\nhello\n", encoding="utf-8")
    with pytest.raises(UsageError, match="unsupported data file"):
        calibration_batches(str(unsupported), tokenizer, LOCAL_CTX)
    with pytest.raises(UsageError, match="unknown calibration source 'c5'"):
        calibration_batches("c5", tokenizer, LOCAL_CTX)


def test_no_data_folder(tokenizer, tmp_path: Path) -> None:
    """Hub forbidden and no data folder: no source at all, and the message names --data-dir."""
    for source in ("c4", "wikitext2", "ptb"):
        with pytest.raises(InputNotFoundError, match="pass --data-dir"):
            calibration_batches(source, tokenizer, LOCAL_CTX, nsamples=1, seqlen=8)
        with pytest.raises(InputNotFoundError, match="pass --data-dir"):
            eval_token_stream(source, tokenizer, LOCAL_CTX, seqlen=8)  # type: ignore[arg-type]
    empty = RunContext(data_dir=tmp_path, offline=False, cache_dir=tmp_path)
    with pytest.raises(InputNotFoundError, match=r"wiki\.test\.raw does not exist"):
        eval_token_stream("wikitext2", tokenizer, empty, seqlen=8)


def test_data_source_rule_is_decided_by_the_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Data folder set → the folder, whatever the hub policy; none → the hub, or an error when offline.
    The hub is never tried first and the folder never used as a fallback."""
    calls: list[tuple[object, ...]] = []

    def fake_hub_rows(*args: object) -> tuple[str, ...]:
        calls.append(args)
        return ("a hub row",)

    monkeypatch.setattr(sources, "hub_rows", fake_hub_rows)
    (tmp_path / "ptb").mkdir()
    (tmp_path / sources.PTB_TEST).write_text("one\ntwo\n", encoding="utf-8")
    for offline in (False, True):
        folder = RunContext(data_dir=tmp_path, offline=offline, cache_dir=tmp_path)
        assert sources.data_folder(folder, "ptb") == tmp_path
        raw = sources.ptb_text("test", folder)
        assert raw.rows == ("one", "two") and raw.source.kind == "offline" and not calls
    with pytest.raises(InputNotFoundError, match="pass --data-dir"):
        sources.data_folder(RunContext(data_dir=None, offline=True, cache_dir=tmp_path), "ptb")
    hub = RunContext(data_dir=None, offline=False, cache_dir=tmp_path)
    assert sources.data_folder(hub, "ptb") is None
    raw = sources.ptb_text("test", hub)
    assert raw.rows == ("a hub row",) and calls == [("ptb_text_only", "penn_treebank", "test", "sentence", None)]
    assert raw.source.kind == "hub" and raw.source.hub == "ptb_text_only/penn_treebank split=test"

    def unreachable(*_args: object) -> tuple[str, ...]:
        raise ConnectionError("no route to host")

    monkeypatch.setattr(sources, "hub_rows", unreachable)
    with pytest.raises(InputNotFoundError, match=r"cannot download ptb .*no route to host.*pass --data-dir"):
        sources.ptb_text("test", hub)

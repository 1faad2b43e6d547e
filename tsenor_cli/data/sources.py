"""Raw text of the language-modelling datasets: from the HF hub when reachable, else the offline folder.

The offline folder ($TSENOR_DATA_DIR, layout of ``shared/data``; see its README) holds WikiText-2 raw
test/valid, PTB train/valid/test, and a 1,000-document C4-en sample. This module turns those files
into the same rows the hub datasets give (``wikitext-2-raw-v1`` rows, ``ptb_text_only`` sentences,
C4 documents), so calibration and evaluation code do not care where the text came from.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from tsenor_cli import settings
from tsenor_cli.errors import InputNotFoundError, UsageError

DatasetName = Literal["wikitext2", "ptb", "c4"]
DATASET_NAMES: tuple[DatasetName, ...] = ("wikitext2", "ptb", "c4")

# Offline files, relative to the data folder.
WIKITEXT2_TEST = "wikitext-2-raw/wiki.test.raw"
WIKITEXT2_VALID = "wikitext-2-raw/wiki.valid.raw"
PTB_TRAIN = "ptb/ptb.train.txt"
PTB_TEST = "ptb/ptb.test.txt"
C4_SAMPLE = "c4/c4-en-sample-1000.olmo.json.gz"
# The C4 sample is split by document position so offline calibration never sees the evaluation text:
# documents [0, C4_EVAL_DOCS) are evaluation text, the rest calibration text.
C4_EVAL_DOCS = 500

# The hub's C4 shards (SparseGPT protocol).
C4_TRAIN_SHARD = "en/c4-train.00000-of-01024.json.gz"
C4_VALIDATION_SHARD = "en/c4-validation.00000-of-00008.json.gz"

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")


@dataclass(frozen=True)
class RawText:
    """Rows of text (documents, sentences or WikiText rows) and where they came from."""

    rows: tuple[str, ...]
    description: str
    offline: bool


def hub_enabled() -> bool:
    """False when the user told the HF libraries to stay offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)."""
    flags = ("HF_DATASETS_OFFLINE",)
    return not (settings.hub_offline() or any(os.environ.get(v, "") not in ("", "0") for v in flags))


def resolve_data_dir(data_dir: Path | None) -> Path | None:
    """The explicit data_dir, else $TSENOR_DATA_DIR, else None."""
    return Path(data_dir).expanduser() if data_dir is not None else settings.data_dir()


def offline_file(data_dir: Path | None, relative: str, dataset: str) -> Path:
    """The path of an offline data file; InputNotFoundError with the fix when it is not there."""
    folder = resolve_data_dir(data_dir)
    if folder is None:
        raise InputNotFoundError(
            f"no data for {dataset}: the HF hub is not reachable and no data folder is set; "
            f"set TSENOR_DATA_DIR to the offline data folder (with {relative}) or pass a text file path"
        )
    path = folder / relative
    if not path.is_file():
        raise InputNotFoundError(
            f"no data for {dataset}: {path} does not exist; set TSENOR_DATA_DIR to the offline data "
            f"folder (with {relative}) or pass a text file path"
        )
    return path


def wikitext_rows(path: Path) -> tuple[str, ...]:
    """The HF ``wikitext-2-raw-v1`` rows of a raw WikiText file.

    The HF loader yields each line with its newline when it has non-space text, else "" (so joining
    the rows with "\\n" reproduces the 1,292,013-byte HF-joined test text, per the data README).
    Iterating the file object splits lines exactly as that loader does.
    """
    with path.open(encoding="utf-8") as handle:
        return tuple(line if line.strip() else "" for line in handle)


def ptb_sentences(path: Path) -> tuple[str, ...]:
    """The HF ``ptb_text_only`` sentences: one stripped line per sentence."""
    with path.open(encoding="utf-8") as handle:
        return tuple(line.strip() for line in handle)


def read_text_records(path: Path) -> tuple[str, ...]:
    """Documents from a user file: .txt (the whole file is one document), .jsonl/.json/.jsonl.gz/.json.gz
    (JSON lines, or a JSON array for .json, of objects with a string ``text``), or .parquet (``text`` column).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise InputNotFoundError(
            f"data file {path} does not exist; pass an existing file or one of: c4, wikitext2, ptb"
        )
    if not path.is_file():
        raise UsageError(f"data path {path} is not a file; pass a {'/'.join(LOCAL_SUFFIXES)} file with a text field")
    name = path.name.lower()
    try:
        if name.endswith(".txt"):
            docs: tuple[str, ...] = (path.read_text(encoding="utf-8"),)
        elif name.endswith((".jsonl.gz", ".json.gz")):
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                docs = _json_lines_text(handle, path)
        elif name.endswith(".jsonl"):
            with path.open(encoding="utf-8") as handle:
                docs = _json_lines_text(handle, path)
        elif name.endswith(".json"):
            text = path.read_text(encoding="utf-8")
            docs = (
                _json_array_text(text, path)
                if text.lstrip().startswith("[")
                else _json_lines_text(text.splitlines(), path)
            )
        elif name.endswith(".parquet"):
            docs = _parquet_text(path)
        else:
            raise UsageError(
                f"unsupported data file {path}; use one of {', '.join(LOCAL_SUFFIXES)} with a `text` field"
            )
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as exc:
        raise UsageError(f"cannot read {path}: {exc}; pass a UTF-8 text/JSON-lines/parquet file") from exc
    except PermissionError as exc:
        raise UsageError(f"cannot read {path}: permission denied; fix its permissions or pass another file") from exc
    if not any(doc.strip() for doc in docs):
        raise UsageError(f"data file {path} holds no text; pass a file with non-empty `text` records")
    return docs


def _json_lines_text(lines: Iterable[str], path: Path) -> tuple[str, ...]:
    docs: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"{path} line {number} is not valid JSON ({exc.msg}); pass JSON lines with a `text` field"
            ) from exc
        docs.append(_record_text(record, path, f"line {number}"))
    return tuple(docs)


def _json_array_text(text: str, path: Path) -> tuple[str, ...]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc.msg}); pass a JSON array or JSON lines with `text`") from exc
    if not isinstance(records, list):
        raise UsageError(f"{path} is not a JSON array of records; pass records with a `text` field")
    return tuple(_record_text(record, path, f"record {i}") for i, record in enumerate(records))


def _record_text(record: object, path: Path, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise UsageError(f"{path} {where} has no string `text` field; every record needs one")
    return str(record["text"])


def _parquet_text(path: Path) -> tuple[str, ...]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise UsageError(
            f"cannot read {path} as parquet ({exc}); pass a valid parquet file with a `text` column"
        ) from exc
    if "text" not in table.column_names:
        raise UsageError(f"{path} has no `text` column (columns: {', '.join(table.column_names)}); add one")
    values = table.column("text").to_pylist()
    if not all(isinstance(v, str) for v in values):
        raise UsageError(f"{path} column `text` has non-string values; every row needs a string")
    return tuple(values)


def from_hub(loader: Callable[[], tuple[str, ...]], description: str) -> tuple[RawText | None, str]:
    """Run a hub loader; (RawText, "") on success, (None, reason) when the hub is off or fails."""
    if not hub_enabled():
        return None, "HF hub disabled (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)"
    try:
        rows = loader()
    except (OSError, ValueError) as exc:  # ConnectionError, DatasetNotFoundError, gated repos are OSErrors
        return None, f"HF hub failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return RawText(rows=rows, description=description, offline=False), ""


def wikitext2_text(split: Literal["train", "test"], data_dir: Path | None) -> RawText:
    """WikiText-2 raw rows of `split`: the hub's wikitext-2-raw-v1, else the offline file.

    The offline folder has no train split: calibration ("train") falls back to the validation file,
    and the description says so.
    """
    raw, reason = from_hub(
        lambda: hub_rows("wikitext", "wikitext-2-raw-v1", split, "text"), f"wikitext-2-raw-v1 {split} (hub)"
    )
    if raw is not None:
        return raw
    if split == "train":
        path = offline_file(data_dir, WIKITEXT2_VALID, "wikitext2")
        note = "WikiText-2 VALIDATION split: the train split is not in the data folder"
    elif split == "test":
        path = offline_file(data_dir, WIKITEXT2_TEST, "wikitext2")
        note = "as HF wikitext-2-raw-v1 test rows"
    else:
        raise ValueError(f"unknown WikiText-2 split {split!r}; choose 'train' or 'test'")
    return RawText(wikitext_rows(path), f"offline {path} ({note}) [{reason}]", offline=True)


def ptb_text(split: Literal["train", "test"], data_dir: Path | None) -> RawText:
    """PTB sentences of `split`: the hub's ptb_text_only, else the offline file."""
    raw, reason = from_hub(
        lambda: hub_rows("ptb_text_only", "penn_treebank", split, "sentence"), f"ptb_text_only {split} (hub)"
    )
    if raw is not None:
        return raw
    if split == "train":
        path = offline_file(data_dir, PTB_TRAIN, "ptb")
    elif split == "test":
        path = offline_file(data_dir, PTB_TEST, "ptb")
    else:
        raise ValueError(f"unknown PTB split {split!r}; choose 'train' or 'test'")
    return RawText(ptb_sentences(path), f"offline {path} [{reason}]", offline=True)


def hub_rows(
    path: str, config: str | None, split: str, field: str, data_files: dict[str, str] | None = None
) -> tuple[str, ...]:
    """Rows of one text field of a hub dataset split."""
    from datasets import load_dataset

    dataset = load_dataset(path, config, split=split, data_files=data_files)
    return tuple(dataset[field])


def encode(tokenizer: object, text: str) -> torch.Tensor:
    """text → token ids (N,) long, as ``tokenizer(text)`` gives them (with the tokenizer's special tokens)."""
    ids = tokenizer(text, verbose=False, return_attention_mask=False)["input_ids"]  # type: ignore[operator]
    return torch.tensor(ids, dtype=torch.long)


def encode_documents(tokenizer: object, docs: tuple[str, ...], separator: int) -> torch.Tensor:
    """Documents → one token stream (N,) long: each document without special tokens, then `separator`."""
    encoded = tokenizer(list(docs), add_special_tokens=False, verbose=False, return_attention_mask=False)  # type: ignore[operator]
    pieces = [torch.tensor([*ids, separator], dtype=torch.long) for ids in encoded["input_ids"]]
    return torch.cat(pieces)

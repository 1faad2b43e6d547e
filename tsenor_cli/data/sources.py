"""Raw text of the language-modelling datasets: from the offline data folder or from the HF hub.

Which one is decided by the run context alone (`data_folder`; the rule is in tsenor_cli/settings.py):
the data folder when one is set, else the hub; never one after the other failed. The offline folder
(``--data-dir`` / $TSENOR_DATA_DIR, layout of ``shared/data``; see its README) holds WikiText-2 raw
test/valid, PTB train/valid/test, and a 1,000-document C4-en sample. This module turns those files
into the same rows the hub datasets give (``wikitext-2-raw-v1`` rows, ``ptb_text_only`` sentences,
C4 documents), so calibration and evaluation code do not care where the text came from, and records
where it came from as a `DataSource` (files with their sha256, or the hub dataset).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from tsenor_cli.errors import InputNotFoundError, UsageError
from tsenor_cli.runfiles import DataFile, DataKind, DataSource
from tsenor_cli.settings import RunContext

if TYPE_CHECKING:  # torch is imported where it is used: `tsenor --help` reads this module's names
    import torch

DatasetName = Literal["wikitext2", "ptb", "c4"]
DATASET_NAMES: tuple[DatasetName, ...] = ("wikitext2", "ptb", "c4")
# The same texts by name where a run reads training text (prune's --calib-data, finetune's --data): c4
# first, the paper's calibration set; any other value is a file.
NAMED_TEXTS: tuple[DatasetName, ...] = ("c4", "wikitext2", "ptb")

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
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class RawText:
    """Rows of text (documents, sentences or WikiText rows), a description and where they came from."""

    rows: tuple[str, ...]
    description: str
    source: DataSource


def data_folder(ctx: RunContext, dataset: str) -> Path | None:
    """The data folder `dataset` is read from, or None for the HF hub (the rule of tsenor_cli/settings.py).

    With the hub forbidden (offline) and no data folder there is no source: InputNotFoundError.
    """
    if ctx.data_dir is not None:
        return ctx.data_dir
    if ctx.offline:
        raise InputNotFoundError(
            f"no data for {dataset}: the HF hub is off (--offline or HF_HUB_OFFLINE) and no data folder is set; "
            "pass --data-dir with the offline data folder (or set TSENOR_DATA_DIR), or drop --offline"
        )
    return None


def offline_file(data_dir: Path, relative: str, dataset: str) -> Path:
    """data_dir / relative; InputNotFoundError with the fix when it is not there."""
    path = data_dir / relative
    if not path.is_file():
        raise InputNotFoundError(
            f"no data for {dataset}: {path} does not exist; pass --data-dir with a folder laid out as "
            f"shared/data (with {relative})"
        )
    return path


def sha256_file(path: Path) -> str:
    """Hex sha256 of the bytes of `path`."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_source(kind: DataKind, paths: Sequence[Path]) -> DataSource:
    """A DataSource for local files (kind "offline" or "file"), each with its absolute path and sha256."""
    return DataSource(kind=kind, files=tuple(DataFile(str(p.resolve()), sha256_file(p)) for p in paths))


def hub_source(path: str, config: str | None, split: str, data_files: dict[str, str] | None = None) -> DataSource:
    """A DataSource naming a hub dataset split, e.g. "allenai/c4 split=train file=en/c4-train...json.gz"."""
    name = path if config is None else f"{path}/{config}"
    files = "".join(f" file={f}" for f in (data_files or {}).values())
    return DataSource(kind="hub", hub=f"{name} split={split}{files}")


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


def from_hub(
    dataset: str, path: str, config: str | None, split: str, field: str, data_files: dict[str, str] | None = None
) -> RawText:
    """Rows of one text field of a hub dataset split; a failed download is InputNotFoundError naming --data-dir."""
    source = hub_source(path, config, split, data_files)
    try:
        rows = hub_rows(path, config, split, field, data_files)
    except (OSError, ValueError) as exc:  # ConnectionError, DatasetNotFoundError, gated repos are OSErrors
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise InputNotFoundError(
            f"cannot download {dataset} ({source.hub}) from the HF hub ({type(exc).__name__}: {first}); "
            "pass --data-dir with the offline data folder, or fix the connection"
        ) from exc
    return RawText(rows=rows, description=f"{source.hub} (hub)", source=source)


def wikitext2_text(split: Literal["train", "test"], ctx: RunContext) -> RawText:
    """WikiText-2 raw rows of `split`: the data folder's file when one is set, else the hub's wikitext-2-raw-v1.

    The offline folder has no train split: calibration ("train") reads the validation file instead,
    and the description says so.
    """
    if split not in ("train", "test"):
        raise ValueError(f"unknown WikiText-2 split {split!r}; choose 'train' or 'test'")
    folder = data_folder(ctx, "wikitext2")
    if folder is None:
        return from_hub("wikitext2", "wikitext", "wikitext-2-raw-v1", split, "text")
    if split == "train":
        path = offline_file(folder, WIKITEXT2_VALID, "wikitext2")
        note = "WikiText-2 VALIDATION split: the train split is not in the data folder"
    else:
        path = offline_file(folder, WIKITEXT2_TEST, "wikitext2")
        note = "as HF wikitext-2-raw-v1 test rows"
    return RawText(wikitext_rows(path), f"offline {path} ({note})", file_source("offline", [path]))


def ptb_text(split: Literal["train", "test"], ctx: RunContext) -> RawText:
    """PTB sentences of `split`: the data folder's file when one is set, else the hub's ptb_text_only."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown PTB split {split!r}; choose 'train' or 'test'")
    folder = data_folder(ctx, "ptb")
    if folder is None:
        return from_hub("ptb", "ptb_text_only", "penn_treebank", split, "sentence")
    path = offline_file(folder, PTB_TRAIN if split == "train" else PTB_TEST, "ptb")
    return RawText(ptb_sentences(path), f"offline {path}", file_source("offline", [path]))


def c4_documents(split: Literal["train", "validation"], ctx: RunContext) -> RawText:
    """C4 documents: the hub shard of `split` (SparseGPT's), or the data folder's C4-en sample split by
    position (documents C4_EVAL_DOCS and on for "train", the ones before for "validation")."""
    folder = data_folder(ctx, "c4")
    if folder is None:
        shard = C4_TRAIN_SHARD if split == "train" else C4_VALIDATION_SHARD
        return from_hub("c4", "allenai/c4", None, split, "text", {split: shard})
    path = offline_file(folder, C4_SAMPLE, "c4")
    docs = read_text_records(path)
    if split == "train":
        rows, first = docs[C4_EVAL_DOCS:], C4_EVAL_DOCS
        note = "not the c4-train shard; disjoint from the offline C4 eval documents"
    else:
        rows, first = docs[:C4_EVAL_DOCS], 0
        note = (
            "NOT the c4 validation shard, which is not in the data folder; "
            "numbers are not comparable to published C4 ppl"
        )
    description = f"offline C4-en sample {path} documents {first}-{first + len(rows) - 1} ({note})"
    return RawText(rows, description, file_source("offline", [path]))


def hub_rows(
    path: str, config: str | None, split: str, field: str, data_files: dict[str, str] | None = None
) -> tuple[str, ...]:
    """Rows of one text field of a hub dataset split."""
    from datasets import load_dataset

    dataset = load_dataset(path, config, split=split, data_files=data_files)
    return tuple(dataset[field])


def encode(tokenizer: object, text: str) -> torch.Tensor:
    """text → token ids (N,) long, as ``tokenizer(text)`` gives them (with the tokenizer's special tokens)."""
    import torch

    ids = tokenizer(text, verbose=False, return_attention_mask=False)["input_ids"]  # type: ignore[operator]
    return torch.tensor(ids, dtype=torch.long)


def encode_documents(tokenizer: object, docs: tuple[str, ...], separator: int) -> torch.Tensor:
    """Documents → one token stream (N,) long: each document without special tokens, then `separator`."""
    import torch

    encoded = tokenizer(list(docs), add_special_tokens=False, verbose=False, return_attention_mask=False)  # type: ignore[operator]
    pieces = [torch.tensor([*ids, separator], dtype=torch.long) for ids in encoded["input_ids"]]
    return torch.cat(pieces)

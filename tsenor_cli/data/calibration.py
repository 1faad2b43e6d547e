"""Calibration batches for layer-wise pruning (paper Section 4; SparseGPT/Wanda/ALPS protocol).

``calibration_batches`` returns `nsamples` token windows of `seqlen` tokens:

- ``c4`` (hub): SparseGPT's sampler on ``allenai/c4`` shard ``en/c4-train.00000-of-01024``: pick a random
  document longer than `seqlen` tokens, then a random window inside it (``random.Random(seed)``).
- ``c4`` (offline): the data folder's 1,000-document C4-en sample is too short for that (most documents
  have fewer than 2,048 tokens), so the calibration half of it (documents 500-999; 0-499 are the
  offline C4 evaluation text) is shuffled with ``random.Random(seed)``, each document is tokenized
  without special tokens and followed by EOS, and random windows are cut from that one stream.
- ``wikitext2`` / ``ptb``: the train split joined with " " (as SparseGPT does), random windows. Offline,
  WikiText-2 train is missing, so its validation split (``wiki.valid.raw``) is used instead.
- a file path (.txt, .jsonl, .json, .json.gz, .parquet with ``text``): documents joined as for offline C4.

Whether the named sources come from the hub or the offline folder is the run context's choice
(tsenor_cli/settings.py); `CalibrationData.source` records which, with the files' sha256. Random
windows come from a ``torch.Generator`` seeded with `seed`; the same arguments always give the same
tensor.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tsenor_cli.data import sources
from tsenor_cli.errors import UsageError
from tsenor_cli.runfiles import DataSource
from tsenor_cli.settings import RunContext


@dataclass(frozen=True)
class CalibrationData:
    """input_ids: (nsamples, seqlen) long; a description of the text; where it came from."""

    input_ids: torch.Tensor
    source_description: str
    source: DataSource

    @property
    def nsamples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seqlen(self) -> int:
        return int(self.input_ids.shape[1])


def random_windows(stream: torch.Tensor, nsamples: int, seqlen: int, generator: torch.Generator) -> torch.Tensor:
    """stream: (N,) long → (nsamples, seqlen) windows; starts uniform in [0, N - seqlen - 1] as in SparseGPT.

    Needs N > seqlen.
    """
    total = int(stream.shape[0])
    starts = torch.randint(0, total - seqlen, (nsamples,), generator=generator)  # (nsamples,)
    index = starts[:, None] + torch.arange(seqlen)  # (nsamples, seqlen)
    return stream[index]


def _check_stream(stream: torch.Tensor, seqlen: int, what: str) -> None:
    if stream.shape[0] <= seqlen:
        raise UsageError(
            f"{what} has only {stream.shape[0]} tokens, need more than --seqlen {seqlen}; "
            "pass more text or a smaller --seqlen"
        )


def document_separator(tokenizer: object) -> int:
    """The token that ends each document in a packed stream: EOS, else SEP, else BOS."""
    for attr in ("eos_token_id", "sep_token_id", "bos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    raise UsageError(
        "the tokenizer has no EOS/SEP/BOS token to separate documents; use a tokenizer that defines eos_token"
    )


def shuffled_documents(docs: tuple[str, ...], seed: int) -> tuple[str, ...]:
    """`docs` in the order of ``random.Random(seed).shuffle`` (the same seed, the same order)."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    return tuple(docs[i] for i in order)


def _document_windows(
    tokenizer: object, docs: tuple[str, ...], nsamples: int, seqlen: int, seed: int, what: str
) -> torch.Tensor:
    stream = sources.encode_documents(tokenizer, shuffled_documents(docs, seed), document_separator(tokenizer))  # (N,)
    _check_stream(stream, seqlen, what)
    return random_windows(stream, nsamples, seqlen, torch.Generator().manual_seed(seed))


def _text_windows(tokenizer: object, text: str, nsamples: int, seqlen: int, seed: int, what: str) -> torch.Tensor:
    stream = sources.encode(tokenizer, text)  # (N,)
    _check_stream(stream, seqlen, what)
    return random_windows(stream, nsamples, seqlen, torch.Generator().manual_seed(seed))


def _sparsegpt_c4_windows(
    docs: tuple[str, ...], tokenizer: object, nsamples: int, seqlen: int, seed: int
) -> torch.Tensor:
    """SparseGPT's C4 sampler (datautils.get_c4): a random document longer than `seqlen` tokens, then a
    random window in it, `nsamples` times → (nsamples, seqlen) long."""
    rng = random.Random(seed)
    windows = []
    for _ in range(nsamples):
        while True:
            ids = sources.encode(tokenizer, docs[rng.randint(0, len(docs) - 1)])
            if ids.shape[0] > seqlen:
                break
        start = rng.randint(0, int(ids.shape[0]) - seqlen - 1)
        windows.append(ids[start : start + seqlen])
    return torch.stack(windows)


# The tokens per sample the blocks of a run that reads no data run on (`stand_in_batches`).
STAND_IN_SEQLEN = 4


def stand_in_batches(tokenizer: object, *, nsamples: int, seqlen: int, method: str) -> CalibrationData:
    """What a run of a method that reads no data (`PrunerSpec.needs_data` False: magnitude)
    gives its blocks instead of calibration text: `nsamples` rows (one per process:
    `PrunePlan.calibration_samples`) of `seqlen` (`STAND_IN_SEQLEN`) copies of the tokenizer's BOS token
    (else EOS, else 0). No data is read: the blocks run on these to show what each weight multiplies
    (`pruning/block/observe.py`) and to hand each block its input, and no statistics are gathered from them
    (`engine.BlockPruner`)."""
    token = next((t for t in (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None))
                  if isinstance(t, int)), 0)  # fmt: skip
    return CalibrationData(
        input_ids=torch.full((nsamples, seqlen), token, dtype=torch.long),
        source_description=f"none ({method} reads no data; the blocks ran on {nsamples}×{seqlen} stand-in tokens)",
        source=DataSource(kind="none"),
    )


def calibration_batches(
    source: str,
    tokenizer: object,
    ctx: RunContext,
    *,
    nsamples: int = 128,
    seqlen: int = 2048,
    seed: int = 0,
) -> CalibrationData:
    """`nsamples` windows of `seqlen` tokens from `source` (c4 | wikitext2 | ptb | a file path).

    Returns CalibrationData with input_ids (nsamples, seqlen) long on CPU.
    """
    if nsamples < 1 or seqlen < 1:
        raise UsageError(f"nsamples and seqlen must be positive, got {nsamples} and {seqlen}")
    if source == "c4":
        raw = sources.c4_documents("train", ctx)
        if raw.source.kind == "hub":
            ids = _sparsegpt_c4_windows(raw.rows, tokenizer, nsamples, seqlen, seed)
            how = f"random document > {seqlen} tokens, random window (SparseGPT), seed {seed}"
        else:
            ids = _document_windows(tokenizer, raw.rows, nsamples, seqlen, seed, raw.description)
            how = f"shuffled (seed {seed}), EOS-separated into one stream, {nsamples} random {seqlen}-token windows"
        return CalibrationData(ids, f"{raw.description}: {how}", raw.source)
    if source == "wikitext2":
        raw = sources.wikitext2_text("train", ctx)
        ids = _text_windows(tokenizer, " ".join(raw.rows), nsamples, seqlen, seed, "wikitext2")
        return CalibrationData(ids, f"{raw.description}: rows joined with ' ', random windows, seed {seed}", raw.source)
    if source == "ptb":
        raw = sources.ptb_text("train", ctx)
        ids = _text_windows(tokenizer, " ".join(raw.rows), nsamples, seqlen, seed, "ptb")
        return CalibrationData(
            ids, f"{raw.description}: sentences joined with ' ', random windows, seed {seed}", raw.source
        )
    path = Path(source).expanduser()
    if not path.exists() and not any(source.lower().endswith(s) for s in sources.LOCAL_SUFFIXES) and "/" not in source:
        raise UsageError(f"unknown calibration source {source!r}; use c4, wikitext2, ptb or a path to a text file")
    docs = sources.read_text_records(path)
    ids = _document_windows(tokenizer, docs, nsamples, seqlen, seed, str(path))
    description = (
        f"file {path} ({len(docs)} documents): shuffled (seed {seed}), EOS-separated into one stream, "
        f"{nsamples} random {seqlen}-token windows"
    )
    return CalibrationData(ids, description, sources.file_source("file", [path]))

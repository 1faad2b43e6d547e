"""Training text for `tsenor finetune`: the calibration readers, packed into consecutive windows.

- ``c4``: documents the C4 perplexity evaluation never reads. Offline: documents
  ``C4_EVAL_DOCS``-999 of the data folder's C4-en sample (``eval`` reads 0-``C4_EVAL_DOCS - 1``; the
  same half calibration uses). Hub: the ``c4-train`` shard calibration samples from (``eval`` reads
  the validation shard).
- ``wikitext2`` / ``ptb``: the train split joined with " " as calibration does (offline WikiText-2:
  its validation split, the train split is not in the data folder); ``eval`` reads the test splits.
- a file path: its documents.
- ``calibration``: the pruning run's own calibration windows (`calibration_windows`), made again by
  the function that made them for the prune, from the settings its report records; training on them
  uses no text the prune did not already read ("from calibration data alone").

Documents are shuffled with ``random.Random(seed)``, tokenized without special tokens and followed
by EOS, as for calibration; the stream is then cut into consecutive, non-overlapping windows (the
tail is dropped) instead of random ones, so no token is trained on twice per pass. Only as many
documents are tokenized as the run needs (the hub shard has 356k).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from tsenor_cli.data import sources
from tsenor_cli.data.calibration import calibration_batches, document_separator, shuffled_documents
from tsenor_cli.errors import UsageError
from tsenor_cli.runfiles import DataSource, PruneReport
from tsenor_cli.settings import RunContext

# Documents tokenized per batch while filling the stream (the tokenizer is fastest in batches).
_ENCODE_CHUNK = 64


@dataclass(frozen=True)
class TrainingText:
    """windows: (W, seqlen) long, consecutive pieces of one token stream; where the text came from.

    documents: the documents (in stream order) whose tokens the windows hold, None for joined text
    (WikiText-2, PTB), where the windows are the first W·seqlen tokens of the split.
    """

    windows: torch.Tensor
    description: str
    source: DataSource
    documents: tuple[str, ...] | None

    @property
    def seqlen(self) -> int:
        """Tokens per window: `--seqlen`, or the prune's own for `--data calibration`."""
        return int(self.windows.shape[1])


class WindowDataset(Dataset[dict[str, torch.Tensor]]):
    """Trainer's view of the windows: causal-LM items whose labels are the inputs (the model shifts)."""

    def __init__(self, windows: torch.Tensor) -> None:
        self.windows = windows  # (W, seqlen) long

    def __len__(self) -> int:
        return int(self.windows.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows[index]  # (seqlen,)
        return {"input_ids": window, "labels": window}


def _pack(stream: torch.Tensor, seqlen: int, limit: int) -> torch.Tensor:
    """stream (N,) → (min(limit, N // seqlen), seqlen), a view of its first tokens."""
    count = min(limit, int(stream.shape[0]) // seqlen)
    return stream[: count * seqlen].view(count, seqlen)


def _document_stream(
    tokenizer: object, docs: tuple[str, ...], seed: int, tokens: int
) -> tuple[torch.Tensor, tuple[str, ...]]:
    """Shuffled documents, EOS-separated, until the stream holds `tokens` tokens (or all are used).

    Returns the stream (N,) long and the documents it holds, in order.
    """
    order = shuffled_documents(docs, seed)
    separator = document_separator(tokenizer)
    pieces: list[torch.Tensor] = []
    total = used = 0
    while used < len(order) and total < tokens:
        chunk = order[used : used + _ENCODE_CHUNK]
        pieces.append(sources.encode_documents(tokenizer, chunk, separator))
        total += int(pieces[-1].shape[0])
        used += len(chunk)
    return torch.cat(pieces), order[:used]


def training_windows(
    source: str,
    tokenizer: object,
    *,
    seqlen: int,
    windows: int,
    seed: int,
    ctx: RunContext,
) -> TrainingText:
    """Up to `windows` consecutive windows of `seqlen` tokens from `source` (c4 | wikitext2 | ptb | a file).

    Fewer windows come back when the text is shorter; the trainer then passes over them again.
    Raises UsageError when the text does not fill one window.
    """
    if seqlen < 2 or windows < 1:
        raise UsageError(f"seqlen must be >= 2 and windows >= 1, got {seqlen} and {windows}")
    tokens = windows * seqlen
    if source == "c4":
        # The half of the C4 text the C4 perplexity evaluation never reads (sources.c4_documents).
        raw = sources.c4_documents("train", ctx)
    elif source in ("wikitext2", "ptb"):
        raw = sources.wikitext2_text("train", ctx) if source == "wikitext2" else sources.ptb_text("train", ctx)
        stream = sources.encode(tokenizer, " ".join(raw.rows))  # (N,)
        packed = _pack(stream, seqlen, windows)
        _check_filled(packed, stream, seqlen, source)
        description = f"{raw.description}: joined with ' ', first {packed.shape[0]} windows of {seqlen} tokens"
        return TrainingText(packed, description, raw.source, None)
    else:
        path = Path(source).expanduser()
        docs = sources.read_text_records(path)
        raw = sources.RawText(docs, f"file {path} ({len(docs)} documents)", sources.file_source("file", [path]))
    docs, where = raw.rows, raw.description
    stream, used = _document_stream(tokenizer, docs, seed, tokens)
    packed = _pack(stream, seqlen, windows)
    _check_filled(packed, stream, seqlen, source)
    description = (
        f"{where}: {len(used)} documents shuffled (seed {seed}), EOS-separated, "
        f"{packed.shape[0]} consecutive windows of {seqlen} tokens"
    )
    return TrainingText(packed, description, raw.source, used)


def calibration_windows(report: PruneReport, tokenizer: object, *, ctx: RunContext) -> TrainingText:
    """The windows the prune calibrated on: (nsamples, seqlen) long, as its report records them.

    They come from `data.calibration.calibration_batches` with the prune's calibration source, sample
    count, length (the capped one it ran with) and seed, so they are the same tokens. Raises UsageError
    when the prune read no text (a method that needs none), when the report records no calibration
    settings, or when the text read now is described differently from the prune's (another data folder,
    or the hub instead of offline files) or its files' sha256s differ from the recorded ones: then the
    windows would not be the ones the prune read.
    """
    if report.calibration_source is not None and report.calibration_source.kind == "none":
        raise UsageError(
            f"the prune read no calibration text ({report.calibration}); pass --data c4, wikitext2, ptb or a file"
        )
    settings = report.settings
    try:
        source = str(settings["calib_data"])
        nsamples, seqlen, seed = int(settings["nsamples"]), int(settings["seqlen"]), int(settings["seed"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(
            f"the prune's report records no calibration settings ({exc}); pass --data c4 or re-run tsenor prune"
        ) from exc
    calib = calibration_batches(source, tokenizer, ctx, nsamples=nsamples, seqlen=seqlen, seed=seed)
    if calib.source_description != report.calibration:
        raise UsageError(
            f"--data calibration reads '{calib.source_description}', but the prune calibrated on "
            f"'{report.calibration}'; pass the prune's --data-dir (or --offline setting), or another --data"
        )
    recorded = report.calibration_source  # its files' sha256s, when the report records them
    if recorded is not None and recorded.files and recorded.files != calib.source.files:
        changed = ", ".join(f.path for f in recorded.files if f not in calib.source.files) or "the file list"
        raise UsageError(
            f"--data calibration: {changed} changed since the prune read it (another sha256); restore the "
            "file the prune read, or pass another --data"
        )
    description = f"the prune's calibration windows: {calib.source_description}"
    return TrainingText(calib.input_ids, description, calib.source, None)


def _check_filled(packed: torch.Tensor, stream: torch.Tensor, seqlen: int, source: str) -> None:
    if packed.shape[0] == 0:
        raise UsageError(
            f"--data {source} has only {stream.shape[0]} tokens, fewer than one window of --seqlen {seqlen}; "
            "pass more text or a smaller --seqlen"
        )

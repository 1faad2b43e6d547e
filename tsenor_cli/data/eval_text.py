"""Evaluation token streams for perplexity (paper Section 5.2; SparseGPT/Wanda protocol).

- ``wikitext2``: ``wikitext-2-raw-v1`` test rows joined with "\\n\\n". Offline: ``wiki.test.raw`` turned
  into the same HF rows (see sources.wikitext_rows), so the token stream is identical.
- ``ptb``: ``ptb_text_only`` test sentences joined with " ". Offline: ``ptb.test.txt``, one sentence a line.
- ``c4``: the first 1,100 documents of validation shard ``en/c4-validation.00000-of-00008`` joined with
  " ", cut to the first 256×seqlen tokens. Offline no validation slice exists: documents 0-499 of the
  data folder's C4-en sample (train-distribution documents) are used the same way; the description says so.

Hub or offline folder: the run context decides (tsenor_cli/settings.py); `EvalText.source` records which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tsenor_cli.data import sources
from tsenor_cli.errors import UsageError
from tsenor_cli.runfiles import DataSource
from tsenor_cli.settings import RunContext

C4_EVAL_DOCS_HUB = 1100
C4_EVAL_WINDOWS = 256


@dataclass(frozen=True)
class EvalText:
    """input_ids: (1, T) long; a description of the text; where it came from."""

    input_ids: torch.Tensor
    description: str
    source: DataSource

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])


def eval_token_stream(
    name: sources.DatasetName,
    tokenizer: object,
    ctx: RunContext,
    *,
    seqlen: int,
) -> EvalText:
    """The evaluation text of `name` tokenized into one stream (1, T) long on CPU."""
    if seqlen < 2:
        raise UsageError(f"seqlen must be at least 2, got {seqlen}")
    if name == "wikitext2":
        raw = sources.wikitext2_text("test", ctx)
        ids = sources.encode(tokenizer, "\n\n".join(raw.rows))
        return EvalText(ids[None, :], f"{raw.description}, rows joined with '\\n\\n'", raw.source)
    if name == "ptb":
        raw = sources.ptb_text("test", ctx)
        ids = sources.encode(tokenizer, " ".join(raw.rows))
        return EvalText(ids[None, :], f"{raw.description}, sentences joined with ' '", raw.source)
    if name == "c4":
        raw = sources.c4_documents("validation", ctx)
        rows, description = raw.rows, raw.description
        if raw.source.kind == "hub":
            rows, description = rows[:C4_EVAL_DOCS_HUB], f"{description} first {C4_EVAL_DOCS_HUB} documents"
        ids = sources.encode(tokenizer, " ".join(rows))[: C4_EVAL_WINDOWS * seqlen]
        return EvalText(
            ids[None, :], f"{description}, joined with ' ', first {C4_EVAL_WINDOWS}×{seqlen} tokens", raw.source
        )
    raise UsageError(f"unknown evaluation dataset {name!r}; use one of: {', '.join(sources.DATASET_NAMES)}")

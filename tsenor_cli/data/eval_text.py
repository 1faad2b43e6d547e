"""Evaluation token streams for perplexity (paper Section 5.2; SparseGPT/Wanda protocol).

- ``wikitext2``: ``wikitext-2-raw-v1`` test rows joined with "\\n\\n". Offline: ``wiki.test.raw`` turned
  into the same HF rows (see sources.wikitext_rows), so the token stream is identical.
- ``ptb``: ``ptb_text_only`` test sentences joined with " ". Offline: ``ptb.test.txt``, one sentence a line.
- ``c4``: the first 1,100 documents of validation shard ``en/c4-validation.00000-of-00008`` joined with
  " ", cut to the first 256×seqlen tokens. Offline no validation slice exists: documents 0-499 of the
  data folder's C4-en sample (train-distribution documents) are used the same way; the description says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from tsenor_cli.data import sources
from tsenor_cli.errors import UsageError

C4_EVAL_DOCS_HUB = 1100
C4_EVAL_WINDOWS = 256


@dataclass(frozen=True)
class EvalText:
    """input_ids: (1, T) long; where the text came from; whether the offline folder was used."""

    input_ids: torch.Tensor
    description: str
    offline: bool

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])


def eval_token_stream(
    name: Literal["wikitext2", "ptb", "c4"],
    tokenizer: object,
    *,
    seqlen: int,
    data_dir: Path | None = None,
) -> EvalText:
    """The evaluation text of `name` tokenized into one stream (1, T) long on CPU."""
    if seqlen < 2:
        raise UsageError(f"seqlen must be at least 2, got {seqlen}")
    if name == "wikitext2":
        raw = sources.wikitext2_text("test", data_dir)
        ids = sources.encode(tokenizer, "\n\n".join(raw.rows))
        return EvalText(ids[None, :], f"{raw.description}, rows joined with '\\n\\n'", raw.offline)
    if name == "ptb":
        raw = sources.ptb_text("test", data_dir)
        ids = sources.encode(tokenizer, " ".join(raw.rows))
        return EvalText(ids[None, :], f"{raw.description}, sentences joined with ' '", raw.offline)
    if name == "c4":
        hub, reason = sources.from_hub(
            lambda: sources.hub_rows(
                "allenai/c4", None, "validation", "text", {"validation": sources.C4_VALIDATION_SHARD}
            )[:C4_EVAL_DOCS_HUB],
            f"allenai/c4 {sources.C4_VALIDATION_SHARD} first {C4_EVAL_DOCS_HUB} documents (hub)",
        )
        if hub is not None:
            raw = hub
        else:
            path = sources.offline_file(data_dir, sources.C4_SAMPLE, "c4")
            docs = sources.read_text_records(path)[: sources.C4_EVAL_DOCS]
            raw = sources.RawText(
                docs,
                f"offline C4-en sample {path} documents 0-{len(docs) - 1} "
                "(NOT the c4 validation shard, which is "
                f"not in the data folder; numbers are not comparable to published C4 ppl) [{reason}]",
                True,
            )
        ids = sources.encode(tokenizer, " ".join(raw.rows))[: C4_EVAL_WINDOWS * seqlen]
        return EvalText(
            ids[None, :],
            f"{raw.description}, joined with ' ', first {C4_EVAL_WINDOWS}×{seqlen} tokens",
            raw.offline,
        )
    raise UsageError(f"unknown evaluation dataset {name!r}; use one of: {', '.join(sources.DATASET_NAMES)}")

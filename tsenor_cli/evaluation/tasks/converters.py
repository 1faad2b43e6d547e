"""Turn the offline data folder's files into the document dicts lm-eval's task definitions read.

Each `*_docs` function is pure (records in, docs out) and produces exactly the fields the official
lm-eval 0.4 task YAML reads (same names, same types), so our YAMLs keep the official
doc_to_text / doc_to_choice / doc_to_target. The `load_*` functions are lm-eval `custom_dataset`
hooks: lm-eval calls them with the task metadata as keyword arguments, and `run_zeroshot` puts the
data folder in that metadata as ``data_dir``. Differences from the hub data: docs/guide/zeroshot.md.
"""

from __future__ import annotations

import bz2
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tsenor_cli.errors import InputNotFoundError, UsageError

Doc = dict[str, Any]

# What each task reads, relative to the data folder (layout of ../shared/data, see its README).
# RTE reads the GLUE parquet (the exact set lm-eval's `rte` scores) and accepts the SuperGLUE jsonl
# (same 277 pairs, string labels) when the parquet is absent.
TASK_FILES: dict[str, tuple[tuple[str, ...], ...]] = {
    "piqa": (("piqa/valid.jsonl",), ("piqa/valid-labels.lst",)),
    "arc_easy": (("arc/arc_easy.llmfoundry.jsonl",),),
    "arc_challenge": (("arc/arc_challenge.llmfoundry.jsonl",),),
    "hellaswag": (("hellaswag/hellaswag_val_full.txt.bz2",),),
    "winogrande": (("winogrande/dev.jsonl",), ("winogrande/dev-labels.lst",)),
    "rte": (("rte/glue-rte-validation.parquet", "rte/val.jsonl"),),
    "openbookqa": (("openbookqa/openbook_qa.llmfoundry.jsonl",),),
    "boolq": (("boolq/boolq.llmfoundry.jsonl",),),
}

_ABCD = ("A", "B", "C", "D", "E", "F", "G", "H")


def resolve_files(task: str, data_dir: Path) -> tuple[Path, ...]:
    """The files `task` reads under `data_dir`, first existing alternative of each; missing → error."""
    if task not in TASK_FILES:
        raise UsageError(f"no offline data for task {task!r}; choose one of {', '.join(TASK_FILES)}")
    found: list[Path] = []
    for alternatives in TASK_FILES[task]:
        paths = [data_dir / rel for rel in alternatives]
        existing = [p for p in paths if p.is_file()]
        if not existing:
            raise InputNotFoundError(
                f"offline data for {task} not found: {' or '.join(map(str, paths))}; pass --data-dir with a "
                "folder laid out as shared/data (see its README.md)"
            )
        found.append(existing[0])
    return tuple(found)


# ---------------------------------------------------------------- readers


def read_jsonl(path: Path) -> list[Doc]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_labels(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as fh:
        return [line.strip() for line in fh if line.strip()]


def _require(record: Mapping[str, Any], keys: Sequence[str], source: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise UsageError(
            f"{source}: record lacks {', '.join(missing)}; the offline data folder must hold the files "
            "described in shared/data/README.md"
        )


# ---------------------------------------------------------------- pure converters


def piqa_docs(records: Sequence[Mapping[str, Any]], labels: Sequence[str]) -> list[Doc]:
    """PIQA valid.jsonl + valid-labels.lst → hub `baber/piqa` docs {goal, sol1, sol2, label:int}."""
    if len(records) != len(labels):
        raise UsageError(f"piqa: {len(records)} records but {len(labels)} labels; the two files must pair up")
    docs = []
    for record, label in zip(records, labels, strict=True):
        _require(record, ("goal", "sol1", "sol2"), "piqa")
        docs.append({"goal": record["goal"], "sol1": record["sol1"], "sol2": record["sol2"], "label": int(label)})
    return docs


def winogrande_docs(records: Sequence[Mapping[str, Any]], labels: Sequence[str]) -> list[Doc]:
    """WinoGrande dev.jsonl + dev-labels.lst → hub docs {sentence, option1, option2, answer:"1"|"2"}.

    The labels file is authoritative; an `answer` inside a record must agree with it.
    """
    if len(records) != len(labels):
        raise UsageError(f"winogrande: {len(records)} records but {len(labels)} labels; the files must pair up")
    docs = []
    for i, (record, label) in enumerate(zip(records, labels, strict=True)):
        _require(record, ("sentence", "option1", "option2"), "winogrande")
        if label not in ("1", "2") or record.get("answer", label) != label:
            raise UsageError(f"winogrande: record {i} has answer {record.get('answer')!r} but label {label!r}")
        docs.append(
            {
                "sentence": record["sentence"],
                "option1": record["option1"],
                "option2": record["option2"],
                "answer": label,
            }
        )
    return docs


_RTE_LABELS = {"entailment": 0, "not_entailment": 1}


def rte_docs_from_superglue(records: Sequence[Mapping[str, Any]]) -> list[Doc]:
    """SuperGLUE RTE val.jsonl {premise, hypothesis, label:str} → GLUE docs {sentence1, sentence2, label}.

    GLUE's label 0 is entailment, which lm-eval's `rte` maps to the choice "True".
    """
    docs = []
    for record in records:
        _require(record, ("premise", "hypothesis", "label", "idx"), "rte")
        if record["label"] not in _RTE_LABELS:
            raise UsageError(f"rte: unknown label {record['label']!r}; expected entailment or not_entailment")
        docs.append(
            {
                "sentence1": record["premise"],
                "sentence2": record["hypothesis"],
                "label": _RTE_LABELS[record["label"]],
                "idx": int(record["idx"]),
            }
        )
    return docs


def _capitalize_ctx_b(body: str) -> str:
    """Upper-case the first letter of the trailing incomplete sentence (HellaSwag's `ctx_b`).

    lm-eval builds ``ctx_a + " " + ctx_b.capitalize()``; the llama.cpp file joined ctx_a and ctx_b
    without capitalizing and dropped the split point. ctx_b is the incomplete last sentence, so the
    text after the last sentence end is ctx_b whenever it starts in lower case.
    """
    tail_start = 0
    for match in re.finditer(r"[.!?] ", body):
        tail_start = match.end()
    tail = body[tail_start:]
    if tail[:1].islower():
        return body[:tail_start] + tail[0].upper() + tail[1:]
    return body


def hellaswag_docs(text: str) -> list[Doc]:
    """llama.cpp HellaSwag text (6 lines per item) → lm-eval's processed docs {query, choices, label, gold}.

    Lines per item: ``activity_label + ": " + ctx``, the gold index (0-3), then the 4 endings. The
    strings already went through lm-eval's `preprocess` ([title] rewritten, [header]/[step] removed,
    stripped), so only ctx_b's capitalization is restored here.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    if len(lines) % 6:
        raise UsageError(f"hellaswag: {len(lines)} lines is not a multiple of 6; expected llama.cpp's format")
    docs = []
    for start in range(0, len(lines), 6):
        header, gold, *endings = lines[start : start + 6]
        if gold not in ("0", "1", "2", "3"):
            raise UsageError(f"hellaswag: line {start + 2} is {gold!r}, expected a gold index 0-3")
        label, sep, body = header.partition(": ")
        query = f"{label}: {_capitalize_ctx_b(body)}" if sep else _capitalize_ctx_b(header)
        docs.append({"query": query, "choices": endings, "label": gold, "gold": int(gold)})
    return docs


def _mosaic_choices(record: Mapping[str, Any], n_choices: int, source: str) -> tuple[list[str], int]:
    _require(record, ("query", "choices", "gold"), source)
    choices = list(record["choices"])
    gold = int(record["gold"])
    if len(choices) != n_choices or not 0 <= gold < n_choices:
        raise UsageError(
            f"{source}: expected {n_choices} choices and a gold index below it, got {len(choices)} and {gold}"
        )
    return choices, gold


def arc_doc(record: Mapping[str, Any]) -> Doc:
    """MosaicML ARC {query: "Question: …", choices[4], gold} → hub ai2_arc {question, choices, answerKey}."""
    choices, gold = _mosaic_choices(record, 4, "arc")
    query = str(record["query"])
    if not query.startswith("Question: "):
        raise UsageError(f"arc: query {query[:40]!r} does not start with 'Question: ' (MosaicML ICL format)")
    return {
        "question": query.removeprefix("Question: "),
        "choices": {"text": choices, "label": list(_ABCD[: len(choices)])},
        "answerKey": _ABCD[gold],
    }


def openbookqa_doc(record: Mapping[str, Any]) -> Doc:
    """MosaicML OpenBookQA {query: stem, choices[4], gold} → hub {question_stem, choices, answerKey}."""
    choices, gold = _mosaic_choices(record, 4, "openbookqa")
    return {
        "question_stem": str(record["query"]),
        "choices": {"text": choices, "label": list(_ABCD[: len(choices)])},
        "answerKey": _ABCD[gold],
    }


def boolq_doc(record: Mapping[str, Any]) -> Doc:
    """MosaicML BoolQ {query: "Passage: P\\nQuestion: Q?", choices [no, yes], gold} → hub docs.

    Hub docs are {passage, question, label}.

    lm-eval appends the "?" itself, so it is removed from the question here.
    """
    choices, gold = _mosaic_choices(record, 2, "boolq")
    query = str(record["query"])
    if choices != ["no", "yes"] or not query.startswith("Passage: ") or "\nQuestion: " not in query:
        raise UsageError(f"boolq: record {query[:40]!r} is not MosaicML's 'Passage: …\\nQuestion: …?' format")
    passage, _, question = query.removeprefix("Passage: ").rpartition("\nQuestion: ")
    return {"passage": passage, "question": question.removesuffix("?"), "label": gold}


# ---------------------------------------------------------------- winogrande prompt (partial scoring)
# Copied from lm_eval/tasks/winogrande/preprocess_winogrande.py (0.4.13): the context is the
# sentence up to the blank with each option filled in, and the shared target is the rest.


def winogrande_doc_to_text(doc: Mapping[str, Any]) -> int:
    answer_to_num = {"1": 0, "2": 1}
    return answer_to_num[doc["answer"]]


def winogrande_doc_to_target(doc: Mapping[str, Any]) -> str:
    idx = doc["sentence"].index("_") + 1
    return str(doc["sentence"][idx:].strip())


def winogrande_doc_to_choice(doc: Mapping[str, Any]) -> list[str]:
    idx = doc["sentence"].index("_")
    return [doc["sentence"][:idx] + opt for opt in (doc["option1"], doc["option2"])]


# ---------------------------------------------------------------- lm-eval custom_dataset hooks


def _data_dir(kwargs: Mapping[str, Any]) -> Path:
    value = kwargs.get("data_dir")
    if not value:
        raise InputNotFoundError(
            "offline zero-shot tasks need the data folder; pass --data-dir (layout of shared/data)"
        )
    return Path(str(value))


def _dataset(docs: list[Doc], split: str) -> dict[str, Any]:
    import datasets

    return {split: datasets.Dataset.from_list(docs)}


def load_piqa(**kwargs: Any) -> dict[str, Any]:
    records, labels = resolve_files("piqa", _data_dir(kwargs))
    return _dataset(piqa_docs(read_jsonl(records), read_labels(labels)), "validation")


def load_winogrande(**kwargs: Any) -> dict[str, Any]:
    records, labels = resolve_files("winogrande", _data_dir(kwargs))
    return _dataset(winogrande_docs(read_jsonl(records), read_labels(labels)), "validation")


def load_rte(**kwargs: Any) -> dict[str, Any]:
    (path,) = resolve_files("rte", _data_dir(kwargs))
    if path.suffix == ".parquet":
        # pyarrow directly: datasets.Dataset.from_parquet would copy the file into the HF cache.
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        for row in rows:
            _require(row, ("sentence1", "sentence2", "label", "idx"), "rte")
        docs = [
            {
                "sentence1": r["sentence1"],
                "sentence2": r["sentence2"],
                "label": int(r["label"]),
                "idx": int(r["idx"]),
            }
            for r in rows
        ]
        return _dataset(docs, "validation")
    return _dataset(rte_docs_from_superglue(read_jsonl(path)), "validation")


def load_hellaswag(**kwargs: Any) -> dict[str, Any]:
    (path,) = resolve_files("hellaswag", _data_dir(kwargs))
    with bz2.open(path, "rt", encoding="utf-8") as fh:
        text = fh.read()
    return _dataset(hellaswag_docs(text), "validation")


def load_arc_easy(**kwargs: Any) -> dict[str, Any]:
    (path,) = resolve_files("arc_easy", _data_dir(kwargs))
    return _dataset([arc_doc(r) for r in read_jsonl(path)], "test")


def load_arc_challenge(**kwargs: Any) -> dict[str, Any]:
    (path,) = resolve_files("arc_challenge", _data_dir(kwargs))
    return _dataset([arc_doc(r) for r in read_jsonl(path)], "test")


def load_openbookqa(**kwargs: Any) -> dict[str, Any]:
    (path,) = resolve_files("openbookqa", _data_dir(kwargs))
    return _dataset([openbookqa_doc(r) for r in read_jsonl(path)], "test")


def load_boolq(**kwargs: Any) -> dict[str, Any]:
    (path,) = resolve_files("boolq", _data_dir(kwargs))
    return _dataset([boolq_doc(r) for r in read_jsonl(path)], "validation")

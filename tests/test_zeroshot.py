"""Zero-shot evaluation: offline task configs, converters, source choice and the average."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from helpers_tiny import LOCAL_CTX

from tsenor_cli.errors import InputNotFoundError, UsageError
from tsenor_cli.evaluation.tasks import converters
from tsenor_cli.evaluation.zeroshot import (
    PAPER_TASKS,
    TASKS_DIR,
    ZeroShotTasks,
    _hub_task_source,
    average_acc,
    run_zeroshot,
    task_source,
)
from tsenor_cli.runfiles import DataSource, TaskScore
from tsenor_cli.settings import RunContext

# ---------------------------------------------------------------- converters on hand-made inputs


def test_hellaswag_six_line_record_to_doc() -> None:
    text = (
        "Roof shingle removal: A man is sitting on a roof. he\n"
        "3\n"
        "is using wrap to wrap a pair of skis.\n"
        "is ripping level tiles off.\n"
        "is holding a rubik's cube.\n"
        "starts pulling up roofing on a roof.\n"
        "Health: How to relax. Breathe slowly. Count to ten.\n"
        "0\na\nb\nc\nd\n"
    )
    first, second = converters.hellaswag_docs(text)
    # lm-eval: preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())
    assert first == {
        "query": "Roof shingle removal: A man is sitting on a roof. He",
        "choices": [
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a rubik's cube.",
            "starts pulling up roofing on a roof.",
        ],
        "label": "3",
        "gold": 3,
    }
    # A context ending in a full sentence (empty ctx_b, as WikiHow items) is left as it is.
    assert second["query"] == "Health: How to relax. Breathe slowly. Count to ten."
    assert second["gold"] == 0


def test_hellaswag_rejects_a_broken_file() -> None:
    with pytest.raises(UsageError, match="multiple of 6"):
        converters.hellaswag_docs("a: b\n1\nx\ny\n")
    with pytest.raises(UsageError, match="gold index"):
        converters.hellaswag_docs("a: b\n7\nw\nx\ny\nz\n")


def test_arc_and_openbookqa_docs_match_hub_fields() -> None:
    record = {"query": "Question: Which is a gas?", "choices": ["ice", "steam", "rock", "wood"], "gold": 1}
    doc = converters.arc_doc(record)
    assert doc == {
        "question": "Which is a gas?",
        "choices": {"text": ["ice", "steam", "rock", "wood"], "label": ["A", "B", "C", "D"]},
        "answerKey": "B",
    }
    obqa = converters.openbookqa_doc({"query": "The sun is", "choices": ["a", "b", "c", "d"], "gold": 3})
    assert obqa["question_stem"] == "The sun is" and obqa["answerKey"] == "D"
    with pytest.raises(UsageError, match="Question: "):
        converters.arc_doc({"query": "Which?", "choices": ["a", "b", "c", "d"], "gold": 0})
    with pytest.raises(UsageError, match="4 choices"):
        converters.arc_doc({"query": "Question: x", "choices": ["a", "b", "c"], "gold": 0})


def test_boolq_doc_splits_passage_and_question() -> None:
    record = {
        "query": "Passage: Water boils at 100 C.\nQuestion: does water boil at 100 c?",
        "choices": ["no", "yes"],
    }
    doc = converters.boolq_doc(record | {"gold": 1})
    assert doc == {"passage": "Water boils at 100 C.", "question": "does water boil at 100 c", "label": 1}
    # lm-eval's boolq prompt re-creates the text with one "?".
    assert f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:" == record["query"][9:] + "\nAnswer:"


def test_piqa_winogrande_rte_docs() -> None:
    piqa = converters.piqa_docs([{"goal": "g", "sol1": "a", "sol2": "b"}], ["1"])
    assert piqa == [{"goal": "g", "sol1": "a", "sol2": "b", "label": 1}]
    with pytest.raises(UsageError, match="1 records but 2 labels"):
        converters.piqa_docs([{"goal": "g", "sol1": "a", "sol2": "b"}], ["1", "0"])
    wg = converters.winogrande_docs([{"sentence": "A _ b.", "option1": "x", "option2": "y", "answer": "2"}], ["2"])
    assert wg[0]["answer"] == "2"
    assert converters.winogrande_doc_to_choice(wg[0]) == ["A x", "A y"]
    assert converters.winogrande_doc_to_target(wg[0]) == "b."
    assert converters.winogrande_doc_to_text(wg[0]) == 1
    with pytest.raises(UsageError, match="answer"):
        converters.winogrande_docs([{"sentence": "A _", "option1": "x", "option2": "y", "answer": "1"}], ["2"])
    rte = converters.rte_docs_from_superglue(
        [{"premise": "p", "hypothesis": "h", "label": "entailment", "idx": 0}],
    )
    assert rte == [{"sentence1": "p", "sentence2": "h", "label": 0, "idx": 0}]  # 0 → choice "True"


# ---------------------------------------------------------------- the YAMLs mirror lm-eval's own


BUILTIN_YAML = {
    "piqa": "piqa/piqa.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "rte": "glue/rte/default.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "winogrande": "winogrande/default.yaml",
}


@pytest.mark.parametrize("task", PAPER_TASKS)
def test_offline_yaml_mirrors_the_builtin_task(task: str) -> None:
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    builtin = load_yaml(Path(lm_eval.__file__).parent / "tasks" / BUILTIN_YAML[task], resolve_func=False)
    ours = load_yaml(TASKS_DIR / f"{task}.yaml", resolve_func=False)
    assert ours["task"] == task and "tsenor_offline" in ours["tag"]
    assert ours["output_type"] == builtin["output_type"] == "multiple_choice"
    assert ours["metadata"]["version"] == builtin["metadata"]["version"]
    assert [m["metric"] for m in ours["metric_list"]] == [m["metric"] for m in builtin["metric_list"]]
    if task != "winogrande":  # winogrande's are Python functions (copied verbatim, tested above)
        for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
            assert ours[key] == builtin[key], key
    # The split we evaluate is the one lm-eval evaluates (test when the task has one).
    assert ("test_split" in ours) == (builtin.get("test_split") is not None)


# ---------------------------------------------------------------- the real data folder


EXPECTED_DOCS = {
    "piqa": 1838,
    "arc_easy": 2376,
    "arc_challenge": 1172,
    "hellaswag": 10042,
    "winogrande": 1267,
    "rte": 277,
    "openbookqa": 500,
    "boolq": 3270,
}


@pytest.mark.realdata
@pytest.mark.parametrize("task", PAPER_TASKS)
def test_loaders_read_every_record(task: str, data_dir: Path) -> None:
    splits = getattr(converters, f"load_{task}")(data_dir=str(data_dir), version=1.0)
    (split,) = splits.values()
    assert len(split) == EXPECTED_DOCS[task]


@pytest.mark.realdata
def test_rte_jsonl_and_parquet_give_the_same_docs(data_dir: Path) -> None:
    parquet = list(converters.load_rte(data_dir=str(data_dir))["validation"])
    jsonl = converters.rte_docs_from_superglue(converters.read_jsonl(data_dir / "rte" / "val.jsonl"))
    by_idx = {d["idx"]: d for d in jsonl}
    assert sorted(by_idx) == sorted(d["idx"] for d in parquet)
    assert all(by_idx[d["idx"]]["label"] == d["label"] for d in parquet)
    # SuperGLUE's copy drops the double quotes around titles in 6 of the 277 pairs (docs/guide/zeroshot.md).
    assert sum(by_idx[d["idx"]] != d for d in parquet) == 6


def test_missing_data_folder_names_the_option(tmp_path: Path) -> None:
    absent = RunContext(data_dir=tmp_path / "absent", offline=False, cache_dir=tmp_path)
    with pytest.raises(InputNotFoundError, match="--data-dir"):
        run_zeroshot(None, None, ZeroShotTasks(["piqa"], batch_size=1), absent)
    with pytest.raises(InputNotFoundError, match="--data-dir"):
        run_zeroshot(None, None, ZeroShotTasks(["piqa"], batch_size=1), LOCAL_CTX)  # hub off, no folder
    empty = RunContext(data_dir=tmp_path, offline=True, cache_dir=tmp_path)
    with pytest.raises(InputNotFoundError, match=r"piqa/valid\.jsonl.*--data-dir"):
        run_zeroshot(None, None, ZeroShotTasks(["piqa"], batch_size=1), empty)


def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="valid names: piqa, hellaswag"):
        run_zeroshot(None, None, ZeroShotTasks(["piqa", "mmlu"], batch_size=1), LOCAL_CTX)
    with pytest.raises(UsageError, match="repeats"):
        run_zeroshot(None, None, ZeroShotTasks(["piqa", "piqa"], batch_size=1), LOCAL_CTX)
    with pytest.raises(UsageError, match="limit"):
        run_zeroshot(None, None, ZeroShotTasks(["piqa"], limit=0, batch_size=1), LOCAL_CTX)
    with pytest.raises(UsageError, match="limit"):
        run_zeroshot(None, None, ZeroShotTasks(["piqa"], limit=1.5, batch_size=1), LOCAL_CTX)
    with pytest.raises(UsageError, match="fractional"):
        run_zeroshot(
            None, None, ZeroShotTasks(["piqa"], limit=1.0, batch_size=1), LOCAL_CTX
        )  # lm-eval would score 1 document
    with pytest.raises(UsageError, match="batch size"):
        run_zeroshot(None, None, ZeroShotTasks(["piqa"], batch_size=0), LOCAL_CTX)


def test_task_source_follows_the_context(data_dir: Path, tmp_path: Path) -> None:
    """A data folder → the offline twins, whatever the hub policy; none → lm-eval's hub tasks; no probe."""
    for offline in (False, True):
        ctx = RunContext(data_dir=data_dir, offline=offline, cache_dir=tmp_path)
        assert task_source(ctx, ["piqa", "rte"]) == ("offline", data_dir)
    assert task_source(RunContext(data_dir=None, offline=False, cache_dir=tmp_path), ["piqa"]) == ("hub", None)


def test_hub_task_source_names_dataset_config_and_split() -> None:
    """Hand-made lm-eval task configs: the test split when there is one, else validation."""
    boolq = {"dataset_path": "super_glue", "dataset_name": "boolq", "validation_split": "validation"}
    assert _hub_task_source(boolq) == DataSource(kind="hub", hub="super_glue/boolq split=validation")
    pinned = {
        "dataset_path": "allenai/openbookqa",
        "dataset_name": None,
        "dataset_kwargs": {"revision": "abc123"},
        "validation_split": "validation",
        "test_split": "test",
    }
    assert _hub_task_source(pinned) == DataSource(kind="hub", hub="allenai/openbookqa@abc123 split=test")


def test_average_is_unweighted_mean_of_acc() -> None:
    def score(name: str, acc: float, n: int, acc_norm: float | None) -> TaskScore:
        return TaskScore(name, acc, None, acc_norm, None, n, DataSource(kind="offline"), "1.0")

    scores = [
        score("piqa", 0.70, 1838, 0.71),
        score("rte", 0.50, 277, None),
        score("boolq", 0.60, 3270, None),
    ]
    assert average_acc(scores) == pytest.approx(0.60)  # (0.7 + 0.5 + 0.6) / 3, sizes and acc_norm ignored
    with pytest.raises(UsageError):
        average_acc([])


# ---------------------------------------------------------------- lm-eval end to end on a tiny model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from helpers_tiny import make_tiny_llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.realdata
@pytest.mark.realmodel
def test_offline_tasks_score_documents(tiny_model: tuple[Any, Any], data_dir: Path, data_ctx: RunContext) -> None:
    model, tokenizer = tiny_model
    messages: list[str] = []
    result = run_zeroshot(
        model, tokenizer, ZeroShotTasks(PAPER_TASKS, limit=4, batch_size=4), data_ctx, messages.append
    )
    assert [t.name for t in result.tasks] == list(PAPER_TASKS)
    for task in result.tasks:
        assert task.n_samples == 4, task
        assert 0.0 <= task.acc <= 1.0
        # Four 0/1 outcomes: acc is a multiple of 1/4 (lm-eval really scored 4 documents).
        assert math.isclose(task.acc * 4, round(task.acc * 4))
        assert task.version in ("1.0", "2.0")
        # the files the task read, with their sha256
        read = converters.resolve_files(task.name, data_dir)
        assert task.data_source is not None and task.data_source.kind == "offline"
        assert [f.path for f in task.data_source.files] == [str(p.resolve()) for p in read]
        has_norm = task.name not in ("winogrande", "rte", "boolq")
        assert (task.acc_norm is not None) == has_norm
        # Each document's score, for paired comparisons: they average to the task's acc.
        assert task.doc_acc is not None and len(task.doc_acc) == 4 and set(task.doc_acc) <= {0.0, 1.0}
        assert sum(task.doc_acc) / 4 == pytest.approx(task.acc) and len(task.docs_sha256 or "") == 64
    # The same documents give the same digest; another limit, another one.
    again = run_zeroshot(model, tokenizer, ZeroShotTasks(["piqa"], limit=4, batch_size=4), data_ctx)
    fewer = run_zeroshot(model, tokenizer, ZeroShotTasks(["piqa"], limit=3, batch_size=4), data_ctx)
    assert again.tasks[0].docs_sha256 == result.tasks[0].docs_sha256 != fewer.tasks[0].docs_sha256
    assert result.average == pytest.approx(sum(t.acc for t in result.tasks) / 8)
    assert result.average_metric == "acc" and result.lm_eval_version
    payload = json.loads(json.dumps(result.to_json()))
    assert set(payload["tasks"]) == set(PAPER_TASKS) and payload["average_metric"] == "acc"
    assert any("zero-shot" in m for m in messages)


def test_hub_task_download_failure_names_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No data folder, hub allowed: lm-eval's hub tasks; a failed download is one error naming --data-dir.
    (lm-eval's model wrapper and task index are stubbed: only the error path is under test.)"""
    import lm_eval
    import lm_eval.models.huggingface
    import lm_eval.tasks

    managers: list[dict[str, Any]] = []

    def unreachable(**_kwargs: Any) -> None:
        raise ConnectionError("Couldn't reach 'baber/piqa' on the Hub")

    monkeypatch.setattr(lm_eval, "simple_evaluate", unreachable)
    monkeypatch.setattr(lm_eval.models.huggingface, "HFLM", lambda **kwargs: kwargs)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kwargs: managers.append(kwargs))
    hub = RunContext(data_dir=None, offline=False, cache_dir=tmp_path)
    with pytest.raises(InputNotFoundError, match=r"ConnectionError: Couldn't reach 'baber/piqa'.*pass --data-dir"):
        run_zeroshot(None, None, ZeroShotTasks(["piqa"], limit=2, batch_size=1), hub)
    assert managers == [{}]  # lm-eval's own task index (hub configs), not our offline twins

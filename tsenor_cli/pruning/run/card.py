"""The model card (``README.md``) of a pruned or fine-tuned checkpoint, made with huggingface_hub's
`ModelCard` / `ModelCardData`, so the Hub renders its metadata (base model, tags, the evaluation as
``model-index``) and a person reads what was done: the pattern, the method, the calibration data and,
once the checkpoint was evaluated, its perplexity and accuracy.

The card is rebuilt from the run folder's own records (`runfiles`: tsenor_report.json, eval.json,
finetune.json), never edited in place: `card_text` makes it, `refresh_card` rewrites it atomically after
an evaluation of the folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from tsenor_cli.models.embedded import EMBEDDED_MODELS
from tsenor_cli.packed.files import declares_packed
from tsenor_cli.progress import counted
from tsenor_cli.runfiles import (
    EVAL_FILE,
    FINETUNE_FILE,
    PRUNE_FILE,
    PRUNE_MARKDOWN,
    SPARSITY_FILE,
    EvalReport,
    FinetuneReport,
    PruneReport,
    read_json,
)
from tsenor_cli.runfiles.write import write_card
from tsenor_cli.version import DISTRIBUTION

# A hub id as the Hub accepts it in `base_model`: "org/name" (a local path is not one).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def base_model(model: str) -> str | None:
    """The hub id of what `--model` named: an embedded model's source on the Hub, a hub id as given;
    None for a local folder (the card then names it in its text only)."""
    if model in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[model].base_model
    return model if _HUB_ID.match(model) and not Path(model).expanduser().exists() else None


def _pattern_line(report: PruneReport) -> str:
    p = report.pattern
    if p is None:
        return f"unstructured, {report.sparsity:.0%} of each pruned matrix's weights zeroed"
    if p.transposable:
        return (
            f"transposable {p.n}:{p.m}: every {p.m}×{p.m} tile keeps at most {p.n} weights per row and per column, "
            "so the matrix and its transpose are both N:M sparse"
        )
    return f"{p.n}:{p.m}: every group of {p.m} consecutive input weights keeps at most {p.n}"


def _tags(report: PruneReport) -> list[str]:
    p = report.pattern
    shape = ["unstructured-sparsity"] if p is None else [f"{p.n}:{p.m}-sparsity", "n:m-sparsity"]
    return ["tsenor", "pruned", "sparse", *shape, *(["transposable-sparsity"] if p and p.transposable else [])]


def _eval_results(evaluation: EvalReport, name: str) -> list[EvalResult]:
    """The card's ``model-index``: one perplexity per dataset, one accuracy per zero-shot task."""
    results = [
        EvalResult(
            task_type="text-generation",
            dataset_type=dataset,
            dataset_name=dataset,
            metric_type="perplexity",
            metric_value=round(entry.ppl, 4),
        )
        for dataset, entry in evaluation.perplexity.items()
    ]
    for task in evaluation.zeroshot.tasks if evaluation.zeroshot is not None else ():
        results.append(
            EvalResult(
                task_type="multiple-choice",
                dataset_type=task.name,
                dataset_name=task.name,
                metric_type="accuracy",
                metric_value=round(task.acc, 4),
            )
        )
    return results


def _evaluation_table(evaluation: EvalReport) -> list[str]:
    rows = [
        f"| {dataset} | perplexity | {entry.ppl:.2f} | {counted(entry.windows, 'window')} of {entry.seqlen} tokens |"
        for dataset, entry in evaluation.perplexity.items()
    ]
    if evaluation.zeroshot is not None:
        limit = evaluation.zeroshot.limit
        rows += [
            f"| {t.name} | accuracy | {100 * t.acc:.2f}% | {t.n_samples} examples"
            + (f" (--limit {limit})" if limit is not None else "")
            + " |"
            for t in evaluation.zeroshot.tasks
        ]
    return ["| data | metric | value | protocol |", "|---|---|---|---|", *rows]


def _storage(packed: bool) -> str:
    """How the checkpoint stores its zeros and what loads it."""
    if not packed:
        return (
            "The zeros are stored in the ordinary dense safetensors layout: the checkpoint loads with the classes "
            "the base model loads with"
        )
    return (
        "The checkpoint is **packed** (tsenor's packed N:M safetensors, `quantization_config` "
        "`tsenor_packed` in config.json): each pruned matrix is stored as its kept values and their positions "
        "(indices within their groups or a bit mask, whichever is smaller), about 0.56x its dense bytes. Load it with "
        f"`pip install {DISTRIBUTION}`, then `import tsenor_cli` before "
        "`AutoModelForCausalLM.from_pretrained(...)` (the weights are made dense as they load), or "
        "`tsenor_cli.load(folder)`; `tsenor unpack` writes the dense checkpoint"
    )


def card_text(
    report: PruneReport,
    *,
    evaluation: EvalReport | None = None,
    finetuned: FinetuneReport | None = None,
    packed: bool = False,
) -> str:
    """README.md of a checkpoint pruned as `report` records (fine-tuned as `finetuned` records, when it
    was), with `evaluation`'s table when it was evaluated; packed: its weights are in the packed format."""
    model = str(report.settings.get("model", "the base model"))
    base = base_model(model)
    name = f"{base or Path(model).name} {report.method} {report.pattern.label if report.pattern else 'unstructured'}"
    data = ModelCardData(
        base_model=base,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=_tags(report),
        model_name=name if evaluation is not None else None,
        eval_results=_eval_results(evaluation, name) if evaluation is not None else None,
    )
    totals = report.totals()
    density = totals.get("linear_density")
    lines = [
        f"# {name}",
        "",
        f"`{model}` with its decoder weight matrices pruned by tsenor "
        f"(method `{report.method}`). {_storage(packed)}, and `tsenor verify` checks every pruned "
        f"matrix against the pattern ({SPARSITY_FILE} lists them, and the weights left dense with why).",
        "",
        f"- **Pattern**: {_pattern_line(report)}",
        f"- **Method**: {report.method}"
        + (f", mask solver {report.settings['solver']}" if report.settings.get("solver") else ""),
        f"- **Calibration**: {report.settings.get('nsamples')} samples of {report.settings.get('seqlen')} tokens, "
        f"seed {report.settings.get('seed')}: {report.calibration}",
        f"- **Weights**: {counted(totals['layers_pruned'], 'matrix', 'matrices')} pruned, "
        f"{totals['layers_skipped'] + totals['layers_idle'] + totals['layers_ignored']} left dense"
        + (f"; density of the decoder's linear weights {density:.4f}" if density is not None else ""),
    ]
    if finetuned is not None:
        done = f"{finetuned.steps} steps, {finetuned.tokens} tokens"
        lines.append(f"- **Fine-tuned** with the mask fixed: {done} of {finetuned.data}")
    if evaluation is not None:
        lines += ["", "## Evaluation", "", *_evaluation_table(evaluation)]
    lines += ["", f"The run's full record: `{PRUNE_FILE}` / `{PRUNE_MARKDOWN}` in this folder."]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"))


def refresh_card(folder: Path) -> None:
    """Rewrite `folder`'s README.md from its records (after `tsenor eval` wrote its eval.json); a folder
    without tsenor_report.json (a dense model) is left alone."""
    report_path = folder / PRUNE_FILE
    if not report_path.is_file():
        return
    report = PruneReport.from_json(read_json(report_path), str(report_path))
    evaluation = EvalReport.from_json(read_json(folder / EVAL_FILE)) if (folder / EVAL_FILE).is_file() else None
    finetune_path = folder / FINETUNE_FILE
    finetuned = FinetuneReport.from_json(read_json(finetune_path)) if finetune_path.is_file() else None
    packed = declares_packed(folder)
    text = card_text(report, evaluation=evaluation, finetuned=finetuned, packed=packed)
    write_card(folder, text)

"""Fine-tune two pruned checkpoints with the same budget and compare them (issue 20's SmolLM2 study).

The issue's experiment: ALPS transposable 16:32 and ALPS ordinary 16:32 on SmolLM2-135M, each
fine-tuned with its mask fixed for the same steps of the same C4 documents (not those the C4
perplexity evaluation reads), perplexity recorded every --eval-every steps. Each run is
`tsenor_cli.finetune.finetune` (what `tsenor finetune` runs) into WORK/LABEL; a run whose
WORK/LABEL/finetune.json exists is reused and an interrupted one continues from its last checkpoint,
so the script can be killed and restarted. It writes into --docs:

- finetune_study.md: settings, data and one row per run (perplexity before → after, loss, time);
- finetune_ppl_vs_steps.png and finetune_loss.png: both runs on one plot;
- runs/LABEL/finetune.json: each run's full record.

Usage (pruned checkpoints from `tsenor prune --method alps --nm 16:32 [--no-transposable]`):
    .venv/bin/python scripts/finetune_study.py --run transposable=out/alps-16x32-t \\
        --run ordinary=out/alps-16x32-o --work runs/finetune --docs docs/results/finetune
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tsenor_cli.cli.evaluate import parse_ppl_datasets
from tsenor_cli.finetune.run import FinetuneConfig, finetune
from tsenor_cli.report.plots import plot_perplexity_vs_steps, plot_training_loss
from tsenor_cli.report.table import PPL_COLUMNS
from tsenor_cli.runfiles import FINETUNE_FILE, EvalReport
from tsenor_cli.settings import RunContext

STUDY_MD = "finetune_study.md"
PPL_PNG = "finetune_ppl_vs_steps.png"
LOSS_PNG = "finetune_loss.png"


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _ce(record: dict[str, Any]) -> list[list[float]]:
    """The cross-entropy curve: ce_curve when a teacher was distilled from, else the loss itself."""
    return list(record.get("ce_curve") or record["loss_curve"])


def _objective(settings: dict[str, Any]) -> str:
    teacher = settings.get("teacher")
    if not teacher:
        return "loss: cross-entropy (no teacher)"
    return (
        f"loss: distillation from the dense {teacher} (weight {settings['distill_weight']:g}, "
        f"temperature {settings['distill_temperature']:g}; `tsenor finetune --teacher`)"
    )


def _dense_rows(runs: dict[str, dict[str, Any]], dense: dict[str, float], datasets: list[str]) -> list[str]:
    """Per run and dataset: the share of the perplexity increase over dense that fine-tuning removed,
    (before − after) / (before − dense); and with two runs, the ratio of the first to the second."""
    names = dict(PPL_COLUMNS)
    shown = [d for d in datasets if d in dense]
    head = ["run", *(f"{names.get(d, d)}: dense, before → after, removed" for d in shown)]
    lines = ["", "Against the dense model (its own evaluation, same windows):", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in runs.items():
        cells = [label]
        for d in shown:
            before, after = r["ppl_before"].get(d), r["ppl_after"].get(d)
            if before is None or after is None or before == dense[d]:
                cells.append("—")
                continue
            removed = (before - after) / (before - dense[d])
            cells.append(f"{dense[d]:.2f}, {before:.2f} → {after:.2f}, {100 * removed:.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    if len(runs) == 2:
        (a, ra), (b, rb) = runs.items()
        both = [d for d in datasets if all(d in r[k] for r in (ra, rb) for k in ("ppl_before", "ppl_after"))]
        ratios = [
            f"{names.get(d, d)} {ra['ppl_before'][d] / rb['ppl_before'][d]:.3f}× → "
            f"{ra['ppl_after'][d] / rb['ppl_after'][d]:.3f}×"
            for d in both
        ]
        lines += ["", f"Perplexity ratio {a}/{b}, before → after: " + "; ".join(ratios) + "."]
    return lines


def render_markdown(runs: dict[str, dict[str, Any]], command: str, dense: dict[str, float] | None = None) -> str:
    """{label: finetune.json content} → the study's Markdown (settings from the first run; all share them).

    dense: {dataset: ppl} of the dense model under the same evaluation, for the share of the increase
    removed and the ratio between two runs (None: left out).
    """
    first = next(iter(runs.values()))
    s = first["settings"]
    datasets = list(dict.fromkeys(d for r in runs.values() for d in (*r["ppl_before"], *r["ppl_after"])))
    names = dict(PPL_COLUMNS)
    windows = "" if s["max_windows"] is None else f" (first {s['max_windows']} windows)"
    head = ["run", "pattern", "steps", "tokens", "passes", "s/step", "cross-entropy first → last"]
    head += [f"{names.get(d, d)} before → after" for d in datasets]
    lines = [
        "# Fine-tuning with the sparsity mask fixed",
        "",
        f"Written by `{command}` on {datetime.now(UTC).date().isoformat()}; every number below comes from",
        "that run (`runs/*/finetune.json` hold the full records, curves included).",
        "",
        f"- budget: {s['max_steps']} steps × {s['batch_size']} windows × {s['grad_accum']} accumulation × "
        f"{s['seqlen']} tokens; AdamW lr {s['lr']:g}, {s['scheduler']} decay, warm-up {s['warmup']}, "
        f"clip {s['max_grad_norm']}, seed {s['seed']}, {'bf16 autocast' if s['bf16'] else 'fp32'} on {s['device']}",
        f"- {_objective(s)}",
        f"- data: {first['data']}",
        f"- perplexity: {', '.join(names.get(d, d) for d in datasets)}{windows}, every "
        f"{s['eval_every'] or s['max_steps']} steps; step 0 is the pruned checkpoint",
        f"- versions: {', '.join(f'{k} {v}' for k, v in first['versions'].items())}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for label, r in runs.items():
        ce = _ce(r)
        cells = [
            label,
            f"{r['pattern']['pattern']} {r['pattern']['kind']}",
            str(r["steps"]),
            str(r["tokens"]),
            f"{r['epochs']:.2f}",
            f"{r['seconds_per_step']:.2f}",
            f"{ce[0][1]:.3f} → {ce[-1][1]:.3f}" if ce else "—",
        ]
        cells += [f"{_fmt(r['ppl_before'].get(d))} → {_fmt(r['ppl_after'].get(d))}" for d in datasets]
        lines.append("| " + " | ".join(cells) + " |")
    if dense is not None:
        lines += _dense_rows(runs, dense, datasets)
    lines += ["", f"![perplexity against steps]({PPL_PNG})", "", f"![training cross-entropy]({LOSS_PNG})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, help="LABEL=PRUNED_DIR (give two or more)")
    parser.add_argument("--work", type=Path, default=Path("runs/finetune"), help="fine-tuned checkpoints")
    parser.add_argument("--docs", type=Path, default=Path("docs/results/finetune"))
    parser.add_argument("--data", default="c4")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--ppl", default="wikitext2,c4")
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--teacher", default=None, help="distil every run from this dense model (finetune --teacher)")
    parser.add_argument("--distill-weight", type=float, default=1.0, help="with --teacher: the distillation share")
    parser.add_argument("--dense", type=Path, default=None, help="the dense model's eval.json (same --ppl windows)")
    args = parser.parse_args(argv)
    pairs = [item.split("=", 1) for item in args.run]
    if any(len(p) != 2 or not p[0] for p in pairs) or len({p[0] for p in pairs}) != len(pairs):
        parser.error("--run takes LABEL=PRUNED_DIR with distinct labels, e.g. --run transposable=out/alps-16x32-t")
    command = " ".join(["scripts/finetune_study.py", *(argv if argv is not None else sys.argv[1:])])
    records: dict[str, dict[str, Any]] = {}
    for label, run_dir in pairs:
        output = args.work / label
        if not (output / FINETUNE_FILE).is_file():
            cfg = FinetuneConfig(
                run_dir=Path(run_dir),
                output=output,
                data=args.data,
                seqlen=args.seqlen,
                max_steps=args.max_steps,
                lr=args.lr,
                batch_size=args.batch_size,
                grad_accum=args.grad_accum,
                warmup=args.warmup,
                seed=args.seed,
                dtype="bf16" if args.bf16 else "fp32",
                ppl_datasets=parse_ppl_datasets(args.ppl),
                max_windows=args.max_windows,
                eval_every=args.eval_every,
                save_every=args.save_every,
                device=args.device,
                teacher=args.teacher,
                distill_weight=args.distill_weight,
                resume=True,
                command=command,
            )
            prefix = f"[{label}]"

            def say(message: str, prefix: str = prefix) -> None:
                print(prefix, message, flush=True)

            finetune(cfg, RunContext.from_environment(), progress=say)
        records[label] = json.loads((output / FINETUNE_FILE).read_text())
        (args.docs / "runs" / label).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(output / FINETUNE_FILE, args.docs / "runs" / label / FINETUNE_FILE)
    plot_perplexity_vs_steps(
        {
            label: {d: [(int(s), float(v)) for s, v in pts] for d, pts in r["ppl_curve"].items()}
            for label, r in records.items()
        },
        args.docs / PPL_PNG,
    )
    plot_training_loss(
        {label: [(int(s), float(v)) for s, v in _ce(r)] for label, r in records.items()}, args.docs / LOSS_PNG
    )
    dense = None
    if args.dense is not None:
        report = EvalReport.from_json(json.loads(args.dense.read_text()), str(args.dense))
        dense = {name: entry.ppl for name, entry in report.perplexity.items()}
    (args.docs / STUDY_MD).write_text(render_markdown(records, command, dense))
    print(f"wrote {args.docs / STUDY_MD}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

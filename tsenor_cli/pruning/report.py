"""`PruneReport`: per-layer results, totals, versions and the command line, as JSON and Markdown."""

from __future__ import annotations

import platform
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from tsenor_cli.pruning.types import LayerRecord


def versions() -> dict[str, str]:
    import torch
    import transformers

    from tsenor_cli.provenance import tsenor_versions

    return {
        **tsenor_versions(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


@dataclass(frozen=True)
class PruneReport:
    """The outcome of `prune_model`.

    settings: the run's result-deciding settings (`PruneConfig.result_fields`, with the solver asked for
      under layer.solver) plus the device and the solver that ran (`solver`, None without one).
    output: the written checkpoint folder, None for a dry run.
    """

    settings: dict[str, Any]
    layers: tuple[LayerRecord, ...]
    calibration: str
    seconds: float
    output: str | None
    command: str | None
    versions: dict[str, str]
    resumed_from_block: int | None = None

    @property
    def pruned(self) -> list[LayerRecord]:
        return [r for r in self.layers if r.status == "pruned"]

    def totals(self) -> dict[str, Any]:
        pruned = self.pruned
        errors = [r.recon_error for r in pruned if r.recon_error is not None]
        gaps = [r.gap for r in pruned if r.gap is not None]
        return {
            "layers_pruned": len(pruned),
            "layers_skipped": len(self.layers) - len(pruned),
            "mean_recon_error": statistics.fmean(errors) if errors else None,
            "max_recon_error": max(errors) if errors else None,
            "max_gap": max(gaps) if gaps else None,
            "mean_gap": statistics.fmean(gaps) if gaps else None,
            "method_seconds": sum(r.seconds for r in pruned),
            "solver_seconds": sum(r.solver_seconds or 0.0 for r in pruned),
            "total_seconds": self.seconds,
            "admm_iterations": sum(r.iterations for r in pruned),
            "safeguard_tiles": sum(r.safeguard_tiles for r in pruned),
        }

    def to_dict(self) -> dict[str, Any]:
        pattern = self.settings["pattern"]
        structured = pattern["kind"] in ("transposable", "nm")
        return {
            # The top-level summary `tsenor report` reads (docs/report-format.md).
            "method": self.settings["method"],
            "pattern": (
                {"n": pattern["n"], "m": pattern["m"], "transposable": pattern["kind"] == "transposable"}
                if structured
                else None
            ),
            "sparsity": float(pattern["sparsity"]),
            "settings": self.settings,
            "calibration": self.calibration,
            "output": self.output,
            "command": self.command,
            "versions": self.versions,
            "resumed_from_block": self.resumed_from_block,
            "totals": self.totals(),
            "layers": [{**asdict(r), "reconstruction_error": r.recon_error} for r in self.layers],
        }

    def to_markdown(self) -> str:
        s = self.settings
        t = self.totals()
        pattern = s["pattern"]
        label = f"{pattern['n']}:{pattern['m']}" if pattern["kind"] != "unstructured" else f"{pattern['sparsity']:.0%}"
        lines = [
            "# tsenor pruning report",
            "",
            f"- model: `{s['model']}`",
            f"- method: {s['method']}, pattern {label} ({pattern['kind']}), {_solver_label(s)}",
            f"- calibration: {self.calibration} ({s['nsamples']} × {s['seqlen']}), seed {s['seed']}",
            f"- command: `{self.command or ''}`",
            f"- versions: {', '.join(f'{k} {v}' for k, v in self.versions.items())}",
            f"- total time: {self.seconds:.1f} s "
            f"(method {t['method_seconds']:.1f} s, solver {t['solver_seconds']:.1f} s)",
            f"- layers pruned: {t['layers_pruned']}, skipped: {t['layers_skipped']}",
            f"- mean relative reconstruction error: {_fmt(t['mean_recon_error'])}; "
            f"max certified gap: {_fmt(t['max_gap'])}",
            "",
            "| layer | shape | status | rel. error | certified gap | seconds | iterations |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.layers:
            status = r.status if r.reason is None else f"{r.status}: {r.reason}"
            lines.append(
                f"| {r.name} | {r.out_features}×{r.in_features} | {status} | {_fmt(r.recon_error)} | "
                f"{_fmt(r.gap)} | {r.seconds:.2f} | {r.iterations} |"
            )
        return "\n".join(lines) + "\n"


def _solver_label(settings: dict[str, Any]) -> str:
    """The transposable solver that ran and, if different, the one asked for: "solver flow (asked for auto)"."""
    ran, asked = settings["solver"], settings["layer"]["solver"]
    if ran is None:
        return "no mask solver"
    return f"solver {ran}" if ran == asked else f"solver {ran} (asked for {asked})"


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"

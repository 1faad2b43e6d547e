"""`PruneReport`: per-layer results, totals, versions and the command line, as JSON and Markdown."""

from __future__ import annotations

import platform
import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from tsenor_cli.pruning.types import LayerRecord

MAX_LISTED_IGNORED = 12  # more ignored layers than this are counted by reason in the summary line


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

    settings: the run's result-deciding settings (`PruneConfig.result_fields`) plus device and solver.
    output: the written checkpoint folder, None for a dry run.
    model_params / model_nonzero: entries and nonzero entries of every parameter of the written model
    (tied weights once); linear_params / linear_nonzero: the same over the decoder blocks' linear weights.
    """

    settings: dict[str, Any]
    layers: tuple[LayerRecord, ...]
    calibration: str
    seconds: float
    output: str | None
    command: str | None
    versions: dict[str, str]
    resumed_from_block: int | None = None
    # --- density of the written model (issue 16) ---
    model_params: int | None = None
    model_nonzero: int | None = None
    linear_params: int | None = None
    linear_nonzero: int | None = None

    @property
    def pruned(self) -> list[LayerRecord]:
        return [r for r in self.layers if r.status == "pruned"]

    def totals(self) -> dict[str, Any]:
        pruned = self.pruned
        errors = [r.recon_error for r in pruned if r.recon_error is not None]
        gaps = [r.gap for r in pruned if r.gap is not None]
        return {
            "layers_pruned": len(pruned),
            "layers_skipped": sum(r.status == "skipped" for r in self.layers),
            "layers_ignored": sum(r.status == "ignored" for r in self.layers),
            "model_params": self.model_params,
            "model_nonzero": self.model_nonzero,
            "model_density": _ratio(self.model_nonzero, self.model_params),
            "linear_params": self.linear_params,
            "linear_nonzero": self.linear_nonzero,
            "linear_density": _ratio(self.linear_nonzero, self.linear_params),
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
            f"- method: {s['method']}, pattern {label} ({pattern['kind']}), solver {s['layer']['solver']}",
            f"- calibration: {self.calibration} ({s['nsamples']} × {s['seqlen']}), seed {s['seed']}",
            f"- command: `{self.command or ''}`",
            f"- versions: {', '.join(f'{k} {v}' for k, v in self.versions.items())}",
            f"- total time: {self.seconds:.1f} s "
            f"(method {t['method_seconds']:.1f} s, solver {t['solver_seconds']:.1f} s)",
            f"- layers pruned: {t['layers_pruned']}, skipped: {t['layers_skipped']}, ignored: {t['layers_ignored']}",
            *self._density_lines(t),
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

    def _density_lines(self, t: dict[str, Any]) -> list[str]:
        """The report's density and ignored-layer lines (issue 16)."""
        lines = []
        if t["model_density"] is not None and t["linear_density"] is not None:
            lines.append(
                f"- density: model {t['model_density']:.4f} ({t['model_nonzero']:,} of {t['model_params']:,} "
                f"parameters nonzero), decoder linears {t['linear_density']:.4f}"
            )
        ignored = [r for r in self.layers if r.status == "ignored"]
        if len(ignored) <= MAX_LISTED_IGNORED:
            named = ", ".join(r.name for r in ignored)
        else:  # every one is in the table below; the line counts them by reason
            reasons = Counter(r.reason for r in ignored)
            named = "; ".join(f"{count} {reason}" for reason, count in reasons.items()) + " (each in the table)"
        if ignored:
            lines.append(f"- ignored (left dense): {named}")
        return lines


def _ratio(part: int | None, whole: int | None) -> float | None:
    return None if part is None or not whole else part / whole


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"

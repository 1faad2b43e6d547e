"""The sparsity pattern, defined once: parsing ``"N:M"``, the shape check and both JSON forms.

A run's pattern appears in three places, all read and written by `SparsityPattern`:

- on the command line and in recipes: ``--nm 16:32`` (`parse`), ``--no-transposable``, ``--sparsity 0.5``;
- in ``tsenor_report.json`` → ``pattern``: ``{"n", "m", "transposable"}``, null for unstructured pruning
  (`report_json` / `from_report_json`; the report's top-level ``sparsity`` completes it);
- in the checkpoint's ``config.json`` → ``tsenor_sparsity``: ``pattern`` (the label), ``kind``, ``n``,
  ``m``, ``sparsity``, ``transposable`` beside the run's other metadata (`metadata` / `from_metadata`),
  which `tsenor verify` and `tsenor finetune` read back.

The one check of a pattern's numbers (M >= 2, 1 <= N < M, 0 < sparsity < 1) is `__post_init__`.
Orientation: weights are (out, in); row-wise N:M groups run along the input dimension.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from tsenor_cli.errors import SchemaError, UsageError, VerificationError

PatternKind = Literal["transposable", "nm", "unstructured"]
PATTERN_KINDS: tuple[str, ...] = get_args(PatternKind)
_NM_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class SparsityPattern:
    """What a pruned weight must look like.

    transposable: every M×M tile keeps exactly n per row and column (paper eq. (1)).
    nm: every group of m consecutive inputs of each output row keeps n (ordinary N:M).
    unstructured: a `sparsity` share of each layer is zero (n = m = 0).
    For the N:M kinds `sparsity` is 1 − n/m, set from n and m.
    """

    kind: PatternKind
    n: int = 0
    m: int = 0
    sparsity: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in PATTERN_KINDS:
            raise UsageError(f"unknown sparsity pattern kind {self.kind!r}; use one of {', '.join(PATTERN_KINDS)}")
        if self.kind == "unstructured":
            if not 0.0 < self.sparsity < 1.0:
                raise UsageError(f"--sparsity {self.sparsity} must be in (0, 1); e.g. 0.5 zeroes half the weights")
            return
        if self.m < 2:
            raise UsageError(f"N:M pattern {self.n}:{self.m} has M < 2; use M >= 2, e.g. 2:4 or 16:32")
        if not 1 <= self.n < self.m:
            raise UsageError(f"N:M pattern {self.n}:{self.m} needs 1 <= N < M; use e.g. {self.m // 2}:{self.m}")
        object.__setattr__(self, "sparsity", 1.0 - self.n / self.m)

    @classmethod
    def parse(cls, text: str, *, transposable: bool = True) -> SparsityPattern:
        """``"N:M"`` (spaces allowed) → an N:M pattern; a malformed string is one `UsageError` naming the fix."""
        match = _NM_RE.match(text)
        if match is None:
            raise UsageError(f"cannot parse N:M pattern {text!r}; write it as N:M with integers, e.g. 16:32")
        return cls.from_nm(int(match.group(1)), int(match.group(2)), transposable=transposable)

    @classmethod
    def from_nm(cls, n: int, m: int, *, transposable: bool) -> SparsityPattern:
        return cls("transposable" if transposable else "nm", n, m)

    @classmethod
    def unstructured(cls, sparsity: float) -> SparsityPattern:
        return cls("unstructured", 0, 0, float(sparsity))

    @property
    def label(self) -> str:
        """ "16:32" for N:M patterns, "50%" for unstructured."""
        if self.kind == "unstructured":
            return f"{self.sparsity:.0%}"
        return f"{self.n}:{self.m}"

    def __str__(self) -> str:
        return self.label

    @property
    def transposable(self) -> bool:
        return self.kind == "transposable"

    def incompatibility(self, out_features: int, in_features: int) -> str | None:
        """Why an (out, in) weight cannot take this pattern, or None when it can.

        Transposable tiles need both dimensions divisible by M; row-wise N:M groups only the input one.
        """
        if self.kind == "transposable":
            if out_features % self.m or in_features % self.m:
                return f"shape ({out_features}, {in_features}) is not divisible by M={self.m} in both dims"
            return None
        if self.kind == "nm" and in_features % self.m:
            return f"input dim {in_features} is not divisible by M={self.m}"
        return None

    # ------------------------------------------------------------ tsenor_report.json → pattern

    def report_json(self) -> dict[str, Any] | None:
        """``tsenor_report.json → pattern``: n, m and transposable; None (null) for unstructured pruning."""
        if self.kind == "unstructured":
            return None
        return {"n": self.n, "m": self.m, "transposable": self.transposable}

    @classmethod
    def from_report_json(cls, obj: Any, where: str) -> SparsityPattern:
        """A report's non-null ``pattern`` object; a wrong field or numbers that are no pattern: `SchemaError`."""
        if not isinstance(obj, dict):
            raise SchemaError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        for key, kind in (("n", int), ("m", int), ("transposable", bool)):
            if key not in obj:
                raise SchemaError(f"{where}: missing field {key!r}")
            value = obj[key]
            if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
                raise SchemaError(f"{where}: field {key!r} must be {kind.__name__}, got {type(value).__name__}")
        try:
            return cls.from_nm(obj["n"], obj["m"], transposable=obj["transposable"])
        except UsageError as exc:
            raise SchemaError(f"{where}: {exc}") from exc

    # ------------------------------------------------------------ config.json → tsenor_sparsity

    def metadata(self) -> dict[str, Any]:
        """The pattern's keys of config.json's ``tsenor_sparsity`` (the run adds method, solver, modules)."""
        return {
            "pattern": self.label,
            "kind": self.kind,
            "n": self.n,
            "m": self.m,
            "sparsity": self.sparsity,
            "transposable": self.transposable,
        }

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], where: str) -> SparsityPattern:
        """The pattern config.json's ``tsenor_sparsity`` records (checkpoints of every tsenor version);
        anything else is a `VerificationError` naming `where`."""
        kind = meta.get("kind")
        if kind not in PATTERN_KINDS:
            raise VerificationError(f"unknown sparsity kind {kind!r} in {where}; was it written by tsenor prune?")
        try:
            if kind == "unstructured":
                return cls.unstructured(float(meta["sparsity"]))
            return cls(kind, int(meta["n"]), int(meta["m"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise VerificationError(
                f"{where} records a {kind} pattern without valid n, m or sparsity ({exc}); re-run tsenor prune"
            ) from exc

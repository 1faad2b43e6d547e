"""Which linears are pruned: `--targets` restricts, `--ignore` excludes (patterns on full module names).

A pattern is a glob (fnmatch, case-sensitive: ``*.mlp.down_proj``, ``model.layers.0.*``; a plain name
matches only itself) or, with the ``re:`` prefix, a regular expression matched at the start of the name
(``re.match``, as llm-compressor's ``ignore``/``targets`` do: ``re:.*down_proj$``). Names are the full
module names of the model ("model.layers.3.self_attn.q_proj"). A pattern that matches no linear of the
decoder blocks (nor a linear of a vision tower or projector, `pruning/block/outside.py`) is an error: a typo must
not silently prune everything.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from tsenor_cli.errors import UsageError

REGEX_PREFIX = "re:"


def check_patterns(patterns: Sequence[str], flag: str) -> None:
    """UsageError for an empty pattern or a `re:` pattern that is not a valid regular expression."""
    for pattern in patterns:
        if not pattern.strip():
            raise UsageError(f"{flag} got an empty pattern; pass a glob such as '*.mlp.down_proj' or 're:.*down_proj$'")
        if pattern.startswith(REGEX_PREFIX):
            try:
                re.compile(pattern.removeprefix(REGEX_PREFIX))
            except re.error as exc:
                raise UsageError(
                    f"{flag} {pattern!r} is not a valid regular expression ({exc}); fix the pattern"
                ) from exc


def matches(pattern: str, name: str) -> bool:
    """Whether `pattern` (glob, or `re:` regex matched at the start) matches the full module `name`."""
    if pattern.startswith(REGEX_PREFIX):
        return re.match(pattern.removeprefix(REGEX_PREFIX), name) is not None
    return fnmatchcase(name, pattern)


@dataclass(frozen=True)
class Selection:
    """One model's `--ignore`/`--targets` selection, made once by the plan (`plan.plan_model`) and read by
    the run from the plan it was given (`PrunePlan.selection`), so the dry run and the run judge every name
    with the same patterns and the same names beside the blocks. outside: the model's weight matrices
    outside the decoder blocks (their own error line); selectable: the linears outside the language
    model a pattern may name (`pruning/block/outside.py`)."""

    ignore: tuple[str, ...]
    targets: tuple[str, ...]
    outside: tuple[str, ...]
    selectable: tuple[str, ...]

    def excluded(self, names: Sequence[str]) -> dict[str, str]:
        """{full name: reason} of `names` left dense (`excluded_layers`, its errors included)."""
        return excluded_layers(names, self.ignore, self.targets, outside=self.outside, selectable=self.selectable)

    def targeted(self, name: str) -> bool:
        """Whether a --targets pattern names `name` (a router or gate is pruned only then)."""
        return any(matches(pattern, name) for pattern in self.targets)


def excluded_layers(
    names: Sequence[str],
    ignore: Sequence[str],
    targets: Sequence[str],
    *,
    outside: Sequence[str] = (),
    selectable: Sequence[str] = (),
) -> dict[str, str]:
    """{full name: reason} of the linears (full module `names`) left dense by `targets` (when given) and `ignore`.

    Raises UsageError naming the first pattern that matches none of `names`, or when nothing is left to
    prune. outside: the names of the model's weight matrices outside the decoder blocks (a multimodal
    model's vision tower and projector, the embeddings, the output head): a pattern that names only
    those gets its own line, as they cannot be pruned (calibration is text through the language model,
    so they have no inputs to prune with). selectable: the linears outside the language model (vision
    tower, projector) a pattern may name instead (`pruning/block/outside.py`); a run whose --targets name only
    those prunes only those.
    """
    for flag, patterns in (("--targets", targets), ("--ignore", ignore)):
        for pattern in patterns:
            if not any(matches(pattern, name) for name in (*names, *selectable)):
                example = next((name for name in outside if matches(pattern, name)), None)
                if example is not None:
                    raise UsageError(
                        f"{flag} {pattern!r} names only weights outside the decoder blocks (e.g. {example}) that "
                        "tsenor leaves dense: the embeddings, the output head and matrices that are no nn.Linear "
                        "(only a vision tower's and projector's linear layers can be targeted); drop the pattern"
                    )
                example = names[0] if names else "model.layers.0.mlp.down_proj"
                raise UsageError(
                    f"{flag} {pattern!r} matches no linear layer of the decoder blocks; patterns are globs or "
                    f"re: regexes on full module names such as {example}"
                )
    excluded: dict[str, str] = {}
    for name in names:
        if targets and not any(matches(pattern, name) for pattern in targets):
            excluded[name] = "not matched by --targets"
            continue
        hit = next((pattern for pattern in ignore if matches(pattern, name)), None)
        if hit is not None:
            excluded[name] = f"matched --ignore {hit}"
    # An outside linear counts only if --ignore leaves it too (`outside.selected_outside`'s rule): on a
    # multimodal model, --targets and --ignore naming the same vision linears used to pass here and write
    # a dense copy ("0 layers pruned", exit 0) where a text model's run was refused.
    chosen_outside = any(
        any(matches(pattern, name) for pattern in targets) and not any(matches(pattern, name) for pattern in ignore)
        for name in selectable
    )
    if names and len(excluded) == len(names) and not chosen_outside:
        raise UsageError(
            f"--ignore/--targets leave none of the {len(names)} linear layers to prune; loosen the patterns"
        )
    return excluded

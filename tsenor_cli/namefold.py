"""Many weight names as few for a person: "model.layers.{0-47}.mlp.experts.down_proj[{0-127}]".

A 70B model has 560 linears and an MoE tens of thousands of expert matrices; the tables that list one
row per weight (`tsenor verify`) fold the rows that say the same thing into one, their names written with
the indices as ranges. The folding is exact: a folded name stands for the product of its ranges, and
every name given is in exactly one folded name. Display only (torch-free); nothing reads structure from it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

_NUMBER = re.compile(r"(\d+)")


def template(name: str) -> str:
    """The name with each number replaced by "#": the names `fold_names` may fold together share it."""
    return _NUMBER.sub("#", name)


def index_ranges(values: Iterable[int]) -> str:
    """Indices as ranges: [0, 1, 2, 5] → "0-2,5"."""
    runs: list[list[int]] = []
    for value in sorted(set(values)):
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _cell(values: frozenset[int]) -> str:
    return str(next(iter(values))) if len(values) == 1 else "{" + index_ranges(values) + "}"


def fold_names(names: Sequence[str]) -> list[str]:
    """`names` that differ only in their numbers, folded: each result is a name whose varying numbers are
    ranges in braces, standing for every combination of them; in the order of each one's first name.
    Names of other shapes (other text between the numbers) are never folded together."""
    entries: list[tuple[tuple[str, ...], tuple[frozenset[int], ...], int]] = []
    for position, name in enumerate(names):
        parts = _NUMBER.split(name)
        text, numbers = tuple(parts[0::2]), tuple(frozenset({int(n)}) for n in parts[1::2])
        entries.append((text, numbers, position))
    # Merge one number at a time, the last first: entries equal in every other cell become one, whose cell
    # is the union. Each entry stays a product of its cells, and the entries stay disjoint.
    slots = max((len(numbers) for _, numbers, _ in entries), default=0)
    for slot in reversed(range(slots)):
        merged: dict[tuple[object, ...], tuple[tuple[str, ...], list[frozenset[int]], int]] = {}
        for text, numbers, position in entries:
            if slot >= len(numbers):
                merged[(text, numbers, position)] = (text, list(numbers), position)
                continue
            key = (text, numbers[:slot], numbers[slot + 1 :])
            if key in merged:
                found = merged[key]
                found[1][slot] = found[1][slot] | numbers[slot]
                merged[key] = (found[0], found[1], min(found[2], position))
            else:
                merged[key] = (text, list(numbers), position)
        entries = [(text, tuple(cells), position) for text, cells, position in merged.values()]
    entries.sort(key=lambda entry: entry[2])
    folded = []
    for text, numbers, _ in entries:
        pieces = [text[0]]
        for cell, after in zip(numbers, text[1:], strict=True):
            pieces += [_cell(cell), after]
        folded.append("".join(pieces))
    return folded

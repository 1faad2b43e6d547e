"""`namefold`: weight names folded for people, exactly (every name in one folded name, nothing more)."""

from __future__ import annotations

import itertools
import random
import re

from tsenor_cli.namefold import fold_names, index_ranges, template


def _expand(folded: str) -> set[str]:
    """The names a folded name stands for: the product of its braced ranges."""
    parts = re.split(r"\{([\d,\-]+)\}", folded)
    choices: list[list[str]] = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            choices.append([part])
            continue
        values: list[str] = []
        for item in part.split(","):
            low, _, high = item.partition("-")
            values += [str(v) for v in range(int(low), int(high or low) + 1)]
        choices.append(values)
    return {"".join(combo) for combo in itertools.product(*choices)}


def test_hand_worked_folds() -> None:
    assert index_ranges([5, 1, 2, 3, 9, 10]) == "1-3,5,9-10"
    assert template("model.layers.12.mlp.experts.down_proj[3]") == "model.layers.#.mlp.experts.down_proj[#]"
    dense = [f"model.layers.{b}.{n}" for b in range(30) for n in ("self_attn.q_proj", "mlp.up_proj")]
    assert fold_names(dense) == ["model.layers.{0-29}.self_attn.q_proj", "model.layers.{0-29}.mlp.up_proj"]
    moe = [f"model.layers.{b}.mlp.experts.down_proj[{e}]" for b in range(48) for e in range(128)]
    assert fold_names(moe) == ["model.layers.{0-47}.mlp.experts.down_proj[{0-127}]"]
    # Block 2 has half the experts: not a product, so two names, in the order of their first name.
    ragged = [f"layers.{b}.experts[{e}]" for b in range(4) for e in range(8) if b != 2 or e < 4]
    assert fold_names(ragged) == ["layers.{0-1,3}.experts[{0-7}]", "layers.2.experts[{0-3}]"]
    assert fold_names(["lm_head", "model.layers.3.x"]) == ["lm_head", "model.layers.3.x"]
    assert fold_names([]) == []


def test_folding_is_exact_on_random_name_sets() -> None:
    rng = random.Random(0)
    for _ in range(200):
        names = [
            f"m.layers.{b}.{kind}.w[{e}]"
            for b in range(rng.randint(1, 6))
            for kind in ("a", "b")
            for e in range(rng.randint(1, 5))
            if rng.random() < 0.8
        ]
        folded = fold_names(names)
        expanded = [_expand(name) for name in folded]
        assert set().union(*expanded) == set(names) if names else not folded
        assert sum(len(e) for e in expanded) == len(set(names))  # disjoint: no name in two folded ones

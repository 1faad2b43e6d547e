"""The one YAML loader of recipes and sweep files (`tsenor_cli.yamlfile`): PyYAML's safe YAML 1.1 less its
base-60 numbers, checked scalar by scalar against `yaml.safe_load`."""

from __future__ import annotations

import yaml

from tsenor_cli.yamlfile import load_yaml

# Scalars both loaders read alike: YAML 1.1's ints (binary, octal, hex, underscores), floats (a dot needed:
# 1e-4 stays text), infinities, dates, booleans and nulls.
ALIKE = "a: 12\nb: -3\nc: 0x1f\nd: 017\ne: 1_000\nf: 0b101\ng: 1.5\nh: 1.0e-4\ni: 1e-4\nj: .inf\nk: -.inf\n"
ALIKE += "l: 2001-12-14\nm: true\nn: null\no: ~\np: 0o7\nq: -.5\nr: text\ns: '2:4'\n"


def test_the_loader_reads_every_scalar_as_safe_load_does() -> None:
    assert load_yaml(ALIKE) == yaml.safe_load(ALIKE)
    assert load_yaml(ALIKE)["c"] == 31 and load_yaml(ALIKE)["i"] == "1e-4"


def test_a_pattern_without_quotes_is_text_not_a_base_60_number() -> None:
    """YAML 1.1 reads 2:4 as 2·60 + 4 = 124 and 16:32 as 992 (`yaml.safe_load`); YAML 1.2, and this loader,
    read the text the user wrote, in a recipe's `nm` and in a sweep's list of them alike."""
    text = "nm: 2:4\naxes: {nm: [16:32, 8:16]}\nclock: 190:20:30\nmixed: 3:4.5\n"
    assert yaml.safe_load(text)["nm"] == 124
    assert load_yaml(text) == {"nm": "2:4", "axes": {"nm": ["16:32", "8:16"]}, "clock": "190:20:30", "mixed": "3:4.5"}

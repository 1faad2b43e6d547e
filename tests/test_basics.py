from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from tsenor_cli.cli import app
from tsenor_cli.errors import UsageError
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.solver import from_blocks, to_blocks


def test_parse_nm() -> None:
    assert SparsityPattern.parse("16:32") == SparsityPattern("transposable", 16, 32)
    assert SparsityPattern.parse(" 2 : 4 ", transposable=False) == SparsityPattern("nm", 2, 4)
    assert SparsityPattern.parse("8:16").sparsity == 0.5
    assert SparsityPattern.parse("3:16").sparsity == 1.0 - 3 / 16  # set from n and m, whatever was passed
    assert SparsityPattern("nm", 3, 16, 0.9).sparsity == 1.0 - 3 / 16


@pytest.mark.parametrize("text", ["16-32", "a:b", "4:4", "0:4", "5:4", "1:1", ""])
def test_parse_nm_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="N:M"):
        SparsityPattern.parse(text)


@pytest.mark.parametrize(
    "bad", [("nm", 4, 4, 0.0), ("transposable", 0, 8, 0.0), ("unstructured", 0, 0, 1.0), ("dense", 1, 2, 0.5)]
)
def test_one_check_refuses_every_impossible_pattern(bad: tuple[str, int, int, float]) -> None:
    with pytest.raises(UsageError):
        SparsityPattern(*bad)  # type: ignore[arg-type]


def test_the_pattern_round_trips_through_both_json_forms() -> None:
    """The report's `pattern` and config.json's `tsenor_sparsity` give back the same pattern; their keys are
    those existing checkpoints and reports hold."""
    for pattern in (SparsityPattern.parse("16:32"), SparsityPattern.parse("2:4", transposable=False)):
        assert pattern.report_json() == {"n": pattern.n, "m": pattern.m, "transposable": pattern.transposable}
        assert SparsityPattern.from_report_json(pattern.report_json(), "r") == pattern
        assert SparsityPattern.from_metadata(pattern.metadata(), "c") == pattern
    half = SparsityPattern.unstructured(0.5)
    assert half.report_json() is None and half.label == "50%"
    assert half.metadata() == {
        "pattern": "50%",
        "kind": "unstructured",
        "n": 0,
        "m": 0,
        "sparsity": 0.5,
        "transposable": False,
    }
    assert SparsityPattern.from_metadata(half.metadata(), "c") == half
    assert SparsityPattern.parse("8:16").metadata() == {
        "pattern": "8:16", "kind": "transposable", "n": 8, "m": 16, "sparsity": 0.5, "transposable": True,
    }  # fmt: skip


def test_pattern_json_that_is_no_pattern_is_one_line() -> None:
    from tsenor_cli.errors import SchemaError, VerificationError

    with pytest.raises(SchemaError, match="r: N:M pattern 3:2 needs 1 <= N < M"):
        SparsityPattern.from_report_json({"n": 3, "m": 2, "transposable": True}, "r")
    with pytest.raises(SchemaError, match="field 'transposable' must be bool"):
        SparsityPattern.from_report_json({"n": 1, "m": 2, "transposable": 1}, "r")
    with pytest.raises(VerificationError, match="unknown sparsity kind 'block'"):
        SparsityPattern.from_metadata({"kind": "block", "n": 1, "m": 2}, "c")
    with pytest.raises(VerificationError, match="without valid n, m or sparsity"):
        SparsityPattern.from_metadata({"kind": "nm", "n": 1}, "c")


def test_the_shape_check() -> None:
    t, o = SparsityPattern.parse("2:4"), SparsityPattern.parse("2:4", transposable=False)
    assert t.incompatibility(8, 12) is None and o.incompatibility(6, 12) is None
    assert t.incompatibility(6, 12) == "shape (6, 12) is not divisible by M=4 in both dims"
    assert o.incompatibility(8, 6) == "input dim 6 is not divisible by M=4"
    assert SparsityPattern.unstructured(0.5).incompatibility(3, 5) is None


def test_tiling_roundtrip_and_order() -> None:
    x = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    blocks = to_blocks(x, 4)  # (6, 4, 4)
    assert blocks.shape == (6, 4, 4)
    assert torch.equal(blocks[1], x[0:4, 4:8])  # row-major tile order
    assert torch.equal(blocks[3], x[4:8, 0:4])
    assert torch.equal(from_blocks(blocks, 8, 12), x)


def test_cli_help() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "transposable" in result.output

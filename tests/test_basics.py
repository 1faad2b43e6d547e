from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from tsenor_cli.cli import app
from tsenor_cli.errors import UsageError
from tsenor_cli.nm import NMPattern, parse_nm
from tsenor_cli.solver import from_blocks, to_blocks


def test_parse_nm() -> None:
    assert parse_nm("16:32") == NMPattern(16, 32, True)
    assert parse_nm(" 2 : 4 ", transposable=False) == NMPattern(2, 4, False)
    assert parse_nm("8:16").sparsity == pytest.approx(0.5)


@pytest.mark.parametrize("text", ["16-32", "a:b", "4:4", "0:4", "5:4", "1:1", ""])
def test_parse_nm_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="N:M"):
        parse_nm(text)


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

"""`tsenor pack DIR -o OUT` and `tsenor unpack DIR -o OUT`: a checkpoint between the dense and the packed format."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tsenor_cli.cli.app import Command, app
from tsenor_cli.cli.options import MAX_SHARD_SIZE, ForceOpt, MaxShardSizeOpt, OutputDirOpt
from tsenor_cli.errors import UsageError

SourceArg = Annotated[Path, typer.Argument(help="Checkpoint folder written by tsenor prune or tsenor finetune.")]


def _output(output: Path | None, command: str) -> Path:
    if output is None:
        raise UsageError(f"tsenor {command} needs the folder to write: pass -o OUT")
    return output


@app.command("pack", cls=Command)
def pack_cmd(
    directory: SourceArg,
    output: OutputDirOpt = None,
    max_shard_size: MaxShardSizeOpt = MAX_SHARD_SIZE,
    force: ForceOpt = False,
) -> None:
    """Write the packed form of a dense tsenor checkpoint: each pruned matrix as its kept values and their
    positions (about 0.56x its bf16 bytes; docs/reference/packed-format.md)."""
    from tsenor_cli.pruning.run.packing import pack_folder

    written = pack_folder(directory, _output(output, "pack"), force=force, max_shard_size=max_shard_size)
    typer.echo(f"packed {directory} into {written}")


@app.command("unpack", cls=Command)
def unpack_cmd(
    directory: SourceArg,
    output: OutputDirOpt = None,
    max_shard_size: MaxShardSizeOpt = MAX_SHARD_SIZE,
    force: ForceOpt = False,
) -> None:
    """Write the dense form of a packed tsenor checkpoint (the dense prune's tensors, bit for bit)."""
    from tsenor_cli.pruning.run.packing import unpack_folder

    written = unpack_folder(directory, _output(output, "unpack"), force=force, max_shard_size=max_shard_size)
    typer.echo(f"unpacked {directory} into {written}")

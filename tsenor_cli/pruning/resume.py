"""Resume state of an interrupted run, kept in OUTPUT/.tsenor-resume/ (safetensors + JSON only).

After every block: the block's pruned parameters (block_NNNN.safetensors), the hidden states that enter
the next block (hidden.safetensors) and state.json (config hash, next block, layer records). state.json
is written last and atomically, so a kill at any moment leaves either the previous or the new state.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from tsenor_cli import atomic
from tsenor_cli.errors import UsageError
from tsenor_cli.pruning.types import LayerRecord

RESUME_DIRNAME = ".tsenor-resume"
# 2: the state also records where the calibration data came from (calibration_source).
STATE_VERSION = 2


class ResumeStore:
    """The resume folder of one output directory."""

    def __init__(self, output: Path) -> None:
        self.root = output / RESUME_DIRNAME

    @property
    def state_path(self) -> Path:
        return self.root / "state.json"

    def exists(self) -> bool:
        return self.state_path.is_file()

    def load_state(self, config_hash: str) -> dict[str, Any]:
        """The saved state; UsageError when it belongs to a run with different settings."""
        state = json.loads(self.state_path.read_text())
        if state.get("version") != STATE_VERSION or state.get("config_hash") != config_hash:
            raise UsageError(
                f"the resume state in {self.root} was made with different settings; rerun with the same "
                "flags to continue it, or pass --force without --resume to start over"
            )
        return state

    def save_block(
        self,
        index: int,
        block: nn.Module,
        hidden: torch.Tensor,
        records: list[LayerRecord],
        config_hash: str,
        extra: dict[str, Any],
    ) -> None:
        """Record that blocks 0..index are done: hidden (S, T, H) is the input of block index+1."""
        self.root.mkdir(parents=True, exist_ok=True)
        atomic.save_safetensors(dict(block.state_dict()), self.root / f"block_{index:04d}.safetensors")
        atomic.save_safetensors({"hidden": hidden}, self.root / "hidden.safetensors")
        state = {
            "version": STATE_VERSION,
            "config_hash": config_hash,
            "next_block": index + 1,
            "records": [asdict(r) for r in records],
            **extra,
        }
        atomic.write_json(self.state_path, state, indent=1)

    def restore_blocks(self, blocks: nn.ModuleList, next_block: int) -> None:
        """Load the saved pruned parameters of blocks 0..next_block-1 into `blocks` (on the CPU)."""
        for index in range(next_block):
            params = load_file(str(self.root / f"block_{index:04d}.safetensors"))
            blocks[index].load_state_dict(params, strict=True)

    def load_hidden(self, device: torch.device) -> torch.Tensor:
        """(S, T, H) hidden states entering the next block, on `device`."""
        return load_file(str(self.root / "hidden.safetensors"))["hidden"].to(device)


def records_from_state(state: dict[str, Any]) -> list[LayerRecord]:
    return [LayerRecord(**r) for r in state["records"]]

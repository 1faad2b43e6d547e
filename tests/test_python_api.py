"""docs/guide/python-api.md: its code blocks run as written (a tiny model, 4 calibration samples in place
of its paths and sizes), and the model pruned in memory equals the folder pruned, bit for bit."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path

import pytest

GUIDE = Path(__file__).parents[1] / "docs" / "guide" / "python-api.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


def test_the_guide_has_the_two_calls() -> None:
    blocks = _blocks()
    assert len(blocks) == 2
    assert 'report = prune("models/llama", cfg)' in blocks[0] and "report = prune(model," in blocks[1]


def test_the_guides_calls_prune_a_folder_and_a_model_in_memory_alike(
    tiny_llama: Callable[..., Path], data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_llama(num_layers=2)
    monkeypatch.setenv("TSENOR_DATA_DIR", str(data_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    code = "\n".join(_blocks())
    for old, new in (("models/llama", str(model)), ("nsamples=128", "nsamples=4"), ("seqlen=2048", "seqlen=32")):
        assert old in code
        code = code.replace(old, new)
    namespace: dict[str, object] = {}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    folder, memory = tmp_path / "pruned" / "llama-2of4", tmp_path / "pruned" / "llama-in-memory"
    report = namespace["report"]
    assert getattr(report, "output", None) == str(Path("pruned/llama-in-memory"))
    weights = [hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() for out in (folder, memory)]
    assert weights[0] == weights[1]
    layers = [(r.name, r.status, r.recon_error) for r in getattr(report, "layers", ())]
    assert layers and any(status == "pruned" for _, status, _ in layers)


@pytest.mark.parametrize("edit", ["drop a block", "replace a layer"])
def test_a_model_in_memory_unlike_its_folders_config_is_refused_before_any_output(
    tiny_llama: Callable[..., Path], calibration_text: Path, tmp_path: Path, edit: str
) -> None:
    """The run is planned from the folder's config.json (block count, layers, selection): a model edited
    after loading was pruned against that plan and written under a config.json that does not describe it
    (1 block written, exit 0). It is refused in one line naming the difference, nothing written."""
    from torch import nn
    from transformers import AutoModelForCausalLM

    from tsenor_cli.errors import UsageError
    from tsenor_cli.pattern import SparsityPattern
    from tsenor_cli.pruning.api import prune
    from tsenor_cli.pruning.config import PruneConfig
    from tsenor_cli.pruning.types import LayerPruneConfig
    from tsenor_cli.settings import RunContext, cache_dir_default

    folder = tiny_llama(num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(folder)
    if edit == "drop a block":
        model.model.layers = nn.ModuleList(list(model.model.layers)[:1])
        expected = "(1 decoder block(s) in memory, 2 in the config)"
    else:
        model.model.layers[1].mlp.down_proj = nn.Linear(256, 64, bias=False)
        expected = "(model.layers.1.mlp.down_proj: 64×256 in memory, 64×128 in the config)"
    out = tmp_path / "out"
    cfg = PruneConfig(
        model=str(folder), layer=LayerPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True)), method="magnitude",
        calib_data=str(calibration_text), nsamples=2, seqlen=16, output=out,
    )  # fmt: skip
    ctx = RunContext(data_dir=None, offline=True, cache_dir=cache_dir_default())
    with pytest.raises(UsageError) as error:
        prune(model, cfg, ctx=ctx)
    message = str(error.value)
    assert expected in message and "save it with save_pretrained" in message and "\n" not in message
    assert not out.exists()

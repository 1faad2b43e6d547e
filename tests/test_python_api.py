"""docs/guide/python-api.md: its code blocks run as written (a tiny model, 4 calibration samples in place
of its paths and sizes), the model pruned in memory equals the folder pruned, bit for bit, and the folder
loads back with its weights."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path

import pytest

GUIDE = Path(__file__).parents[1] / "docs" / "guide" / "python-api.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


def test_the_guide_has_the_two_calls_and_the_load() -> None:
    blocks = _blocks()
    assert len(blocks) == 3
    assert 'report = prune("models/llama", output=' in blocks[0] and "report = prune(model," in blocks[1]
    assert 'model = tsenor_cli.load("pruned/llama-2of4")' in blocks[2]
    assert blocks[0].startswith("from tsenor_cli import prune\n")


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
    from safetensors.torch import load_file

    loaded = namespace["model"].state_dict()  # type: ignore[attr-defined]
    saved = load_file(folder / "model.safetensors")
    assert saved.keys() <= loaded.keys() and all(loaded[key].equal(saved[key]) for key in saved)


def test_the_api_writes_the_cli_s_bytes(
    tiny_llama: Callable[..., Path], calibration_text: Path, tmp_path: Path
) -> None:
    """`prune(model, output, **settings)` and `tsenor prune` with the same settings write the same files,
    byte for byte, except the report and the model card, which record the run's seconds and command line."""
    from tests.helpers_cli import invoke
    from tsenor_cli import prune

    model = tiny_llama(num_layers=2)
    settings = {"nm": "2:4", "method": "sparsegpt", "calib_data": str(calibration_text), "nsamples": 2, "seqlen": 16}
    flags = ["--nm", "2:4", "--method", "sparsegpt", "--data", str(calibration_text), "--nsamples", "2"]
    result = invoke(["prune", str(model), *flags, "--seqlen", "16", "-o", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    prune(model, tmp_path / "api", **settings)

    def files(out: Path) -> dict[str, str]:
        return {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.iterdir())
            if p.name not in ("tsenor_report.json", "tsenor_report.md", "README.md")
        }

    cli, api = files(tmp_path / "cli"), files(tmp_path / "api")
    assert "model.safetensors" in cli and "tsenor_sparsity.json" in cli
    assert cli == api


def test_a_bad_setting_is_one_line_naming_it_before_any_work(tiny_llama: Callable[..., Path], tmp_path: Path) -> None:
    from tsenor_cli import prune
    from tsenor_cli.errors import UsageError

    model, out = tiny_llama(num_layers=2), tmp_path / "out"
    cases = [
        ({"nm": "2:4", "nsample": 4}, "prune(): unknown key 'nsample' (did you mean 'nsamples'?); known keys: model"),
        ({"nm": "2:4", "nsamples": "many"}, "prune(): nsamples must be a int, got 'many'"),
        ({"nm": "2:4", "method": "sparsegpt", "alps_rho0": 0.2}, "--alps-rho0 is not an option of --method sparsegpt"),
        ({"nm": "2:4", "solver": "fast"}, "unknown --solver 'fast'; choose one of: auto"),
        ({"nm": "2:4", "sparsity": 0.5}, "pass exactly one of --nm N:M"),
    ]
    for settings, expected in cases:
        with pytest.raises(UsageError) as error:
            prune(model, out, **settings)
        assert str(error.value).startswith(expected) and "\n" not in str(error.value), str(error.value)
    assert not out.exists()


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
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig
    from tsenor_cli.pruning.run.api import prune
    from tsenor_cli.pruning.settings.config import PruneConfig
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
        model=str(folder), matrix=MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True)),
        method="magnitude",
        calib_data=str(calibration_text), nsamples=2, seqlen=16, output=out,
    )  # fmt: skip
    ctx = RunContext(data_dir=None, offline=True, cache_dir=cache_dir_default())
    with pytest.raises(UsageError) as error:
        prune(model, cfg, ctx=ctx)
    message = str(error.value)
    assert expected in message and "save it with save_pretrained" in message and "\n" not in message
    assert not out.exists()


def test_evaluate_is_tsenor_eval(
    tiny_llama: Callable[..., Path], data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`evaluate(model, ppl=..., output=...)` writes the eval.json `tsenor eval` writes (the same perplexity),
    and an unknown option is one line before the model loads."""
    import json

    from tests.helpers_cli import invoke
    from tsenor_cli import evaluate
    from tsenor_cli.errors import UsageError

    monkeypatch.setenv("TSENOR_DATA_DIR", str(data_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_llama(num_layers=2)
    (tmp_path / "cli").mkdir()
    (tmp_path / "api").mkdir()
    result = invoke(
        ["eval", str(model), "--ppl", "wikitext2", "--seqlen", "16", "--max-windows", "2", "-o", str(tmp_path / "cli")]
    )
    assert result.exit_code == 0, result.output
    report = evaluate(model, ppl="wikitext2", seqlen=16, max_windows=2, output=tmp_path / "api")
    cli = json.loads((tmp_path / "cli" / "eval.json").read_text())
    api = json.loads((tmp_path / "api" / "eval.json").read_text())
    same = ("ppl", "nll_sum", "tokens", "windows")  # not the seconds each took
    for record in (api["perplexity"]["wikitext2"], report.to_json()["perplexity"]["wikitext2"]):
        assert {k: record[k] for k in same} == {k: cli["perplexity"]["wikitext2"][k] for k in same}
    with pytest.raises(UsageError, match=r"evaluate\(\): unknown option 'windows'; known: ppl, tasks"):
        evaluate(model, ppl="wikitext2", windows=2)

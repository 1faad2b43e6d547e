"""The packed N:M checkpoint (docs/reference/packed-format.md): every dtype and pattern kind round trips bit
for bit, the byte layout of a hand-worked case, a packed prune decodes to the dense prune's tensors, loading
through AutoModelForCausalLM, the pack/unpack commands and the bad inputs."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_tiny import sparsegpt_config
from safetensors import safe_open

from tsenor_cli.errors import PackedFormatError
from tsenor_cli.models.checkpoint import Checkpoint
from tsenor_cli.packed.files import FORMAT_VERSION, PATTERNS_KEY, VERSION_KEY
from tsenor_cli.packed.layout import MatrixPattern, decode, encode, kept_mask
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.settings import RunContext

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KINDS = (("nm", 2, 4), ("transposable", 2, 4), ("nm", 16, 32), ("transposable", 16, 32), ("unstructured", 0, 0))
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(BITS[tensor.element_size()])


def _pruned(kind: str, n: int, m: int, dtype: torch.dtype, rows: int = 64, cols: int = 96) -> torch.Tensor:
    """A random weight pruned to the pattern (a circulant transposable mask: n per row and column of each
    tile), with a kept weight that is exactly 0 and one that is -0.0."""
    generator = torch.Generator().manual_seed(hash((kind, n, m)) % 2**31)
    weight = torch.randn(rows, cols, generator=generator).to(dtype)
    if kind == "unstructured":
        mask = torch.rand(rows, cols, generator=generator) < 0.5
    elif kind == "transposable":
        r, c = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
        mask = ((c - r) % m) < n
    else:
        top = weight.float().abs().view(rows, -1, m).topk(n, -1).indices
        mask = torch.zeros(rows, cols // m, m, dtype=torch.bool).scatter_(-1, top, True).view(rows, cols)
    weight = weight.masked_fill(~mask, 0.0)
    kept = mask.nonzero()
    weight[tuple(kept[0])] = 0.0
    weight[tuple(kept[1])] = -0.0
    return weight


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("kind", "n", "m"), KINDS)
def test_every_dtype_and_pattern_round_trips_bit_for_bit(dtype: torch.dtype, kind: str, n: int, m: int) -> None:
    cols = 96 if m != 32 else 128
    weight = _pruned(kind, n, m, dtype, cols=cols)
    pattern = MatrixPattern.of(kind, n, m, tuple(weight.shape))
    values, code = encode(weight, pattern)
    assert values.dtype == dtype
    assert torch.equal(_bits(decode(values, code, pattern)), _bits(weight))
    stored = values.numel() * values.element_size() + code.numel()
    if dtype == torch.bfloat16 and kind != "unstructured":
        assert stored / (weight.numel() * 2) <= 0.57


def test_the_smaller_code_is_chosen_per_pattern() -> None:
    """2:4: indices 2·2 = 4 bits a group, the mask 4 (a tie, to the indices); 1:4: 2 < 4; 16:32: 16·5 = 80 > 32."""
    assert MatrixPattern.of("nm", 2, 4, (4, 8)).encoding == "index"
    assert MatrixPattern.of("nm", 1, 4, (4, 8)).encoding == "index"
    assert MatrixPattern.of("transposable", 16, 32, (32, 32)).encoding == "mask"
    assert MatrixPattern.of("unstructured", 0, 0, (3, 5)).encoding == "mask"


def test_byte_layout_of_a_hand_worked_2_4_and_16_32_case() -> None:
    """Row [0, 5, 0, 7 | 3, 0, 0, 0] at 2:4: kept positions (1, 3) and (0, 1) (nonzero 3, then the lowest
    zero); values [[5, 7], [3, 0]]; the indices 1, 3, 0, 1 two bits each, least significant first:
    bits 10 11 00 10 → byte 0b01001101 = 0x4D."""
    weight = torch.tensor([[0.0, 5.0, 0.0, 7.0, 3.0, 0.0, 0.0, 0.0]])
    pattern = MatrixPattern.of("nm", 2, 4, (1, 8))
    values, code = encode(weight, pattern)
    assert values.tolist() == [[[5.0, 7.0], [3.0, 0.0]]]
    assert code.tolist() == [[0x4D]]
    # 16:32 keeps the mask: element j of a row is bit j % 8 of byte j // 8.
    row = torch.zeros(1, 32)
    row[0, :16] = torch.arange(1, 17, dtype=torch.float32)
    values, code = encode(row, MatrixPattern.of("nm", 16, 32, (1, 32)))
    assert code.tolist() == [[0xFF, 0xFF, 0x00, 0x00]]
    assert values.flatten().tolist() == list(range(1, 17))


def test_a_mask_that_breaks_its_pattern_is_refused() -> None:
    pattern = MatrixPattern.of("nm", 16, 32, (1, 32))
    with pytest.raises(PackedFormatError, match="breaks 16:32"):
        kept_mask(torch.tensor([[0xFF, 0xFF, 0x01, 0x00]], dtype=torch.uint8), pattern)
    transposable = MatrixPattern.of("transposable", 2, 4, (4, 4))
    rows_ok_columns_not = torch.tensor([[1, 1, 0, 0]] * 4, dtype=torch.bool)
    with pytest.raises(PackedFormatError, match="column"):
        kept_mask(_index_code(rows_ok_columns_not), transposable)
    with pytest.raises(PackedFormatError, match="more than 2 of 4"):
        encode(torch.ones(4, 4), transposable)


# Index codes decode along two paths: a group's bits within one byte (1:4, 2:4, 2:16: one table lookup) or
# split into fields (2:8's 3-bit indices); each round trips and refuses indices that break the pattern.
INDEX_KINDS = (("transposable", 1, 4), ("nm", 2, 8), ("transposable", 2, 8), ("nm", 2, 16), ("transposable", 2, 16))


@pytest.mark.parametrize(("kind", "n", "m"), INDEX_KINDS)
def test_every_index_code_path_round_trips_and_refuses_a_broken_group(kind: str, n: int, m: int) -> None:
    weight = _pruned(kind, n, m, torch.bfloat16, rows=32, cols=96 if m != 16 else 64)
    pattern = MatrixPattern.of(kind, n, m, tuple(weight.shape))
    assert pattern.encoding == "index"
    values, code = encode(weight, pattern)
    assert torch.equal(_bits(decode(values, code, pattern)), _bits(weight))
    broken = code.clone()
    if n == 1:
        broken[0, 0] ^= 0x01  # the first group keeps another position: its tile's columns no longer keep 1 each
    else:
        broken[0, 0] = 0  # the first group's indices all 0: not ascending
    with pytest.raises(PackedFormatError, match="break"):
        decode(values, broken, pattern)


def test_a_code_with_padding_bits_set_is_refused() -> None:
    weight = _pruned("nm", 2, 4, torch.bfloat16, rows=4, cols=12)  # 3 groups: 12 bits, 4 of padding
    pattern = MatrixPattern.of("nm", 2, 4, (4, 12))
    values, code = encode(weight, pattern)
    code[1, -1] |= 0x80
    with pytest.raises(PackedFormatError, match="padding"):
        decode(values, code, pattern)


def _index_code(mask: torch.Tensor) -> torch.Tensor:
    from tsenor_cli.packed.layout import pack_bits

    positions = mask.view(mask.shape[0], -1, 4).nonzero()[:, 2].view(mask.shape[0], -1)
    bits = ((positions.unsqueeze(-1) >> torch.arange(2)) & 1).reshape(mask.shape[0], -1).bool()
    return pack_bits(bits)


@pytest.fixture(scope="module")
def model(tiny_llama: Callable[..., Path]) -> Path:
    return tiny_llama(num_layers=2)


@pytest.fixture(scope="module")
def pruned(model: Path, calib: Path, data_ctx: RunContext, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same prune written dense and packed."""
    root = tmp_path_factory.mktemp("packed")
    outs = {fmt: root / fmt for fmt in ("dense", "packed")}
    for fmt, out in outs.items():
        prune_model(sparsegpt_config(model, calib, out, resume=False, save_format=fmt), data_ctx)
    return outs


def _dense_tensors(folder: Path) -> dict[str, torch.Tensor]:
    checkpoint = Checkpoint.open(folder)
    return checkpoint.read(checkpoint.keys())


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def test_a_packed_prune_decodes_to_the_dense_prune_bit_for_bit(pruned: dict[str, Path]) -> None:
    packed = pruned["packed"] / "model.safetensors"
    with safe_open(str(packed), framework="pt") as handle:
        metadata = handle.metadata()
        keys = set(handle.keys())
    patterns = json.loads(metadata[PATTERNS_KEY])
    assert metadata[VERSION_KEY] == str(FORMAT_VERSION) and patterns
    assert all(f"{key}_tsenor_index" in keys for key in patterns)
    assert _same(_dense_tensors(pruned["packed"]), _dense_tensors(pruned["dense"]))
    config = json.loads((pruned["packed"] / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "tsenor_packed"
    assert "packed" in (pruned["packed"] / "README.md").read_text()


LOAD_SCRIPT = """
import sys
{prelude}
from transformers import AutoModelForCausalLM
model, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)
print({{k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}})
"""


def _load_in_subprocess(folder: Path, prelude: str) -> subprocess.CompletedProcess[str]:
    script = LOAD_SCRIPT.format(prelude=prelude)
    return subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, check=False)


def test_auto_model_loads_the_packed_folder_with_no_missing_keys(pruned: dict[str, Path]) -> None:
    """After `import tsenor_cli` (before or after transformers), the packed folder loads as the dense one."""
    from transformers import AutoModelForCausalLM

    import tsenor_cli

    packed = AutoModelForCausalLM.from_pretrained(pruned["packed"], output_loading_info=True)
    model, info = packed
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    dense = AutoModelForCausalLM.from_pretrained(pruned["dense"])
    assert _same(model.state_dict(), dense.state_dict())
    assert getattr(model.config, "quantization_config", None) is None  # a plain dense model afterwards
    assert _same(tsenor_cli.load(pruned["packed"]).state_dict(), dense.state_dict())


@pytest.mark.parametrize(
    "prelude",
    [
        "import tsenor_cli",
        "import transformers.quantizers.auto\nimport tsenor_cli",
        "import tsenor_cli.models.packed",
        # The Python API first: its import of the loader is what brings transformers' quantizers in.
        "import tsenor_cli\nassert type(tsenor_cli.load(sys.argv[1])).__name__ == 'LlamaForCausalLM'",
    ],
    ids=["tsenor-first", "transformers-first", "loader-module", "api-load-first"],
)
def test_a_fresh_process_loads_the_packed_folder_whatever_it_imports_first(
    pruned: dict[str, Path], prelude: str
) -> None:
    done = _load_in_subprocess(pruned["packed"], prelude)
    assert done.returncode == 0, done.stderr
    assert "'missing_keys': []" in done.stdout and "'unexpected_keys': []" in done.stdout


def test_without_tsenor_loading_fails_naming_the_package(pruned: dict[str, Path]) -> None:
    """transformers only warns of an unknown quant_method (naming tsenor_packed) and goes on; the packed
    values stored under the weights' own names then fail it on their shapes, instead of a model whose
    pruned matrices were initialised at random."""
    done = _load_in_subprocess(pruned["packed"], "")
    assert done.returncode != 0
    assert "Unknown quantization type, got tsenor_packed" in done.stderr
    assert "ignore_mismatched_sizes" in done.stderr.strip().splitlines()[-1]


def _tsenor(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tsenor_cli", *map(str, args)], capture_output=True, text=True, check=False
    )


def test_pack_and_unpack_commands_round_trip(pruned: dict[str, Path], tmp_path: Path) -> None:
    packed, dense = tmp_path / "packed", tmp_path / "dense"
    assert _tsenor("pack", pruned["dense"], "-o", packed).returncode == 0
    assert _tsenor("unpack", packed, "-o", dense).returncode == 0
    assert _same(_dense_tensors(packed), _dense_tensors(pruned["dense"]))
    assert _same(_dense_tensors(dense), _dense_tensors(pruned["dense"]))
    for folder, twin in ((packed, pruned["packed"]), (dense, pruned["dense"])):  # the prune's own files
        assert (folder / "model.safetensors").read_bytes() == (twin / "model.safetensors").read_bytes()
    assert (packed / "model.safetensors").stat().st_size < (pruned["dense"] / "model.safetensors").stat().st_size
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    # the same checkpoint again, without and with --force
    again = _tsenor("pack", pruned["dense"], "-o", packed)
    assert again.returncode == 4 and "--force" in again.stderr
    assert _tsenor("pack", pruned["dense"], "-o", packed, "--force").returncode == 0


def test_a_packed_shard_lays_its_data_out_as_safetensors_whatever_order_they_come_in(tmp_path: Path) -> None:
    """The same tensors added in two orders give the same file, whose entries and data are those
    safetensors.torch.save_file writes for the stored tensors (its metadata's key order is its own)."""
    from safetensors.torch import save_file

    from tsenor_cli.packed.files import PackedWriter

    pattern = MatrixPattern.of("transposable", 2, 4, (8, 8))
    tensors = {
        "b.weight": _pruned("transposable", 2, 4, torch.bfloat16, rows=8, cols=8),
        "a.norm": torch.ones(8, dtype=torch.float32),
        "c.weight": _pruned("transposable", 2, 4, torch.bfloat16, rows=8, cols=8),
    }
    files = []
    for i, order in enumerate((list(tensors), list(reversed(tensors)))):
        writer = PackedWriter(tmp_path / str(i), 1 << 30)
        (tmp_path / str(i)).mkdir()
        for key in order:
            writer.add(key, tensors[key], None if key == "a.norm" else pattern)
        assert writer.finish(0) == ["model.safetensors"]
        files.append((tmp_path / str(i) / "model.safetensors").read_bytes())
    assert files[0] == files[1]
    with safe_open(str(tmp_path / "0" / "model.safetensors"), framework="pt") as handle:
        stored, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()  # noqa: SIM118
    save_file(stored, str(tmp_path / "st.safetensors"), metadata=metadata)

    def layout(blob: bytes) -> tuple[dict[str, object], bytes]:
        (length,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + length])
        header.pop("__metadata__")
        return header, blob[8 + length :]

    assert layout(files[0]) == layout((tmp_path / "st.safetensors").read_bytes())


def test_pack_and_unpack_write_shards_of_the_size_asked(pruned: dict[str, Path], tmp_path: Path) -> None:
    """--max-shard-size as prune's: several shards holding the same tensors; a size that is not one is one
    line, exit 2, and nothing written."""
    packed, dense = tmp_path / "packed", tmp_path / "dense"
    assert _tsenor("pack", pruned["dense"], "-o", packed, "--max-shard-size", "100KB").returncode == 0
    assert _tsenor("unpack", packed, "-o", dense, "--max-shard-size", "100KB").returncode == 0
    for folder in (packed, dense):
        assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1 and not (folder / "model.safetensors").exists()
        assert _same(_dense_tensors(folder), _dense_tensors(pruned["dense"]))
    for command, source in (("pack", pruned["dense"]), ("unpack", pruned["packed"])):
        _one_line_exit_2(_tsenor(command, source, "-o", tmp_path / "out", "--max-shard-size", "1XB"), "'1XB'")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["pack", "unpack"])
def test_a_killed_conversion_leaves_nothing_behind_once_run_again(
    pruned: dict[str, Path], tmp_path: Path, command: str
) -> None:
    """What a SIGKILLed pack/unpack left (its unfinished temporary, and an old output moved aside for
    --force but not yet replaced) is put back or removed by the next run, under the output's lock, which
    refuses a second run meanwhile (exit 4, nothing written)."""
    import shutil

    from tsenor_cli.outputs import output_lock

    source = pruned["dense" if command == "pack" else "packed"]
    out = tmp_path / "out"
    with output_lock(out):
        busy = _tsenor(command, source, "-o", out)
    assert busy.returncode == 4 and "in use by another tsenor run" in busy.stderr and not out.exists()
    unfinished = tmp_path / ".out.tmp-999999-unfinished"
    unfinished.mkdir()
    (unfinished / "model.safetensors").write_bytes(b"\0" * 4096)
    aside = tmp_path / ".out.old-999999-aside"
    shutil.copytree(source, aside / "out")  # a --force run killed between moving the old out aside and renaming
    done = _tsenor(command, source, "-o", out)
    assert done.returncode == 4 and "--force" in done.stderr  # the old output is back in place: not replaced
    assert (out / "config.json").read_bytes() == (source / "config.json").read_bytes()
    assert _tsenor(command, source, "-o", out, "--force").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert _same(_dense_tensors(out), _dense_tensors(pruned["dense"]))


def _rewrite_header(path: Path, change: Callable[[dict[str, object]], None]) -> None:
    """Edit the JSON header of a safetensors file in place (the data offsets unchanged)."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + length :])


def _one_line_exit_2(result: subprocess.CompletedProcess[str], needle: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines


@pytest.mark.parametrize("damage", ["version", "truncated", "mask"])
def test_a_damaged_packed_file_is_one_line_exit_2_and_nothing_written(
    pruned: dict[str, Path], tmp_path: Path, damage: str
) -> None:
    import shutil

    folder = tmp_path / "packed"
    shutil.copytree(pruned["packed"], folder)
    weights = folder / "model.safetensors"
    if damage == "version":
        _rewrite_header(weights, lambda header: header["__metadata__"].update({VERSION_KEY: "99"}))  # type: ignore[attr-defined]
        needle = "format version 99"
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
        needle = "truncated or corrupt"
    else:
        with safe_open(str(weights), framework="pt") as handle:
            key = next(k for k in handle.keys() if k.endswith("_tsenor_index"))  # noqa: SIM118
        blob = bytearray(weights.read_bytes())
        (length,) = struct.unpack("<Q", blob[:8])
        start = 8 + length + json.loads(blob[8 : 8 + length])[key]["data_offsets"][0]
        blob[start] = 0x00  # the first group's indices both 0: not ascending
        weights.write_bytes(bytes(blob))
        needle = "break 2:4"
    result = _tsenor("unpack", folder, "-o", tmp_path / "out")
    _one_line_exit_2(result, needle)
    assert not (tmp_path / "out").exists()


def test_pack_refuses_a_folder_that_is_not_a_tsenor_output_or_breaks_its_pattern(
    model: Path, pruned: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    _one_line_exit_2(_tsenor("pack", model, "-o", tmp_path / "out"), "not a tsenor output")
    broken = tmp_path / "broken"
    shutil.copytree(pruned["dense"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    key = "model.layers.0.mlp.up_proj.weight"
    tensors[key] = torch.ones_like(tensors[key])
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    _one_line_exit_2(_tsenor("pack", broken, "-o", tmp_path / "out"), "breaks its recorded pattern")
    assert not (tmp_path / "out").exists()


def test_a_loaded_packed_model_re_saves_dense_and_packs_again_once_its_record_is_copied(
    pruned: dict[str, Path], tmp_path: Path
) -> None:
    """A loaded packed model is a plain dense one, so transformers' save_pretrained writes the dense tensors.
    Its folder lacks the sparsity record: `tsenor pack` says in one line where to copy it from, writes
    nothing, and once the record is copied packs it to the packed prune's tensors."""
    import shutil

    import tsenor_cli
    from tsenor_cli.runfiles import SPARSITY_FILE

    resaved, out = tmp_path / "resaved", tmp_path / "out"
    tsenor_cli.load(pruned["packed"]).save_pretrained(resaved)
    assert _same(_dense_tensors(resaved), _dense_tensors(pruned["dense"]))
    refused = _tsenor("pack", resaved, "-o", out)
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1
    assert f"copy {SPARSITY_FILE} from the folder it was loaded from" in refused.stderr
    assert not out.exists()
    shutil.copy(pruned["packed"] / SPARSITY_FILE, resaved)
    assert _tsenor("pack", resaved, "-o", out).returncode == 0
    assert _same(_dense_tensors(out), _dense_tensors(pruned["packed"]))


def test_a_transposable_weight_with_zeros_among_its_kept_entries_packs_to_a_transposable_mask() -> None:
    """Real weights can be 0 before pruning: the zeros that fill a group must keep N per tile column too
    (row 0 keeps columns 2 and 3 with a zero at 3: filling it with its lowest zero, column 0, would give
    column 0 three of 4)."""
    tile = (torch.arange(4).view(1, 4) - torch.arange(4).view(4, 1)) % 4 >= 2  # row i keeps (i + 2, i + 3) % 4
    weight = torch.where(tile.repeat(2, 3), torch.arange(1.0, 97.0).view(8, 12), torch.zeros(()))
    weight[0, 3] = 0.0
    weight[5, 4] = 0.0  # row 1 of its tile keeps columns 3 and 0 (4 here)
    for dtype in DTYPES:
        dense = weight.to(dtype)
        pattern = MatrixPattern.of("transposable", 2, 4, (8, 12))
        values, code = encode(dense, pattern)
        mask = kept_mask(code, pattern)  # raises when a tile's column keeps other than 2
        assert bool(mask[0, 3]) and bool(mask[5, 4])
        assert torch.equal(_bits(decode(values, code, pattern)), _bits(dense))

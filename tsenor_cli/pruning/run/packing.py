"""`tsenor pack` and `tsenor unpack`: a tsenor checkpoint folder converted between the dense and the packed format.

Both read the source tensor by tensor (`models.checkpoint.Checkpoint`, which decodes a packed matrix as it
is read) and write the other format into a temporary folder renamed into place (`runfiles.write.converted_folder`), so
a refused input or a failure writes nothing. The other files (tokenizer, reports, records) are copied;
config.json gains or loses the packed format's ``quantization_config`` and the model card is rewritten.
`unpack` of a packed prune gives the dense prune's tensors bit for bit.
"""

from __future__ import annotations

import math
from pathlib import Path

from tsenor_cli.errors import InputNotFoundError, OutputExistsError, PackedFormatError
from tsenor_cli.models.checkpoint import Checkpoint
from tsenor_cli.models.saving import parse_size, write_weights
from tsenor_cli.packed.files import PackedWriter, declares_packed, quantization_entry, record_patterns
from tsenor_cli.packed.layout import MatrixPattern, encode, kept_mask
from tsenor_cli.pruning.run.card import refresh_card
from tsenor_cli.pruning.run.output import MAX_SHARD_SIZE
from tsenor_cli.runfiles import CONFIG_FILE, read_sparsity
from tsenor_cli.runfiles.write import converted_folder, copy_run_files
from tsenor_cli.tensorfile import TensorSpec


def _check_paths(source: Path, output: Path, *, force: bool, max_shard_size: str) -> None:
    parse_size(max_shard_size)  # a bad size refused before anything is read
    if not (source / CONFIG_FILE).is_file():
        raise InputNotFoundError(f"{source} has no {CONFIG_FILE}; pass a checkpoint folder written by tsenor")
    if output.resolve() == source.resolve():
        raise OutputExistsError(f"-o {output} is the input folder; choose another output folder")
    _check_output(output, force=force)


def _check_output(output: Path, *, force: bool) -> None:
    """Before any work, and again under the output's lock once a killed run's old output is put back."""
    if output.exists() and not force:
        raise OutputExistsError(f"{output} already exists; pass --force to replace it or choose another -o")


def _file_keys(source: Path, patterns: dict[str, MatrixPattern], keys: list[str]) -> dict[str, MatrixPattern]:
    """`patterns` under the files' keys: the sparsity record names each parameter by the model's own key, and
    a prune writes the source checkpoint's layout (Mllama's ``language_model.model.layers…``, which
    transformers renames on load), mapped back as transformers maps it (`models.saving.source_layout`)."""
    if set(patterns) <= set(keys):
        return patterns
    import transformers

    from tsenor_cli.models.loading import meta_model
    from tsenor_cli.models.saving import source_layout

    config = transformers.AutoConfig.from_pretrained(str(source), local_files_only=True)
    layout = source_layout(meta_model(config), keys) or {}
    return {layout.get(own, own): pattern for own, pattern in patterns.items()}


def pack_folder(source: Path, output: Path, *, force: bool = False, max_shard_size: str = MAX_SHARD_SIZE) -> Path:
    """Write the packed form of the dense tsenor checkpoint `source` into `output` → output.

    PackedFormatError (exit 2) for a folder that is not a tsenor output, one already packed, or whose
    weights break their recorded pattern; OutputExistsError for an existing `output` without `force`."""
    source, output = Path(source), Path(output)
    _check_paths(source, output, force=force, max_shard_size=max_shard_size)
    if declares_packed(source):
        raise PackedFormatError(f"{source} is packed already; tsenor unpack writes its dense form")
    sparsity = read_sparsity(source)
    if sparsity is None:
        raise PackedFormatError(f"{source} is not a tsenor output (its {CONFIG_FILE} records no sparsity)")
    checkpoint = Checkpoint.open(source)
    patterns = _file_keys(source, record_patterns(sparsity), checkpoint.keys())
    lacking = sorted(set(patterns) - set(checkpoint.keys()))
    if lacking:
        raise PackedFormatError(f"{source}: its sparsity record names {lacking[0]}, which its weights lack")
    with converted_folder(output, lambda: _check_output(output, force=force)) as tmp:
        writer = PackedWriter(tmp, parse_size(max_shard_size))
        for key, tensor in checkpoint.iter_read(checkpoint.keys()):
            pattern = patterns.get(key)
            if pattern is not None:
                try:
                    pattern = pattern.fitted(tuple(tensor.shape))
                    kept_mask(encode(tensor, pattern)[1], pattern)
                except PackedFormatError as exc:
                    raise PackedFormatError(f"{source}: {key} breaks its recorded pattern ({exc})") from exc
            writer.add(key, tensor, pattern)
        writer.finish(sum(math.prod(info.shape) for info in checkpoint.tensors.values()))
        copy_run_files(source, tmp, quantization_entry())
        refresh_card(tmp)
    return output


def unpack_folder(source: Path, output: Path, *, force: bool = False, max_shard_size: str = MAX_SHARD_SIZE) -> Path:
    """Write the dense form of the packed checkpoint `source` into `output` → output (every packed
    matrix decoded and checked against its pattern). PackedFormatError for a folder that is not packed."""
    source, output = Path(source), Path(output)
    _check_paths(source, output, force=force, max_shard_size=max_shard_size)
    if not declares_packed(source):
        raise PackedFormatError(f"{source} is not packed (its {CONFIG_FILE} has no tsenor_packed quantization_config)")
    checkpoint = Checkpoint.open(source)
    specs = [TensorSpec(key, info.shape, info.dtype) for key, info in checkpoint.tensors.items()]
    with converted_folder(output, lambda: _check_output(output, force=force)) as tmp:
        write_weights(
            tmp,
            specs,
            checkpoint.iter_read(checkpoint.keys()),
            max_shard_size=max_shard_size,
            total_parameters=sum(math.prod(spec.shape) for spec in specs),
        )
        copy_run_files(source, tmp, None)
        refresh_card(tmp)
    return output

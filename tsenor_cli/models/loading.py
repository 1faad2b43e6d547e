"""Resolve a ``--model`` value (embedded name, local checkpoint folder or hub id) and load it.

Resolution order: an embedded name (``smollm2-135m``) is materialized into the cache; an existing
folder is a local checkpoint; a value that looks like a path but does not exist is an error naming
that path; anything else is a hub id handed to ``from_pretrained``, whose failure (offline, no
access, unknown id) becomes one InputNotFoundError with the fix. With the run context's offline policy
a hub id loads from the local HF cache only (``local_files_only``), never from the network.

A multimodal checkpoint (Gemma-3, LLaVA, Qwen2-VL, Idefics3, Mllama *ForConditionalGeneration) loads
whole, with the class it was saved with (`auto_class`); the engine then works on its language model
(models/structure.py), and the processor files (`PROCESSOR_FILES`) travel to the output unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tsenor_cli.errors import BadInputError, IncompatibleModelError, InputNotFoundError, UsageError
from tsenor_cli.models.checkpoint import INDEX_NAME, PICKLE_PATTERN, WEIGHTS_NAME, Checkpoint, read_weight_map
from tsenor_cli.models.conformance import check_checkpoint
from tsenor_cli.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS, is_embedded, materialize
from tsenor_cli.models.structure import ModelStructure, discover_structure
from tsenor_cli.packed.files import drop_packed_entry
from tsenor_cli.progress import logger, sink
from tsenor_cli.runfiles import GENERATION_CONFIG_FILE
from tsenor_cli.settings import RunContext

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# What a multimodal checkpoint's processor reads besides the tokenizer and that neither the model's nor
# the tokenizer's save_pretrained writes (transformers' PROCESSOR_NAME, IMAGE_PROCESSOR_NAME,
# VIDEO_PROCESSOR_NAME, LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE); chat_template.jinja is the tokenizer's.
PROCESSOR_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
)


@dataclass(frozen=True)
class LoadOptions:
    """How a model is loaded besides its dtype, device and streaming (`load_model`'s `options`):
    trust_remote_code (run the checkpoint's own model code), device_map (transformers' placement, "auto"),
    progress (where the load's lines go), check_tokenizer (refuse a tokenizer whose ids pass the embedding),
    before_weights (a check of the config and tokenizer run before any weight is read)."""

    trust_remote_code: bool = False
    device_map: str | None = None
    progress: Callable[[str], None] | None = None
    check_tokenizer: bool = False
    before_weights: Callable[[Any, Any], None] | None = None


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM (or a multimodal model around one) in eval mode with its tokenizer and its decoder
    structure; processor_files: {name: content} of the source's `PROCESSOR_FILES`, for the output."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    name: str  # what the user passed
    source: str  # resolved local folder or hub id
    structure: ModelStructure
    processor_files: Mapping[str, bytes] = field(default_factory=dict)
    # Set when the model was loaded for streaming (`load_model(stream=True)`): its decoder blocks are on
    # the meta device and are read from this checkpoint one at a time (models/streaming.py).
    checkpoint: Checkpoint | None = None
    # The dtype the checkpoint's weights are stored in (`checkpoint_dtype`), whatever dtype the model
    # computes in; None when its config.json names none.
    source_dtype: torch.dtype | None = None
    # {the model's own key: the source checkpoint's key} (`models.saving.source_layout`): the output is
    # written in the source's layout, so every class that loads the source loads it; None: the model's own
    # names (a hub id, pickle weights, or a layout transformers converts rather than renames).
    layout: Mapping[str, str] | None = None

    @property
    def model_type(self) -> str:
        return str(self.model.config.model_type)

    @property
    def max_positions(self) -> int | None:
        value = config_value(self.model.config, "max_position_embeddings")
        return int(value) if value else None


def config_value(config: Any, name: str) -> Any:
    """`name` (hidden_size, max_position_embeddings, vocab_size, …) of the language model of `config`.

    A multimodal config keeps them in its text config (transformers' ``get_text_config()``, which is
    the config itself for a plain LM); the top config's own value is the fallback. None when neither has it.
    """
    getter = getattr(config, "get_text_config", None)
    text = getter(decoder=True) if getter is not None else config
    value = getattr(text, name, None)
    return value if value is not None else getattr(config, name, None)


def parse_dtype(text: str | None) -> torch.dtype | None:
    """Parse bf16/bfloat16, fp16/float16, fp32/float32; None or "auto" → None (the device default)."""
    if text is None or text == "auto":
        return None
    key = text.strip().lower()
    if key not in DTYPES:
        raise UsageError(f"unknown dtype {text!r}; use one of: auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[key]


def resolve_device(device: str | torch.device) -> torch.device:
    """A torch.device, refusing CUDA when none is present (a clear error rather than a deep traceback)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device!r} requested but no CUDA device is available; use --device cpu")
    return resolved


def checkpoint_dtype(config: Any) -> torch.dtype | None:
    """The dtype a checkpoint's weights are stored in, as its config names it (``dtype``, ``torch_dtype``
    before transformers 5; a multimodal model's text config when the top one names none): what
    transformers' ``dtype="auto"`` loads. None when the config names no floating dtype."""
    getter = getattr(config, "get_text_config", None)
    for where in (config, getter(decoder=True) if getter is not None else None):
        named = getattr(where, "dtype", None) or getattr(where, "torch_dtype", None)
        if isinstance(named, torch.dtype) and named.is_floating_point:
            return named
        if isinstance(named, str) and named.removeprefix("torch.") in DTYPES:
            return DTYPES[named.removeprefix("torch.")]
    return None


def output_dtype(requested: str | None, source: torch.dtype | None, compute: torch.dtype) -> torch.dtype:
    """The dtype a run writes its checkpoint in: --dtype when given (not "auto"); else the checkpoint's own
    (`checkpoint_dtype`, what transformers means by "auto"), whatever the run computed in (fp32 on the
    CPU); else the compute dtype."""
    return parse_dtype(requested) or source or compute


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (what the paper's A100 runs use), fp32 on CPU (bf16 matmuls are slow there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _looks_like_path(name: str) -> bool:
    # A hub id is "name" or "org/name"; anything with a leading ./ ~ / or more than one slash is a path.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith("/") or "\\" in name


def hub_error(name: str, ctx: RunContext) -> InputNotFoundError:
    """The error for a hub id that did not load: not cached under the offline policy, or not downloadable.

    "dir/name" is also how a relative path looks: when "dir" is a local folder, the path was likely mistyped.
    """
    first = name.split("/", 1)[0]
    if "/" in name and Path(first).expanduser().is_dir():
        return InputNotFoundError(
            f"model directory {name} does not exist (and no hub model {name} could be loaded); "
            f"check the path, e.g. ls {first}"
        )
    if ctx.offline:
        return InputNotFoundError(
            f"{name} is not in the local HF cache and the hub is off (--offline or HF_HUB_OFFLINE); pass the "
            f"path of a local checkpoint directory as MODEL, drop --offline, or pass MODEL {DEFAULT_MODEL} (embedded)"
        )
    # A cluster's compute nodes often have no network: the usual fix is to download on a node that has it
    # into the shared HF cache, then run offline from the cache.
    return InputNotFoundError(
        f"cannot download {name} (no network or no access); on a machine without network, download it where "
        f"there is one (hf download {name}) and pass --offline, or pass the path of a local checkpoint "
        f"directory as MODEL, or pass MODEL {DEFAULT_MODEL} (embedded)"
    )


def resolve_source(name: str, ctx: RunContext, *, progress: Callable[[str], None] | None = None) -> tuple[str, bool]:
    """(source, is_local): a local checkpoint folder, or a hub id to try with from_pretrained."""
    if not name or not name.strip():
        raise UsageError(f"MODEL is empty; pass a local checkpoint directory or one of: {', '.join(EMBEDDED_MODELS)}")
    if is_embedded(name):
        return str(materialize(name, ctx.cache_dir, progress=progress)), True
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InputNotFoundError(
                f"model path {path} is a file; pass the checkpoint directory that holds config.json"
            )
        if not (path / "config.json").is_file():
            raise InputNotFoundError(
                f"model directory {path} has no config.json; pass a HF checkpoint directory "
                f"(config.json + safetensors + tokenizer), or MODEL {DEFAULT_MODEL} (embedded)"
            )
        return str(path.resolve()), True
    if _looks_like_path(name):
        raise InputNotFoundError(
            f"model directory {path} does not exist; pass an existing local checkpoint directory, "
            f"or MODEL {DEFAULT_MODEL} (embedded)"
        )
    return name, False


def _code_modules(auto_map: dict[str, Any]) -> list[tuple[str, str]]:
    """(reference, module) of each class config.json's auto_map takes from the checkpoint folder itself:
    "modeling_foo.FooForCausalLM" → module "modeling_foo"; "org/repo--modeling_foo.Foo" (code in another
    repository) is left to transformers."""
    refs = [ref for value in auto_map.values() for ref in (value if isinstance(value, list) else [value])]
    return [(ref, ref.rsplit(".", 1)[0]) for ref in refs if isinstance(ref, str) and "--" not in ref and "." in ref]


def _check_local_config(folder: Path, trust_remote_code: bool) -> None:
    """What config.json of a local checkpoint needs, read before transformers does: its own model code
    (`auto_map`) only with `trust_remote_code` and with the files it names; without such code, a model type
    transformers knows."""
    from transformers import CONFIG_MAPPING, __version__

    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"{path} is not valid JSON ({exc}); re-download or re-copy the checkpoint") from exc
    if not isinstance(config, dict):
        raise BadInputError(f"{path} holds no JSON object; re-download or re-copy the checkpoint")
    auto_map = config.get("auto_map")
    if isinstance(auto_map, dict) and auto_map:
        modules = _code_modules(auto_map)
        if not trust_remote_code:
            named = modules[0][0] if modules else next(iter(auto_map.values()))
            raise UsageError(
                f"{folder} needs its own model code ({named}, from config.json's auto_map); pass "
                "--trust-remote-code to run it, if you trust that code"
            )
        for ref, module in modules:
            if not (folder / f"{module.replace('.', '/')}.py").is_file():
                raise InputNotFoundError(
                    f"{folder}: config.json's auto_map names {ref}, but {folder} has no {module}.py; copy the "
                    "model's code files into the checkpoint folder"
                )
        return
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        raise IncompatibleModelError(
            f"{folder}: model type {model_type!r} is unknown to transformers {__version__} and config.json names "
            "no model code of its own (auto_map); pass a checkpoint of a supported architecture, or upgrade "
            "transformers"
        )


def read_config(name: str, source: str, is_local: bool, ctx: RunContext, *, trust_remote_code: bool) -> Any:
    """The transformers config of `name` (resolved to `source` by `resolve_source`), every failure one line:
    a local folder is checked first (`_check_local_config`); a hub id that cannot be had is `hub_error`'s
    line, and one transformers refuses (its own code without --trust-remote-code, an unknown model type)
    is IncompatibleModelError naming the flag. A packed folder's config comes without the packed format's
    entry (`drop_packed_entry`): tsenor's readers decode its matrices."""
    from transformers import AutoConfig

    from tsenor_cli.errors import one_line

    if is_local:
        _check_local_config(Path(source), trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, local_files_only=ctx.offline)
    except OSError as exc:
        if is_local:
            raise InputNotFoundError(f"cannot read the config of {source}: {one_line(str(exc))}") from exc
        raise hub_error(name, ctx) from exc
    except ValueError as exc:  # transformers' refusal of a model's own code, or a model type it does not know
        fix = "" if trust_remote_code else "; if it needs its own model code, pass --trust-remote-code"
        raise IncompatibleModelError(
            f"transformers cannot read the config of {name} ({one_line(str(exc))}){fix}"
        ) from exc
    drop_packed_entry(config)
    return config


WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def check_weight_files(folder: Path) -> None:
    """Refuse a local checkpoint without weight files (a folder holding config.json only), and a
    truncated or corrupt *.safetensors file by its header alone (safetensors checks that the header's
    offsets cover the file), before the tokenizer or any weight is read."""
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise InputNotFoundError(
            f"{folder} has no weight files ({' or '.join(WEIGHT_PATTERNS)}); copy the checkpoint's weights "
            "into it, or pass the folder that holds them"
        )
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except SafetensorError as exc:
            raise BadInputError(
                f"{file} is truncated or corrupt ({exc}); re-download or re-copy the checkpoint"
            ) from exc


def auto_class(config: Any) -> Any:
    """The transformers Auto class that builds `config`'s model whole, with its own class.

    AutoModelForCausalLM or AutoModelForImageTextToText: the one whose class for this config is the one
    the checkpoint was saved with (``config.architectures``), else the first that has a class for it
    (AutoModelForCausalLM would build Mllama's text-only MllamaForCausalLM, dropping the vision
    tower that MllamaForConditionalGeneration keeps). A config neither knows (remote code) gets
    AutoModelForCausalLM, as before.
    """
    from transformers import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
    )

    saved = set(getattr(config, "architectures", None) or ())
    known = [
        (auto, mapping[type(config)])
        for auto, mapping in (
            (AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING),
            (AutoModelForImageTextToText, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING),
        )
        if type(config) in mapping
    ]
    for auto, model_class in known:
        if getattr(model_class, "__name__", None) in saved:
            return auto
    return known[0][0] if known else AutoModelForCausalLM


def loading_classes(config: Any) -> list[Any]:
    """The transformers classes that load a checkpoint of `config` whole: AutoModelForCausalLM's and
    AutoModelForImageTextToText's class for it (Mllama has both: the text-only MllamaForCausalLM and
    MllamaForConditionalGeneration), each once."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    mappings = (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING)
    return list(dict.fromkeys(mapping[type(config)] for mapping in mappings if type(config) in mapping))


def meta_model(config: Any, *, trust_remote_code: bool = False) -> Any:
    """The model of a transformers `config` (`auto_class`) built on the meta device: its module tree and
    shapes, no weights.

    IncompatibleModelError when transformers has neither a causal-LM nor an image-text-to-text class for
    the config's model type.
    """
    try:
        with torch.device("meta"):
            return auto_class(config).from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as exc:  # transformers' "Unrecognized configuration class ... for AutoModelForCausalLM"
        raise IncompatibleModelError(
            f"model type {config.model_type!r} has no causal-LM class in transformers (nor an image-text-to-text "
            "one); pass a decoder LM checkpoint"
        ) from exc


def embedding_rows(meta: Any) -> int | None:
    """The rows of the token embedding of `meta` (a model from `meta_model`), else its text config's
    vocab_size (Mllama's embedding has 8 rows more than vocab_size, for its image token)."""
    getter = getattr(meta, "get_input_embeddings", None)
    embedding = getter() if getter is not None else None
    rows = getattr(embedding, "num_embeddings", None)
    if rows is None:
        rows = config_value(meta.config, "vocab_size")
    return int(rows) if rows is not None else None


def check_vocabulary(name: str, tokenizer: Any, rows: int | None) -> None:
    """IncompatibleModelError when the tokenizer's ids reach past the `rows` of the token embedding:
    the first such id in the text would stop the run with an IndexError."""
    if rows is not None and len(tokenizer) > rows:
        raise IncompatibleModelError(
            f"the tokenizer of {name} has {len(tokenizer)} ids but its model's token embedding has {rows} rows; "
            "pass a checkpoint whose tokenizer files belong to its model (copy the base model's tokenizer files)"
        )


def processor_files(source: str, is_local: bool, ctx: RunContext) -> dict[str, bytes]:
    """{name: content} of the `PROCESSOR_FILES` the source has: read from a local folder, or fetched like
    the model's own files for a hub id (from the cache only when offline).

    A hub file that the offline cache does not hold cannot be told apart from one the model does not
    have: a warning names them, the output then lacks them.
    """
    if is_local:
        folder = Path(source)
        return {name: (folder / name).read_bytes() for name in PROCESSOR_FILES if (folder / name).is_file()}
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    found: dict[str, bytes] = {}
    unknown: list[str] = []
    for name in PROCESSOR_FILES:
        try:
            found[name] = Path(hf_hub_download(source, name, local_files_only=ctx.offline)).read_bytes()
        except LocalEntryNotFoundError:  # offline and not in the cache (a subclass of the next one)
            unknown.append(name)
        except EntryNotFoundError:  # the hub says the model has no such file
            continue
    if unknown:
        logger.warning(
            "%s: %s not in the local HF cache (offline); the output will lack them if the model has them",
            source,
            ", ".join(unknown),
        )
    return found


def load_model(
    name: str,
    ctx: RunContext,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    stream: bool = False,
    options: LoadOptions | None = None,
) -> LoadedModel:
    """Load `name` in eval mode on `device` (default dtype: bf16 on CUDA, fp32 on CPU) with its own class
    (`auto_class`: a causal LM, or a multimodal model whose language model the structure describes).

    stream: read only what lies outside the decoder blocks; the blocks stay on the meta device, to be read
    one at a time from `LoadedModel.checkpoint` (`models/streaming.py`). It needs a local folder of
    safetensors weights (every bad one is refused here, before anything is read: `models/checkpoint.py`);
    a folder of pickle weights is loaded whole, with one warning line; a hub id streams its `hub_snapshot`.
    options: `LoadOptions` (None: its defaults). Its before_weights(config, tokenizer) runs once both are
    loaded and before the weights are read, so a check that needs only them (e.g. that the calibration
    text fills its windows) fails in seconds; check_tokenizer refuses, before the weights are read, a
    tokenizer with more ids than the model's token embedding has rows (`check_vocabulary`), for the
    commands that feed it tokenized text; device_map is transformers' device_map for from_pretrained
    ("auto": accelerate spreads the model over the GPUs present, then the CPU), and `device` is then not
    used to place the model.

    Raises InputNotFoundError for a missing folder or an unreachable (or, offline, uncached) hub id,
    IncompatibleModelError for a model without a decoder block list of nn.Linear-holding blocks
    (checked on the model built from its config on the meta device, before the weights are read), and
    CheckpointMismatchError for a local checkpoint whose weights disagree with its config.json
    (`models/conformance.py`: the same verdict streamed or whole, before the tokenizer or a weight is read).
    """
    how = LoadOptions() if options is None else options
    progress = how.progress
    torch_device = resolve_device(device)
    torch_dtype = dtype if dtype is not None else default_dtype(torch_device)
    src = _open_source(name, ctx, trust_remote_code=how.trust_remote_code, progress=progress)
    if stream and not src.is_local:
        src = _snapshot_source(src, progress)
    source, is_local, config = src.path, src.is_local, src.config
    stored = checkpoint_dtype(config)
    meta = _checked_meta(src)
    checkpoint = _stream_checkpoint(name, source, is_local) if stream else None
    layout = _source_layout(meta, Path(source), checkpoint) if is_local else None
    sink(progress)(f"loading {name} ({config.model_type}, {torch_dtype}) on {torch_device}")
    tokenizer = _checked_tokenizer(src, meta, check=how.check_tokenizer, before_weights=how.before_weights)
    files = processor_files(source, is_local, ctx)
    if checkpoint is not None:
        streamed = _load_streamed(src, tokenizer, files, checkpoint, torch_dtype, torch_device)
        if streamed is not None:
            return dataclasses.replace(streamed, source_dtype=stored, layout=layout)
    model = _load_whole(src, torch_dtype, how.device_map, torch_device)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        source=source,
        structure=discover_structure(model),
        processor_files=files,
        source_dtype=stored,
        layout=layout,
    )


@dataclass(frozen=True)
class _Source:
    """Where a load reads from: the name asked for, the folder or hub id it resolved to (`path`), whether that
    is a local folder, the run's context, its transformers config, and the keywords every from_pretrained
    call of the load takes (`hub`: trust_remote_code, local_files_only)."""

    name: str
    path: str
    is_local: bool
    ctx: RunContext
    config: Any
    hub: dict[str, Any]


def _open_source(
    name: str, ctx: RunContext, *, trust_remote_code: bool, progress: Callable[[str], None] | None
) -> _Source:
    """`name` resolved (`resolve_source`) and its config read (`read_config`), each failure one line."""
    source, is_local = resolve_source(name, ctx, progress=progress)
    hub = {"trust_remote_code": trust_remote_code, "local_files_only": ctx.offline}
    config = read_config(name, source, is_local, ctx, trust_remote_code=trust_remote_code)
    return _Source(name, source, is_local, ctx, config, hub)


# What a streamed load of a hub id fetches besides the weights: the config, tokenizer, generation and processor
# files (`PROCESSOR_FILES`) that from_pretrained reads, with the model's own code when it is allowed to run.
SNAPSHOT_FILES = ("*.json", "*.txt", "*.jinja", "*.model", "*.tiktoken", "tokenizer*")


def hub_snapshot(name: str, ctx: RunContext, *, trust_remote_code: bool) -> Path | None:
    """The local snapshot of hub model `name` in the HF cache, downloaded there as `hf download` does (only
    read from it under the offline policy): its small files (`SNAPSHOT_FILES`) and the safetensors weights
    its index names, or model.safetensors; not the other copies a repository may hold (`original/`, GGUF,
    consolidated weights), which from_pretrained does not read either. None when the model has no
    safetensors weights (pickle only). A download that fails, or weights the offline cache lacks, is
    `hub_error`'s line."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    small = [*SNAPSHOT_FILES, *(["*.py"] if trust_remote_code else [])]
    try:
        folder = Path(snapshot_download(name, allow_patterns=small, local_files_only=ctx.offline))
        index = folder / INDEX_NAME
        weights = sorted(set(read_weight_map(index).values())) if index.is_file() else []
        folder = Path(snapshot_download(name, allow_patterns=weights or [WEIGHTS_NAME], local_files_only=ctx.offline))
    except (HfHubHTTPError, LocalEntryNotFoundError) as exc:
        raise hub_error(name, ctx) from exc
    missing = [file for file in weights if not (folder / file).is_file()]
    if missing:  # the offline cache holds the index but not every shard it names
        raise hub_error(name, ctx)
    if weights or (folder / WEIGHTS_NAME).is_file():
        return folder
    if ctx.offline and not any(folder.glob(PICKLE_PATTERN)):  # the cache holds no weights of it at all
        raise hub_error(name, ctx)
    return None


def _snapshot_source(src: _Source, progress: Callable[[str], None] | None) -> _Source:
    """`src`, a hub id to stream, as its local snapshot (`hub_snapshot`), read as a local folder from there on;
    `src` itself when the model has no safetensors weights (it is then loaded whole, with one line)."""
    trust = src.hub["trust_remote_code"]
    folder = hub_snapshot(src.name, src.ctx, trust_remote_code=trust)
    if folder is None:
        logger.info("%s has pickle weights only; streaming needs safetensors, so it is loaded whole", src.name)
        return src
    sink(progress)(f"{src.name}: streaming from its snapshot in the HF cache, {folder}")
    config = read_config(src.name, str(folder), True, src.ctx, trust_remote_code=trust)
    return _Source(src.name, str(folder), True, src.ctx, config, src.hub)


def _checked_meta(src: _Source) -> Any:
    """The model of `src`'s config on the meta device, its structure found, and for a local folder its weight
    files and their conformance to the config checked, before the tokenizer or any weight is read."""
    meta = meta_model(src.config, trust_remote_code=src.hub["trust_remote_code"])
    discover_structure(meta)
    if src.is_local:
        check_weight_files(Path(src.path))
        check_checkpoint(Path(src.path), meta, name=src.name)
    return meta


def _checked_tokenizer(
    src: _Source, meta: Any, *, check: bool, before_weights: Callable[[Any, Any], None] | None
) -> Any:
    """The tokenizer of `src`; with `check`, refused when its ids reach past the rows of `meta`'s token
    embedding (`check_vocabulary`); then `before_weights(config, tokenizer)`, when given."""
    tokenizer = _load_tokenizer(src.name, src.path, src.is_local, src.ctx, src.hub)
    if check:
        check_vocabulary(src.name, tokenizer, embedding_rows(meta))
    if before_weights is not None:
        before_weights(src.config, tokenizer)
    return tokenizer


def _load_tokenizer(name: str, source: str, is_local: bool, ctx: RunContext, hub: dict[str, Any]) -> Any:
    """The tokenizer of `source`; a local folder without tokenizer files is one line naming them."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, **hub)
    except (OSError, ValueError) as exc:  # transformers raises ValueError when no tokenizer file is found
        if is_local:
            raise InputNotFoundError(
                f"cannot load the tokenizer of {source} ({exc}); copy the tokenizer files of its base model "
                "(tokenizer.json or tokenizer.model, tokenizer_config.json) into it"
            ) from exc
        raise hub_error(name, ctx) from exc


def _load_whole(src: _Source, dtype: torch.dtype, device_map: str | None, device: torch.device) -> Any:
    """The whole model of `src` in eval mode on `device` (or placed by `device_map`); a corrupt or missing
    weight file is one line."""
    name, source = src.name, src.path
    placement = {} if device_map is None else {"device_map": device_map}
    try:
        model = auto_class(src.config).from_pretrained(source, dtype=dtype, **placement, **src.hub)
    except SafetensorError as exc:
        raise BadInputError(f"the weights of {name} are corrupt ({exc}); re-download or re-copy them") from exc
    except OSError as exc:
        if src.is_local:
            raise InputNotFoundError(
                f"cannot load the checkpoint in {source} ({exc}); "
                "it needs config.json, *.safetensors and tokenizer files"
            ) from exc
        raise hub_error(name, src.ctx) from exc
    if device_map is None:
        model = model.to(device)
    model.eval()
    return model


def _stream_checkpoint(name: str, source: str, is_local: bool) -> Checkpoint | None:
    """The checkpoint a streamed load reads its blocks from (its headers checked), None for a folder of
    pickle weights (loaded whole, with a warning line) or a hub id without safetensors weights (loaded
    whole; `_snapshot_source` said so)."""
    if not is_local:
        return None
    folder = Path(source)
    if (
        not (folder / WEIGHTS_NAME).is_file()
        and not (folder / INDEX_NAME).is_file()
        and any(folder.glob(PICKLE_PATTERN))
    ):
        logger.warning(
            "%s holds pickle weights (%s); streaming needs safetensors, so it is loaded whole", name, PICKLE_PATTERN
        )
        return None
    return Checkpoint.open(folder)


def _load_streamed(
    src: _Source,
    tokenizer: Any,
    files: dict[str, bytes],
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
) -> LoadedModel | None:
    """The model of `src.config` with what lies outside its decoder blocks read from `checkpoint` onto `device`
    and its blocks on the meta device (`models/streaming.py`); None, with one warning line, when the
    checkpoint stores its tensors under other names than the model's parameters (transformers renames them
    on load): it cannot be read block by block, so the caller loads it whole."""
    from tsenor_cli.models.streaming import first_missing, load_resident, skeleton

    name, source, config = src.name, src.path, src.config
    model = skeleton(auto_class(config), config, dtype, trust_remote_code=src.hub["trust_remote_code"])
    _checkpoint_generation_config(model, Path(source))
    missing = first_missing(model, checkpoint)
    if missing is not None:
        logger.warning(
            "%s holds no tensor %s: its tensors are stored under other names than the model's modules "
            "(transformers renames them on load), so it cannot be read block by block and is loaded whole",
            name,
            missing,
        )
        return None
    structure = discover_structure(model)
    load_resident(model, structure, checkpoint, device)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        source=source,
        structure=structure,
        processor_files=files,
        checkpoint=checkpoint,
    )


def _checkpoint_generation_config(model: Any, folder: Path) -> None:
    """Give a model built from its config the checkpoint's own generation settings (its EOS list, sampling
    defaults), as from_pretrained does: the output's generation_config.json is written from them."""
    from transformers import GenerationConfig

    if model.can_generate() and (folder / GENERATION_CONFIG_FILE).is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)


def _source_layout(meta: Any, folder: Path, checkpoint: Checkpoint | None) -> dict[str, str] | None:
    """The source's key layout (`models.saving.source_layout`) from the headers of its safetensors files;
    None for a folder of pickle weights."""
    from tsenor_cli.models.saving import source_layout

    if checkpoint is None:
        if not (folder / WEIGHTS_NAME).is_file() and not (folder / INDEX_NAME).is_file():
            return None
        checkpoint = Checkpoint.open(folder)
    return source_layout(meta, checkpoint.keys())

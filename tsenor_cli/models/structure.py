"""Where the decoder blocks and their prunable linears are, found from the module tree (any architecture).

The engine (paper Section 4, layer-wise reconstruction as in SparseGPT/Wanda/ALPS) runs the decoder
blocks one at a time. All it needs from the model's structure is found generically:

- the block list: among the non-empty ``nn.ModuleList`` modules under transformers' ``model.base_model``
  (outermost ones: a list inside another, e.g. an MoE block's experts, is part of a block), those
  holding a module of a class named in ``model._no_split_modules`` (transformers' name for "the
  repeated block") are preferred; then the one nearest the token embedding
  (``model.get_input_embeddings()``: the deepest common ancestor), so a multimodal model's text
  decoder wins over its vision tower's encoder layers; then the largest. The entries may be of several
  classes (Jamba's Mamba and attention layers, Mllama's self- and cross-attention layers);
- the language model (``ModelStructure.base``): the smallest module holding both the token embedding
  and the block list (``model.model`` for the *ForCausalLM classes, ``model.model.language_model`` for
  Gemma-3/LLaVA/Qwen2-VL's *ForConditionalGeneration); the engine runs its text-only forward to record
  what each block is given. Without a token embedding it is the base model. What lies outside it
  besides the output head (vision tower, projector) is listed in ``ModelStructure.outside``: it is
  never pruned;
- the nn.Linear layers of a block, fused ones (Phi-3's ``qkv_proj``, ``gate_up_proj``) included; its
  other weight matrices (GPT-2's ``Conv1D``, fused expert stacks, bare 2D parameters) are found by
  watching its forward (``tsenor_cli.pruning.block.observe``).

``config.model_type`` is kept only as information: nothing here switches on it, and no module is
found by its name. What a block is given by the model's forward, and which linears read the same
input, are observed by running the model (`tsenor_cli.pruning.block.engine`), not written down per
architecture.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tsenor_cli.errors import IncompatibleModelError


@dataclass(frozen=True, eq=False)
class ModelStructure:
    """The decoder stack of a causal LM (of a multimodal model: of its language model).

    base: the language model, whose forward runs embeddings → blocks → final norm (``model.model``).
    blocks: the decoder blocks; blocks_name: their dotted name in the full model ("model.layers").
    linears: per block, the dotted names (relative to the block) of its nn.Linear modules, in module order.
    base_name: the dotted name of `base` in the full model ("model", "model.language_model"; "" when
    the model is its own base). outside: the dotted names of the modules with parameters outside `base`
    other than the output head ("model.vision_tower", "model.multi_modal_projector"): left dense.
    """

    model_type: str
    base: nn.Module
    blocks: nn.ModuleList
    blocks_name: str
    linears: tuple[tuple[str, ...], ...]
    base_name: str = ""
    outside: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.blocks)

    def full_name(self, index: int, local: str) -> str:
        """The module name in the full model: full_name(3, "mlp.down_proj") → "model.layers.3.mlp.down_proj"."""
        return f"{self.blocks_name}.{index}.{local}"

    def block_linears(self, index: int, block: nn.Module | None = None) -> dict[str, nn.Linear]:
        """The nn.Linear modules of block `index` by dotted name relative to the block.

        block: a module shaped like block `index` to take them from (e.g. a copy of it); default the block itself.
        """
        source = self.blocks[index] if block is None else block
        found: dict[str, nn.Linear] = {}
        for name in self.linears[index]:
            module = source.get_submodule(name)
            if not isinstance(module, nn.Linear):  # the module tree changed since discovery
                raise IncompatibleModelError(
                    f"{self.full_name(index, name)} is {type(module).__name__}, not nn.Linear; rediscover the structure"
                )
            found[name] = module
        return found


def _outermost(lists: list[tuple[str, nn.ModuleList]]) -> list[tuple[str, nn.ModuleList]]:
    """The lists (in module order, outer before inner) not inside another of them."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in lists:
        # A list inside another candidate (e.g. the experts of an MoE block) is part of a block, not the blocks.
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        found.append((name, module))
    return found


def _token_embedding(model: nn.Module) -> nn.Module | None:
    """transformers' ``get_input_embeddings()`` (the module mapping token ids to hidden states), or None
    for a model without one (plain nn.Module, or transformers' NotImplementedError)."""
    getter = getattr(model, "get_input_embeddings", None)
    if getter is None:
        return None
    try:
        embedding = getter()
    except NotImplementedError:
        return None
    return embedding if isinstance(embedding, nn.Module) else None


def _common_ancestor(a: str, b: str) -> str:
    """The dotted name of the innermost module holding both `a` and `b` ("" for the model itself)."""
    shared: list[str] = []
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        shared.append(x)
    return ".".join(shared)


def _depth(name: str) -> int:
    return len(name.split(".")) if name else 0


def _language_model(model: nn.Module) -> tuple[str, nn.Module, str, nn.ModuleList]:
    """(name of the language model, the language model, full name of the block list, the block list).

    See the module docstring for the order of preference; names are dotted names in `model`.
    """
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module):
        base = model
    names = {id(module): name for name, module in model.named_modules()}
    base_name = names[id(base)]
    embedding = _token_embedding(model)
    embedding_name = names.get(id(embedding)) if embedding is not None else None
    lists = [
        (names[id(module)], module)
        for module in base.modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0
    ]
    if embedding_name is not None:  # lists inside the embedding module are its parts
        lists = [(name, module) for name, module in lists if not name.startswith(f"{embedding_name}.")]
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    named = _outermost([(n, m) for n, m in lists if any(type(entry).__name__ in no_split for entry in m)])
    # _no_split_modules may name no block of this model: then every outermost list is a candidate.
    pool = named or _outermost(lists)
    if not pool:
        raise IncompatibleModelError(
            f"no decoder block list (nn.ModuleList of repeated blocks) found in {type(model).__name__}; "
            "tsenor prunes decoder LMs whose blocks sit in one nn.ModuleList"
        )
    if embedding_name is None:
        blocks_name, blocks = max(pool, key=lambda item: len(item[1]))
        return base_name, base, blocks_name, blocks
    # The text decoder's blocks share the deepest ancestor with the token embedding: a vision tower's
    # encoder layers only meet it at the multimodal model's top.
    blocks_name, blocks = max(pool, key=lambda item: (_depth(_common_ancestor(item[0], embedding_name)), len(item[1])))
    language_name = _common_ancestor(blocks_name, embedding_name)
    return language_name, model.get_submodule(language_name), blocks_name, blocks


def _outside(model: nn.Module, base_name: str) -> tuple[str, ...]:
    """The modules with parameters beside the path from `model` down to its language model `base_name`,
    other than the output head (``get_output_embeddings()``, e.g. a tied lm_head): a multimodal model's
    vision tower and projector."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if getter is not None else None
    found: list[str] = []
    parts = base_name.split(".") if base_name else []
    for depth in range(len(parts)):
        parent = ".".join(parts[:depth])
        for child, module in model.get_submodule(parent).named_children():
            name = f"{parent}.{child}" if parent else child
            if child == parts[depth] or module is head or next(module.parameters(), None) is None:
                continue
            found.append(name)
    return tuple(found)


def discover_structure(model: nn.Module) -> ModelStructure:
    """The decoder structure of `model` (works on the meta device: nothing is run).

    Raises IncompatibleModelError, one line naming what was not found, when there is no block list or
    its blocks hold no parameter of two or more dimensions.
    """
    base_name, base, blocks_name, blocks = _language_model(model)
    linears = tuple(
        tuple(name for name, module in block.named_modules() if isinstance(module, nn.Linear)) for block in blocks
    )
    # Weight matrices need not be nn.Linear (GPT-2's Conv1D, fused expert stacks): which parameters are
    # matmul weights is seen by watching the forward (pruning/block/observe.py), so only blocks without any
    # parameter of two or more dimensions have nothing to prune.
    if not any(p.dim() >= 2 for block in blocks for p in block.parameters()):
        raise IncompatibleModelError(
            f"no weight matrix found in the {type(blocks[0]).__name__} blocks of {type(model).__name__} "
            f"({blocks_name}); tsenor prunes the matrices the blocks multiply by"
        )
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", None) or type(model).__name__)
    return ModelStructure(model_type, base, blocks, blocks_name, linears, base_name, _outside(model, base_name))

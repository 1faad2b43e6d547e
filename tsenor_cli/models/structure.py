"""Where the decoder blocks and their prunable linears are, found from the module tree (any architecture).

The engine (paper Section 4, layer-wise reconstruction as in SparseGPT/Wanda/ALPS) runs the decoder
blocks one at a time. All it needs from the model's structure is found generically:

- the base model: transformers' ``model.base_model`` (``model.model`` for the *ForCausalLM classes);
- the block list: the ``nn.ModuleList`` under the base model whose entries are all of one class named
  in ``model._no_split_modules`` (transformers' name for "the repeated block"); without such a list,
  the largest outermost ``nn.ModuleList`` of modules of one class;
- the prunable linears of a block: every ``nn.Linear`` inside it, fused ones (Phi-3's ``qkv_proj``,
  ``gate_up_proj``) included.

``config.model_type`` is kept only as information: nothing here switches on it. What a block is given
by the model's forward, and which linears read the same input, are observed by running the model
(`tsenor_cli.pruning.engine`), not written down per architecture.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tsenor_cli.errors import IncompatibleModelError


@dataclass(frozen=True, eq=False)
class ModelStructure:
    """The decoder stack of a causal LM.

    base: the module whose forward runs embeddings → blocks → final norm (``model.model``).
    blocks: the decoder blocks; blocks_name: their dotted name in the full model ("model.layers").
    linears: per block, the dotted names (relative to the block) of its nn.Linear modules, in module order.
    """

    model_type: str
    base: nn.Module
    blocks: nn.ModuleList
    blocks_name: str
    linears: tuple[tuple[str, ...], ...]

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


def _uniform_lists(base: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Non-empty ModuleLists under `base` whose entries share one class, outermost first, names relative to base."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in base.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(entry) for entry in module}) != 1:
            continue
        # A list inside another candidate (e.g. the experts of an MoE block) is part of a block, not the blocks.
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        found.append((name, module))
    return found


def _block_list(model: nn.Module, base: nn.Module) -> tuple[str, nn.ModuleList]:
    candidates = _uniform_lists(base)
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    named = [(name, blocks) for name, blocks in candidates if type(blocks[0]).__name__ in no_split]
    # _no_split_modules may only name other towers' blocks (vision encoders): then fall back on size.
    pool = named or candidates
    if not pool:
        raise IncompatibleModelError(
            f"no decoder block list (nn.ModuleList of repeated blocks) found in {type(model).__name__}; "
            "tsenor prunes decoder LMs whose blocks sit in one nn.ModuleList"
        )
    return max(pool, key=lambda item: len(item[1]))


def discover_structure(model: nn.Module) -> ModelStructure:
    """The decoder structure of `model` (works on the meta device: nothing is run).

    Raises IncompatibleModelError, one line naming what was not found, when there is no block list or
    its blocks hold no nn.Linear.
    """
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module):
        base = model
    relative, blocks = _block_list(model, base)
    base_name = next(name for name, module in model.named_modules() if module is base)
    blocks_name = f"{base_name}.{relative}" if base_name else relative
    linears = tuple(
        tuple(name for name, module in block.named_modules() if isinstance(module, nn.Linear)) for block in blocks
    )
    if not any(linears):
        raise IncompatibleModelError(
            f"no nn.Linear found in the {type(blocks[0]).__name__} blocks of {type(model).__name__} "
            f"({blocks_name}); tsenor prunes nn.Linear weights only"
        )
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", None) or type(model).__name__)
    return ModelStructure(model_type, base, blocks, blocks_name, linears)

"""The settings of a pruning run, each declared once: `PRUNE_FIELDS` (and each method's options,
`option_fields`), from which come the recipe keys (`RECIPE_KEYS`, `RECIPE_DEFAULTS`), the CLI flags
(`cli/options.with_fields`) and the defaults and checks of `PruneConfig`.

Each method's options are fields too (`option_fields`: `--alps-rho0`, recipe key `alps_rho0`), from the
options class its `PrunerSpec` declares (`pruning/methods/method.py`): those of the built-in and installed
methods in `ALL_FIELDS`, those of a method named `package.module:NAME` added for the recipe naming it
(`fields_for`). No torch here (`tsenor --help`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tsenor_cli.errors import UsageError
from tsenor_cli.fields import Field, by_name
from tsenor_cli.pruning.methods.method import DEFAULT_SOLVER, option_kinds
from tsenor_cli.pruning.methods.registry import all_methods, get_pruner, is_reference, method_names

if TYPE_CHECKING:
    from tsenor_cli.pruning.methods.method import PrunerSpec

EXAMPLE_RECIPE = "configs/smollm2-alps-16x32.yaml"


# The transposable mask solvers, in the order the solver registry lists them (`solver.METHODS`, which
# `tests/test_cli_options.py` compares with this). Written out so that `tsenor prune --help` imports no
# torch: listing them from the registry imported every solver module (2.5 s of the help's 2.7 s).
SOLVER_NAMES = (
    "auto",
    "two_approx",
    "bi_nm",
    "max_random",
    "exact",
    "exhaustive",
    "flow",
    "tsenor-reference",
    "tsenor",
)


def _solvers() -> tuple[str, ...]:
    return SOLVER_NAMES


def _check_dtype(value: str) -> None:
    """auto or a dtype name `models.loading.parse_dtype` reads (fp32, bf16, fp16, or float32 … as torch spells them)."""
    from tsenor_cli.models.loading import parse_dtype

    parse_dtype(value)


def _check_shard_size(value: str) -> None:
    from tsenor_cli.models.saving import parse_size

    parse_size(value)


def _check_finite(value: float) -> None:
    if not math.isfinite(value):
        raise UsageError(f"--loss-aware {value} must be a finite number >= 0; pass e.g. 1")


def _check_fraction(value: float) -> None:
    if not 0 < value <= 1:
        raise UsageError(f"--loss-aware-fraction {value} must be in (0, 1]; pass e.g. 0.25 (1: every sample)")


def _check_method(value: str) -> None:
    get_pruner(value)  # an unknown or broken method is one line


def _check_patterns(option: str) -> Any:
    def check(value: Sequence[str]) -> None:
        from tsenor_cli.pruning.settings.selection import check_patterns

        check_patterns(tuple(value), option)

    return check


MODEL, PATTERN, DATA, SELECT, OUT, MEMORY, REFINE, DISTILL, MOE = (
    "Model",
    "Pattern and method",
    "Calibration",
    "Which weights",
    "Output",
    "Memory",
    "Refinement (--refine block)",
    "Distillation (--distill-steps)",
    "Mixture of experts",
)
# Every setting of a pruning run; anything else in a recipe is refused.
PRUNE_FIELDS: tuple[Field, ...] = (
    Field("model", str, None, "Embedded name (smollm2-135m), checkpoint folder or hub id (here or in --config).",
          MODEL, positional=True, aliases=("--model",), metavar="MODEL"),
    Field("dtype", str, "auto", "Weights' dtype: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16.", MODEL,
          metavar="<auto|fp32|bf16|fp16>", check=_check_dtype),
    Field("device", str, "cpu", "Compute device: cpu, cuda or cuda:N.", MODEL,
          metavar="[cpu|cuda|cuda:N]", result=False),
    Field("trust_remote_code", bool, False, "Allow the checkpoint's own model code (off by default).", MODEL,
          result=False),
    Field("nm", str, None, "N:M pattern, e.g. 16:32 (transposable unless --no-transposable).", PATTERN,
          metavar="N:M"),
    Field("sparsity", float, None, "Unstructured sparsity instead of N:M, e.g. 0.5.", PATTERN),
    Field("transposable", bool, True, "Transposable N:M tiles.", PATTERN, negation="--no-transposable"),
    Field("method", str, "alps", "Pruning method: a name, or package.module:NAME for a method declared outside "
          "tsenor (docs/architecture.md).", PATTERN, metavar="<" + "|".join((*method_names(), "MODULE:NAME")) + ">",
          check=_check_method),
    Field("solver", str, DEFAULT_SOLVER,
          "Transposable mask solver (auto: exact flow on CPU and for few tiles on CUDA, tsenor on CUDA).", PATTERN,
          choices=_solvers),
    Field("loss_aware", float, 0.0, "Weight λ of the language-model loss's curvature in each layer's objective: "
          "output row i's reconstruction error counts (1 + λ·g_i/mean g), g_i the dense model's squared loss "
          "gradient at that output on the calibration data (one forward and backward pass before pruning; "
          "docs/design/loss-aware.md). 0: the reconstruction alone.", PATTERN, minimum=0.0, check=_check_finite),
    Field("loss_aware_fraction", float, 1.0, "Share of the calibration sequences the --loss-aware pass reads: "
          "the first ⌈f·nsamples⌉ (1: all). The pass's time scales with it; at 1 it costs about one plain ALPS "
          "prune (docs/design/loss-aware.md).", PATTERN, positive=True, check=_check_fraction),
    Field("calib_data", str, "c4", "Calibration text: c4, wikitext2, ptb or a text/jsonl file.", DATA,
          flag="--data", aliases=("--calib-data",)),
    Field("nsamples", int, 128, "Calibration sequences.", DATA, minimum=1),
    Field("seqlen", int, 2048, "Calibration sequence length (capped by the model).", DATA, minimum=1),
    Field("seed", int, 0, "Seed of the calibration sampling.", DATA),
    Field("sequential", bool, True, "Prune the linears that read the same input together, group after group "
          "(LLaMA: (q,k,v), (o), (gate,up), (down)), re-running the block between groups.", DATA,
          negation="--no-sequential"),
    Field("ignore", list, (), "Leave matching linears dense (repeatable): glob on full names ('*.mlp.down_proj') "
          "or 're:REGEX'.", SELECT, metavar="<pattern>", check=_check_patterns("--ignore")),
    Field("targets", list, (), "Prune only matching linears (repeatable): glob on full names or 're:REGEX'.",
          SELECT, metavar="<pattern>", check=_check_patterns("--targets")),
    Field("skip_incompatible", bool, False, "Leave layers M does not divide dense.", SELECT),
    Field("output", str, None, "Output folder; what tsenor wrote there before is replaced only with --force.",
          OUT, flag="--output", short="-o", metavar="<path>", result=False),
    Field("max_shard_size", str, "2GB", "Largest safetensors shard of the output, e.g. 2GB, 500MB.", OUT,
          result=False, check=_check_shard_size),
    Field("save_format", str, "dense", "Checkpoint format: dense (loads anywhere) or packed (the pruned matrices' "
          "kept values and their positions: about 0.56x their bf16 bytes; loads with transformers once tsenor_cli "
          "is imported; docs/reference/packed-format.md).", OUT, choices=("dense", "packed"), result=False),
    Field("stream", bool, True, "Read each decoder block from the safetensors checkpoint when it is pruned and "
          "write the output from the pruned blocks' files: host memory of one block, not one model (same output, "
          "bit for bit); --no-stream loads the whole model.", MEMORY, negation="--no-stream", result=False),
    Field("offload_activations", bool, False, "Keep the calibration activations on the CPU and move one sample "
          "at a time to the device (same result, device memory for one block and one sample).", MEMORY,
          result=False),
    Field("refine", str, "none", "After each block is pruned: none or block. 'block' trains the block's remaining "
          "weights (the mask fixed) so that its output matches the dense block's on the calibration samples.",
          REFINE, choices=("none", "block")),
    # RefineConfig (pruning/block/refine.py) checks the mode, epochs and learning rate when the config is built.
    Field("refine_epochs", int, 2, "Passes over the calibration samples per block.", REFINE),
    Field("refine_lr", float, 1e-3, "Adam's learning rate.", REFINE),
    Field("refine_mask_every", int, 0, "Re-solve the pruned matrices' masks every this many Adam steps from "
          "dense shadows of the weights (0: the mask fixed); N:M patterns.", REFINE),
    Field("refine_regions", str, "block", "What each training stage matches: block (the block's output) or "
          "sub-blocks (each region of the block in turn, e.g. attention then MLP, against the dense model's "
          "residual stream after it; only that region's weights train).", REFINE, choices=("block", "sub-blocks")),
    Field("refine_samples_per_step", int, 4, "Calibration samples per Adam step (a step's gradient is their sum; "
          "fewer samples, more steps for the same forward and backward work).", REFINE),
    Field("refine_schedule", str, "constant", "Learning rate over each training stage's steps: constant, or "
          "cosine (from --refine-lr along a half cosine towards 0 over the stage's steps).", REFINE,
          choices=("constant", "cosine")),
    Field("refine_dtype", str, "fp32", "Compute dtype of the refinement's forwards and backwards: fp32, or bf16 "
          "autocast (the weights, Adam and the kept-or-not errors stay fp32; 1.8x faster a block on a CPU with "
          "bf16 units, 9-12x slower on an AVX2 one without them).", REFINE, choices=("fp32", "bf16")),
    # The whole-model stage after the blocks (`tsenor_cli/compress.py`): `tsenor finetune --teacher MODEL` of the
    # pruned checkpoint on windows of the calibration text, in the same command. Its defaults are the measured
    # ones of the quality recipes (docs/results.md, "Twenty-second session": lr 3e-4, 2 warm-up steps, 4 windows).
    Field("distill_steps", int, 0, "After pruning, distil the whole pruned model from the dense one (MODEL) for this "
          "many optimizer steps, its masks fixed, on windows of --seqlen tokens of the calibration text (--data, "
          "--seed); the output is the distilled model. 0: off.", DISTILL, minimum=0),
    Field("distill_lr", float, 3e-4, "Peak learning rate of the distillation (AdamW, linear decay to 0).", DISTILL,
          positive=True),
    Field("distill_warmup", int, 2, "Linear warm-up steps of the distillation.", DISTILL, minimum=0),
    Field("distill_batch_size", int, 4, "Windows per distillation step.", DISTILL, minimum=1),
    Field("distill_dtype", str, "fp32", "Compute dtype of the distillation: fp32, or bf16 autocast (weights and "
          "AdamW stay fp32).", DISTILL, choices=("fp32", "bf16")),
    Field("distill_freeze_embeddings", bool, False, "Keep the input embeddings and the output layer fixed while "
          "distilling.", DISTILL),
    Field("distill_save_every", int, 50, "Save the distillation's state every K steps, for a rerun after a kill to "
          "continue it (0: never; the rerun then distils again from the pruned checkpoint).", DISTILL, minimum=0,
          result=False),
    Field("moe_calibration", str, "routed", "Statistics of expert matrices: 'routed' (the tokens the router "
          "sends each expert) or 'all' (every calibration token through every expert, for the statistics only).",
          MOE, choices=("routed", "all")),
    Field("moe_min_tokens", int, None, "With routed statistics, an expert that received fewer tokens takes "
          "every-token statistics (default: its input dimension); the report names each such expert.", MOE,
          minimum=1),
)  # fmt: skip


def option_fields(spec: PrunerSpec) -> tuple[Field, ...]:
    """A method's options as settings named `METHOD_OPTION` (`--alps-rho0`, `alps_rho0`; a bool's off flag
    `--no-METHOD-OPTION`), from its options class: their kinds, help lines, least values and choices.
    Unset (None) they take the method's defaults."""
    kinds = option_kinds(spec.options)
    found: list[Field] = []
    for item in dataclasses.fields(spec.options):
        name = f"{spec.name}_{item.name}"
        found.append(
            Field(
                name,
                kinds[item.name],
                None,
                f"{item.metadata['help']} Default {item.default}; with --method {spec.name} only.",
                f"{spec.name} options",
                negation="--no-" + name.replace("_", "-") if kinds[item.name] is bool else None,
                choices=item.metadata.get("choices"),
                minimum=item.metadata.get("minimum"),
            )
        )
    return tuple(found)


def method_fields() -> tuple[Field, ...]:
    """The options of every built-in and installed method, as settings (`option_fields`)."""
    return tuple(field for spec in all_methods() for field in option_fields(spec))


METHOD_FIELDS: tuple[Field, ...] = method_fields()
ALL_FIELDS: tuple[Field, ...] = PRUNE_FIELDS + METHOD_FIELDS
FIELDS: dict[str, Field] = by_name(ALL_FIELDS)
# Every recipe key and the type of its value, and the value of each key a recipe leaves unset (None: no
# default; model and one of nm/sparsity are required; a method option unset takes the method's default).
RECIPE_KEYS: dict[str, type] = {f.name: f.kind for f in ALL_FIELDS}
RECIPE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in ALL_FIELDS}
# The settings RefineConfig checks; every one after the mode is read only with --refine block.
REFINE_KEYS: tuple[str, ...] = (
    "refine",
    "refine_epochs",
    "refine_lr",
    "refine_mask_every",
    "refine_regions",
    "refine_samples_per_step",
    "refine_schedule",
    "refine_dtype",
)
# The settings DistillConfig holds; every one after the steps is read only with --distill-steps N > 0.
DISTILL_KEYS: tuple[str, ...] = (
    "distill_steps",
    "distill_lr",
    "distill_warmup",
    "distill_batch_size",
    "distill_dtype",
    "distill_freeze_embeddings",
    "distill_save_every",
)


def fields_for(method: object) -> dict[str, Field]:
    """The settings of a recipe whose method is `method`: `FIELDS`, with the options of a method named
    `package.module:NAME` (loaded here: an unknown or broken one is one UsageError line)."""
    if not isinstance(method, str) or not is_reference(method):
        return FIELDS
    return FIELDS | by_name(option_fields(get_pruner(method)))

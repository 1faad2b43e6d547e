"""Routed vs all-token expert statistics on one mixture-of-experts block (docs/design/engine.md quotes it).

Usage: .venv/bin/python scripts/moe_calibration_study.py [--experts 8] [--top-k 2] [--nsamples 16]
Builds a one-block Mixtral with seeded random weights (hidden 64, the given experts, top-k), the embedded
SmolLM2 tokenizer, prunes it to transposable 2:4 with magnitude, and with SparseGPT and ALPS under
`--moe-calibration routed` and `all`, on the offline C4 calibration sample (`TSENOR_DATA_DIR`), then
measures each pruned block's error on what the block adds to its input, ‖Ŷ − Y‖² / ‖Y − X‖² (X the
embeddings, Y the dense block's output), on WikiText-2 text the calibration did not see (8 windows of
128 tokens). Random weights route by the
hidden state, so the experts do see different tokens; what real experts see differs more.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from tsenor_cli.data.sources import encode, wikitext2_text
from tsenor_cli.models.embedded import materialize
from tsenor_cli.pruning.methods.types import MatrixPruneConfig, SparsityPattern
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.settings import RunContext

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build(path: Path, experts: int, top_k: int, ctx: RunContext) -> Path:
    """A one-block random Mixtral saved to `path` with the SmolLM2 tokenizer files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = materialize("smollm2-135m", ctx.cache_dir)
    config = AutoConfig.for_model(
        "mixtral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        vocab_size=int(AutoConfig.from_pretrained(source).vocab_size),
        tie_word_embeddings=True,
        dtype="float32",
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, path / name)
    return path


@torch.no_grad()
def block_io(path: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: (B, T) → (the block's input, its output), both (B, T, H), before the final norm."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    states = model(ids, output_hidden_states=True).hidden_states
    return states[0], states[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=128)
    args = parser.parse_args()
    ctx = RunContext.from_environment()
    work = Path(tempfile.mkdtemp(prefix="moe-study-"))
    try:
        source = build(work / "dense", args.experts, args.top_k, ctx)
        from transformers import AutoTokenizer

        text = "\n\n".join(wikitext2_text("test", ctx).rows[:400])
        ids = encode(AutoTokenizer.from_pretrained(source), text).reshape(-1)[: 8 * 128].reshape(8, 128)
        embedded, dense = block_io(source, ids)
        update = (dense - embedded).square().sum()
        rows = []
        runs = [("magnitude", "routed")] + [(m, c) for m in ("sparsegpt", "alps") for c in ("routed", "all")]
        for method, calibration in runs:
            out = work / f"{method}-{calibration}"
            cfg = PruneConfig(
                model=str(source),
                matrix=MatrixPruneConfig(pattern=SparsityPattern.from_nm(2, 4, transposable=True)),
                method=method,
                nsamples=args.nsamples,
                seqlen=args.seqlen,
                moe_calibration=calibration,
                output=out,
            )
            prune_model(cfg, ctx)
            _, pruned = block_io(out, ids)
            error = float((pruned - dense).square().sum() / update)
            rows.append(f"| {method} | {calibration if method != 'magnitude' else '-'} | {error:.4f} |")
        print(f"One-block Mixtral, {args.experts} experts top-{args.top_k}, T2:4, {args.nsamples}×{args.seqlen} C4")
        print("| method | --moe-calibration | error on the block's update (WikiText-2) |")
        print("| --- | --- | ---: |")
        print("\n".join(rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

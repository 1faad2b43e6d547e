"""How much slower half-precision products run than float32 on this machine's CPU (`tsenor_cli/precision.py`).

Usage: .venv/bin/python scripts/bf16_products.py [--repeats 3]
Two measurements, each variant interleaved with float32 (fp32, half, fp32, half) so that a busy machine
slows both alike: a (2048 × 576)·(576 × 1536) product (SmolLM2-135M's MLP on 2048 tokens) in float32,
bf16 and fp16; and one refinement step of a SmolLM2-135M-shaped block (random weights, transformers'
LlamaDecoderLayer): the forward and backward of 4 samples of 512 tokens, in float32 and under bf16 autocast,
as `--refine-dtype bf16` runs it. Prints the seconds, the ratios, the thread count and what `precision.py`
reads of the CPU.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tsenor_cli.precision import native_products


def seconds(call: Callable[[], object], repeats: int) -> float:
    """The mean seconds of `call` over `repeats` calls, after one untimed call."""
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def product(dtype: torch.dtype) -> Callable[[], object]:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(2048, 576, generator=generator).to(dtype)
    b = torch.randn(576, 1536, generator=generator).to(dtype)
    return lambda: a @ b


def refine_step(bf16: bool) -> Callable[[], object]:
    """One refinement step: 4 samples of 512 tokens, forward and backward, as `pruning/block/refine.py` runs
    them (one sample a forward), under bf16 autocast or not."""
    config = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, 0)
    x = torch.randn(1, 512, 576)
    positions = torch.arange(512)[None]
    embeddings = LlamaRotaryEmbedding(config)(x, positions)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for _ in range(4):
                out = layer(x, position_ids=positions, position_embeddings=embeddings)
                out = out[0] if isinstance(out, tuple) else out
                out.float().pow(2).mean().backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    print(f"threads {torch.get_num_threads()}; bf16 products native: {native_products(cpu, torch.bfloat16)}, "
          f"fp16: {native_products(cpu, torch.float16)}")  # fmt: skip
    for half in (torch.bfloat16, torch.float16):
        times: dict[torch.dtype, list[float]] = {torch.float32: [], half: []}
        for _ in range(2):
            for dtype in times:
                times[dtype].append(seconds(product(dtype), args.repeats))
        fp32, low = min(times[torch.float32]), min(times[half])
        print(f"product 2048x576 @ 576x1536: fp32 {fp32 * 1e3:.1f} ms, {half} {low * 1e3:.1f} ms ({low / fp32:.1f}x)")
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(2):
        for bf16 in runs:
            runs[bf16].append(seconds(refine_step(bf16), args.repeats))
    steps = {bf16: min(values) for bf16, values in runs.items()}
    print(f"refinement step (4 x 512 tokens, one SmolLM2 block): fp32 {steps[False]:.2f} s, "
          f"bf16 autocast {steps[True]:.2f} s ({steps[True] / steps[False]:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()

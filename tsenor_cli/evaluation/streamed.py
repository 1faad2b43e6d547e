"""Perplexity block by block: one decoder block resident on the device, read from the checkpoint when its turn comes.

``tsenor eval --stream`` (the SparseGPT reference evaluates perplexity layer by layer the same way). The
model is loaded with its blocks on the meta device (`models/streaming.py`); then, for one dataset's
windows (W, T):

1. block 0 is read, and the capture (`replay.capture_block_inputs`, as pruning captures) runs the model's own
   forward up to block 0 on each window: the hidden states (W, T, H) entering the blocks, and what the
   forward passes each block besides them (masks, rotary embeddings: the same for every window of T tokens);
2. each block in turn is read onto the device, replayed on every window (`run_block`, one window at a
   time, as pruning replays it; `replay.BlockSource`, streamed) and released;
3. the model's own forward runs once more per window with every block's forward swapped for a stand-in
   that returns the replayed output, so the final norm, the output head and anything the model does after
   its blocks (logit scaling, soft-capping) are its own code, found by running it, never by name; the loss
   is `window_nll`'s.

Host memory: what lies outside the blocks (embeddings, head), one block, the windows' hidden states
(W·T·H values on the device) and one window's logits; the number of blocks does not enter. Each block is
read once per dataset. The result equals the whole-model evaluation (same windows) to float rounding:
`tests/test_streamed_eval.py` checks 1e-5 relative in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tsenor_cli.evaluation.perplexity import PerplexityResult, Windows, cut_windows, result_of, window_nll
from tsenor_cli.models.loading import LoadedModel
from tsenor_cli.models.structure import ModelStructure
from tsenor_cli.replay import BlockCall, BlockSource, capture_block_inputs, forwards_replaced, run_block
from tsenor_cli.replay.calls import output_like


@contextlib.contextmanager
def _blocks_returning(
    structure: ModelStructure, template: Any, first: int, hidden: list[torch.Tensor]
) -> Iterator[None]:
    """Swap every block's forward for a stand-in that computes nothing: block `first` (the first the
    forward runs) returns hidden[0], the (1, T, H) output of the last block for the current window; every
    other block returns its input. template: a real block output, whose type the model's loop expects."""

    def stand_in(index: int, _real: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            given, _ = BlockCall.split(args, kwargs)
            return output_like(template, hidden[0] if index == first else given)

        return forward

    with forwards_replaced(structure.blocks, stand_in):
        yield


@dataclass(frozen=True)
class BlockCallbacks:
    """What `streamed_perplexity` calls around each block: prepare(index, block) once it is read, before it
    runs (its sparse kernels, `kernels/sparse.py`); done(blocks done, blocks) after it ran and was released."""

    prepare: Callable[[int, nn.Module], None] | None = None
    done: Callable[[int, int], None] | None = None


@torch.no_grad()
def streamed_perplexity(
    loaded: LoadedModel,
    input_ids: torch.Tensor,
    windows: Windows,
    *,
    device: torch.device,
    progress: Callable[[int, int], None] | None = None,
    blocks: BlockCallbacks | None = None,
) -> PerplexityResult:
    """`perplexity` of a model loaded with ``stream=True``, block by block (module docstring).

    input_ids: (1, T) long; `windows` as `perplexity` cuts them (all of them go through each block at once,
    so `windows.batch_size` changes nothing). progress(done, total) once every window is done (they all finish
    together); `blocks`: what is called around each block.
    """
    checkpoint, structure = loaded.checkpoint, loaded.structure
    if checkpoint is None:
        raise ValueError("streamed_perplexity needs a model loaded with stream=True")
    prepare, blocks_progress = (None, None) if blocks is None else (blocks.prepare, blocks.done)
    cut = cut_windows(input_ids, windows).to(device)  # (W, T)
    count = len(structure.blocks)
    source = BlockSource(structure, device, checkpoint=checkpoint)
    first_block = source.load(0)  # the capture runs block 0 once to learn its output type
    if prepare is not None:
        prepare(0, first_block)
    inputs = capture_block_inputs(structure, cut, device)
    hidden = inputs.hidden  # (W, T, H): each block's output overwrites its input, window by window
    template: list[Any] = []
    for index, call in enumerate(inputs.calls):
        block = first_block if index == 0 else source.load(index)
        if prepare is not None and index > 0:
            prepare(index, block)
        if not call.idle and not template:
            args, kwargs = call.bind(hidden[:1])
            template.append(block(*args, **kwargs))
        run_block(block, hidden, call, hidden)
        source.release(index)
        if blocks_progress is not None:
            blocks_progress(index + 1, count)
    first = next(index for index, call in enumerate(inputs.calls) if not call.idle)
    current: list[torch.Tensor] = []
    nll = torch.zeros(cut.shape[0], dtype=torch.float64)
    with _blocks_returning(structure, template[0], first, current):
        for j in range(cut.shape[0]):
            current[:] = [hidden[j : j + 1]]
            nll[j] = window_nll(loaded.model, cut[j : j + 1])[0].cpu()
    if progress is not None:
        progress(int(cut.shape[0]), int(cut.shape[0]))
    return result_of(nll, windows.seqlen)

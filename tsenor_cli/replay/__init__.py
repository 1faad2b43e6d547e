"""Block replay: a model's decoder blocks run one at a time outside the model's own forward.

`calls.py` captures what the model's forward passes each block (`BlockCall`, `capture_block_calls`,
`capture_block_inputs`); `run.py` replays a block on hidden states (`block_output`, `run_block`);
`watch.py` runs blocks under observation (hooks, the forward watch); `source.py` says where each
block's weights come from (`BlockSource`: resident, offloaded, streamed from the checkpoint).
Pruning, the streamed evaluation and refinement all build on it; it imports none of them.
"""

from tsenor_cli.replay.calls import BlockCall, BlockInputs, call_difference, capture_block_calls, capture_block_inputs
from tsenor_cli.replay.run import block_output, forwards_replaced, input_key, run_block
from tsenor_cli.replay.source import BlockSource

__all__ = [
    "BlockCall",
    "BlockInputs",
    "BlockSource",
    "block_output",
    "call_difference",
    "capture_block_calls",
    "capture_block_inputs",
    "forwards_replaced",
    "input_key",
    "run_block",
]

"""The built-in methods' options, named where callers have imported them from: each is declared in its
method's module (`sparsegpt.SparseGPTOptions`, `alps.ALPSOptions`) on the base of `pruning/methods/method.py`."""

from __future__ import annotations

from tsenor_cli.pruning.methods.alps import ALPSOptions as ALPSOptions
from tsenor_cli.pruning.methods.method import MethodOptions as MethodOptions
from tsenor_cli.pruning.methods.sparsegpt import SparseGPTOptions as SparseGPTOptions

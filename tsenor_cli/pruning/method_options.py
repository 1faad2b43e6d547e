"""The built-in methods' options, named where callers have imported them from: each is declared in its
method's module (`sparsegpt.SparseGPTOptions`, `alps.ALPSOptions`) on the base of `pruning/method.py`."""

from __future__ import annotations

from tsenor_cli.pruning.alps import ALPSOptions as ALPSOptions
from tsenor_cli.pruning.method import MethodOptions as MethodOptions
from tsenor_cli.pruning.sparsegpt import SparseGPTOptions as SparseGPTOptions

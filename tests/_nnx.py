"""The NNX reference the NNX Stack is compared with: a Python loop over separately held
blocks (``Stack.to_layers()``' blocks, or blocks built one by one)."""

from __future__ import annotations

from flax import nnx


class Loop(nnx.Module):
    """``blocks`` called in order on ``x`` (last first with ``reverse``)."""

    def __init__(self, blocks, reverse=False):
        self.blocks = nnx.List(blocks)
        self.reverse = reverse

    def __call__(self, x):
        for block in reversed(self.blocks) if self.reverse else self.blocks:
            x = block(x)
        return x

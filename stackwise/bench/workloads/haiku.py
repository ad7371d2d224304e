"""The transformer block in Haiku: a Python loop, ``hk.layer_stack`` and ``stackwise.haiku.Stack``.

Imported only when the transformer block's rows are asked for (it imports haiku).
"""

from __future__ import annotations

import functools

import haiku as hk
import jax

from stackwise.bench.config import BenchConfig
from stackwise.bench.workloads.common import (
    Case,
    attend,
    framework_cases,
    initialised,
    python_loop,
    stack_remat,
    tool_policy,
)


class Block(hk.Module):
    """The transformer block as an ordinary Haiku module."""

    def __init__(self, d: int, hidden: int, heads: int, name: str | None = None):
        super().__init__(name=name)
        self.d, self.hidden, self.heads = d, hidden, heads

    def __call__(self, x):
        h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
        x = x + hk.Linear(self.d)(attend(hk.Linear(3 * self.d)(h), self.heads))
        h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
        return x + hk.Linear(self.d)(jax.nn.gelu(hk.Linear(self.hidden)(h)))


def transformer(cfg: BenchConfig, notes: list[str]) -> list[Case]:
    """Haiku's rows of the transformer block (see :func:`framework_cases`)."""
    block = functools.partial(Block, cfg.tf_d, cfg.tf_hidden, cfg.tf_heads)

    def model(forward):  # forward(n, x) -> y, run under hk.transform
        def build(n):
            net = hk.without_apply_rng(hk.transform(functools.partial(forward, n)))
            return initialised(net.init, net.apply, cfg)

        return build

    def layer_stack(remat, n, x):
        fn = lambda x: block()(x)  # noqa: E731
        if remat != "off":
            fn = hk.remat(fn, policy=tool_policy(remat))
        return hk.layer_stack(n)(fn)(x)

    def stack(sw, remat):
        return model(lambda n, x: sw.Stack(block, n=n, remat=stack_remat(remat))(x))

    return framework_cases(
        "haiku",
        loop=("hk loop", model(functools.partial(python_loop, block))),
        tools={
            "off": "hk.layer_stack", "dots": "hk.layer_stack+hk.remat(dots)",
            "layer": "hk.layer_stack+hk.remat",
        },
        tool=lambda remat: model(functools.partial(layer_stack, remat)),
        adapter="stackwise.haiku",
        stack=stack,
        notes=notes,
    )

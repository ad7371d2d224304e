"""What reaches a stacked NNX block from outside the layer, or grows inside it.

Two things a transformation such as qwix does to a block the Stack must carry, not drop:

- An ``nnx.Rngs`` set on the block from outside (qwix's ``qwix_rngs``, one object shared
  by every submodule): its streams have no layer axis. :func:`outside_streams` finds them;
  each draws one key per call (its count advancing once, as an ``nnx.Rngs`` argument's
  does), split into one key per layer (:func:`rekey` gives a layer its own, count 0).
- Variables a layer adds or replaces while it runs (qwix's LoRA params, PTQ's quantized
  kernels): :func:`grown` tells whether the block's graph changed, and the Stack then
  rebuilds its stacked block from the new graph and the stacked new variables.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import stackwise

__all__ = ["draw", "grown", "outside_filter", "outside_streams", "rekey"]


def outside_streams(block: nnx.Module) -> list[tuple]:
    """The paths of the block's RNG streams whose key has no layer axis (set from outside)."""
    return [
        path
        for path, node in nnx.iter_graph(block)
        if isinstance(node, nnx.RngStream) and jnp.ndim(node.key.get_raw_value()) == 0
    ]


def outside_filter(paths: list[tuple]) -> Any:
    """An ``nnx`` filter for the variables (key and count) of the streams at ``paths``."""
    wanted = set(paths)
    return lambda path, _: tuple(path[:-1]) in wanted


def _node(block: nnx.Module, path: tuple) -> Any:
    for key in path:
        block = block[key] if isinstance(key, int) else getattr(block, key)
    return block


def draw(block: nnx.Module, paths: list[tuple]) -> list:
    """One fresh key per stream (each count advances once), as per-layer keys."""
    return [stackwise.per_layer_keys(_node(block, path)()) for path in paths]


def rekey(block: nnx.Module, paths: list[tuple], keys: list[jax.Array]) -> None:
    """Gives the layer's copy of each outside stream the layer's own key, count 0."""
    for path, key in zip(paths, keys):
        stream = _node(block, path)
        stream.key.set_value(key)
        stream.count.set_value(jnp.zeros((), jnp.uint32))


def grown(before: Any, block: nnx.Module) -> Any:
    """The block's new graphdef if running it added, removed or retyped a variable (or
    changed a static attribute); None if its graph is as it was (values may differ)."""
    after = nnx.graphdef(block)
    return None if after == before else after

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
from stackwise import _kit

__all__ = [
    "draw",
    "grown",
    "join_rngs_args",
    "outside_filter",
    "outside_streams",
    "rekey",
    "split_rngs_args",
    "stream_keys",
]


def outside_streams(block: nnx.Module) -> list[tuple]:
    """The paths of the block's RNG streams whose key has no layer axis (set from outside;
    a served Stack's own streams hold a ``stackwise.Serving`` of per-layer keys)."""
    return [
        path
        for path, node in nnx.iter_graph(block)
        if isinstance(node, nnx.RngStream)
        and not _kit.serving.is_serving(key := node.key.get_raw_value())
        and jnp.ndim(key) == 0
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


# --------------------------------------------------------------------------
# RNG streams: an `nnx.Rngs` argument becomes n independent ones, one per layer.


@jax.tree_util.register_pytree_node_class
class _LayerRngs:
    """An ``nnx.Rngs`` argument of ``Stack.__call__``, as per-layer keys per stream."""

    def __init__(self, keys: dict[str, Any]):
        self.keys = keys

    def tree_flatten(self):
        return (self.keys,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def stream_keys(rngs: nnx.Rngs) -> dict[str, jax.Array]:
    """One fresh key per stream of ``rngs`` (each stream's count advances)."""
    return {name: stream() for name, stream in rngs.items()}


def split_rngs_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Replaces each ``nnx.Rngs`` in the arguments by per-layer keys for every stream."""
    is_rngs = lambda v: isinstance(v, nnx.Rngs)  # noqa: E731

    def split(v):
        if not is_rngs(v):
            return v
        return _LayerRngs({k: stackwise.per_layer_keys(key) for k, key in stream_keys(v).items()})

    return jax.tree.map(split, (args, kwargs), is_leaf=is_rngs)


def join_rngs_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    is_layer_rngs = lambda v: isinstance(v, _LayerRngs)  # noqa: E731
    return jax.tree.map(
        lambda v: nnx.Rngs(**v.keys) if is_layer_rngs(v) else v,
        (args, kwargs),
        is_leaf=is_layer_rngs,
    )

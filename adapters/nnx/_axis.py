"""The layer axis in sharding metadata: prepended to every stacked Variable's
``out_sharding`` (the metadata ``nnx.with_partitioning`` sets) outside the layers,
and removed inside them, where each Variable holds one layer."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

__all__ = ["add", "remove", "shard_eagerly"]


def _is_var(v: Any) -> bool:
    return isinstance(v, nnx.Variable)


def _variables(tree: Any) -> list[nnx.Variable]:
    return [v for v in jax.tree.leaves(tree, is_leaf=_is_var) if _is_var(v)]


def add(state: Any, axis_name: str | None) -> None:
    """Puts ``axis_name`` first in every Variable's ``out_sharding`` (in place)."""
    for v in _variables(state):
        sharding = v.get_metadata("out_sharding", None)
        if sharding:
            v.set_metadata(out_sharding=(axis_name, *sharding))


def remove(state: Any) -> None:
    """Drops the first axis of every Variable's ``out_sharding`` (in place)."""
    for v in _variables(state):
        sharding = v.get_metadata("out_sharding", None)
        if sharding:
            v.set_metadata(out_sharding=tuple(sharding)[1:])


def shard_eagerly(state: Any) -> Any:
    """Recreates variables with sharding metadata, so ``nnx.use_eager_sharding``
    places the stacked values by their stacked spec (as block creation does)."""

    def recreate(v):
        if _is_var(v) and v.get_metadata("out_sharding", None):
            if v.get_metadata("eager_sharding", False):
                return type(v)(v.get_raw_value(), **v.get_metadata())
        return v

    return jax.tree.map(recreate, state, is_leaf=_is_var)

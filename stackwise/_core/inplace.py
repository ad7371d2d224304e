"""Stacked per-layer state updated in place, as a Python loop of layers would.

A decoding layer writes a few positions of its own KV cache
(``lax.dynamic_update_slice(cache, new, pos)``) and reads it back. Had the
stack returned each layer's whole new cache slice, every token would write a
fresh copy of the whole stacked cache. Instead, :func:`call` runs the layer
from its jaxpr and notices which state leaves it returns as the input leaf
updated by ``dynamic_update_slice``: for those only the update and its start
indices leave the layer; :func:`apply_updates` writes them into the stacked
state after the scan, in place when the caller donates it. Every other state
leaf (BatchNorm statistics, counters, anything computed afresh) leaves the
layer whole, as a per-layer output. The block is written the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from stackwise._upstream import jax as jax_ties

__all__ = ["Update", "apply_updates", "call"]


class Update(NamedTuple):
    """How a layer produced one leaf of its returned state (static, per leaf).

    ``kind``: ``"new"`` (computed afresh: returned whole), ``"same"`` (the input
    leaf ``source`` unchanged) or ``"write"`` (the input leaf ``source`` with
    ``writes`` dynamic-update-slices applied in order).
    """

    kind: str
    source: int = -1
    writes: int = 0


def _evaluate(jaxpr: Any, consts: list, args: list, origin: dict) -> list:
    """Evaluates the jaxpr on ``args``, tracking updated state leaves.

    :func:`stackwise._upstream.jax.eval_jaxpr` evaluates a call inline when state flows
    into it, so that an update written inside `jax.jit`-wrapped helpers (e.g.
    ``lax.dynamic_update_index_in_dim``) is found.

    ``origin`` maps ``id(value)`` to ``(value, source_leaf, writes)`` for values
    that are a state leaf with ``writes`` (a tuple of ``(update, starts)``)
    applied; the value is kept in the entry so its id stays unique.
    """

    def tracked(ins: list) -> bool:
        return any(id(a) in origin for a in ins)

    def observe(name: str, ins: list, outs: list) -> None:
        parts = jax_ties.update_slice_parts(name, ins)
        if parts is not None and id(parts.operand) in origin:
            _, source, writes = origin[id(parts.operand)]
            starts = jnp.stack([jnp.asarray(i, jnp.int32) for i in parts.starts])
            origin[id(outs[0])] = (outs[0], source, (*writes, (parts.update, starts)))

    return jax_ties.eval_jaxpr(jaxpr, consts, args, tracked, observe)


def _ties_hold() -> bool:
    """Whether the evaluation loop and ``dynamic_update_slice``'s operands are as
    :mod:`stackwise._upstream.jax` expects (probed once)."""
    return jax_ties.holds(jax_ties.EVAL_LOOP) and jax_ties.holds(jax_ties.UPDATE_SLICE)


def call(fn: Callable[..., Any], args: tuple, state: Any) -> tuple[Any, Any, list, list]:
    """``fn(*args, state)`` -> ``(out, new_state)``, with its state updates found.

    Returns ``(out, treedef, updates, per_layer)``: ``treedef`` is the new
    state's structure; ``updates`` holds an :class:`Update` per leaf of it
    (static); ``per_layer`` the arrays that leave the layer: each "new" leaf
    whole, and for each "write" leaf its ``(update, starts)`` pairs.
    """
    state_leaves = jax.tree.leaves(state)
    # Without state there is nothing to update in place: every leaf the layer returns is
    # new, and the layer runs directly, as a stateless one does, not made a jaxpr and then
    # evaluated again. Without the ties every leaf leaves the layer whole: slower, the same
    # values.
    if not state_leaves or not _ties_hold():
        out, new_state = fn(*args, state)
        leaves = jax.tree.leaves(new_state)
        return out, jax.tree.structure(new_state), [Update("new")] * len(leaves), leaves
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args, state)
    flat_args = jax.tree.leaves((args, state))
    origin = {id(leaf): (leaf, k, ()) for k, leaf in enumerate(state_leaves)}
    flat_out = _evaluate(closed.jaxpr, closed.consts, flat_args, origin)
    out, new_state = jax.tree.unflatten(jax.tree.structure(shapes), flat_out)
    updates, per_layer = [], []
    for leaf in jax.tree.leaves(new_state):
        entry = origin.get(id(leaf))
        if entry is None:
            updates.append(Update("new"))
            per_layer.append(leaf)
        elif not entry[2]:
            updates.append(Update("same", entry[1]))
        else:
            updates.append(Update("write", entry[1], len(entry[2])))
            per_layer.extend(entry[2])
    return out, jax.tree.structure(new_state), updates, per_layer


def apply_updates(state: Any, treedef: Any, updates: list[Update], per_layer: list) -> Any:
    """The stacked new state: "write" leaves updated in place, layer by layer.

    ``state`` is the stacked input state, ``per_layer`` what :func:`call`
    returned for every layer, stacked along a leading layer axis.
    """
    inputs = jax.tree.leaves(state)
    leaves, rest = [], list(per_layer)
    for u in updates:
        if u.kind == "new":
            leaves.append(rest.pop(0))
        elif u.kind == "same":
            leaves.append(inputs[u.source])
        else:
            writes = [rest.pop(0) for _ in range(u.writes)]  # (update, starts) pairs
            leaves.append(_write(inputs[u.source], writes))
    return jax.tree.unflatten(treedef, leaves)


def _write(stacked: jax.Array, writes: list) -> jax.Array:
    """Applies layer i's ``(update, starts)`` pairs to ``stacked[i]``, in place."""

    def one(s, inputs):
        i, layer_writes = inputs
        for update, starts in layer_writes:
            index = (i, *(starts[d] for d in range(starts.shape[0])))
            s = jax.lax.dynamic_update_slice(s, update[None], index)
        return s, None

    n = stacked.shape[0]
    layers = jnp.arange(n, dtype=jnp.int32)
    stacked, _ = jax.lax.scan(one, stacked, (layers, writes))
    return stacked

"""A layer's state written through into the stacked state, for a Python loop of layers.

With ``unroll=True`` the layers run as a Python loop over static layer indices. A decoding
layer writes a few positions of its own KV cache (``lax.dynamic_update_slice(cache, new,
pos)``) and reads the cache back. Given its slice ``stacked[i]`` and returning a new slice,
it would make a copy of its whole cache every token (the slice, updated, then set back).
:func:`call` runs the layer from its jaxpr with each state leaf standing for row ``i`` of the
stacked leaf: an update of that row becomes an update of the stacked array at ``(i, *starts)``,
and any other use reads ``stacked[i]`` after the updates (a static slice, which the compiler
reads in place). So a stacked cache, donated, is written in place as a loop over separate
per-layer buffers is: on a TPU v5e, compiled, neither a copy of a layer's cache nor temp
memory (``benchmarks/tpu_decode_hlo.py``), where the scan copies each layer's K and V into
another layout every token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from stackwise._core import inplace
from stackwise._upstream import jax as jax_ties

__all__ = ["call", "keeps_layout"]


class _Row:
    """Row ``index`` of the stacked array ``stacked`` (state leaf ``leaf``), as updated so far."""

    __slots__ = ("stacked", "index", "leaf", "read")

    def __init__(self, stacked: jax.Array, index: int, leaf: int):
        self.stacked, self.index, self.leaf = stacked, index, leaf
        self.read: jax.Array | None = None

    def value(self) -> jax.Array:
        """The row as an array (read once)."""
        if self.read is None:
            self.read = jax.lax.index_in_dim(self.stacked, self.index, keepdims=False)
        return self.read


def keeps_layout(fn: Callable, args: tuple, row_state: Any) -> bool:
    """Whether ``fn(*args, state) -> (out, new_state)`` returns each state leaf as it came or
    updated by ``dynamic_update_slice`` (a KV cache does), in the state's structure, so that
    its rows can be written in place; traced once, abstractly. A leaf computed afresh
    (BatchNorm statistics) is not: written through, each layer would take the whole stacked
    state in and out, and under ``jax.grad`` with remat its residuals would hold one stacked
    state per layer."""
    if not _ties_hold():
        return False
    found: dict = {}

    def probe(*inputs):
        *given, state = inputs
        out, treedef, updates, _ = inplace.call(fn, tuple(given), state)
        found.update(treedef=treedef, updates=updates)
        return out

    jax.make_jaxpr(probe)(*args, row_state)
    return found["treedef"] == jax.tree.structure(row_state) and all(
        u.kind in ("same", "write") and u.source == k for k, u in enumerate(found["updates"]))


def call(fn: Callable, args: tuple, stacked: Any, index: int) -> tuple[Any, Any]:
    """``fn(*args, state) -> (out, new_state)`` run on row ``index`` of the stacked state
    ``stacked``; returns ``(out, new_stacked)``, the rows' updates written into the stacked
    leaves (in place when the caller's stacked state is donated). Only for a layer that
    :func:`keeps_layout` says updates its rows."""
    leaves, treedef = jax.tree.flatten(stacked)
    rows = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
                                        for a in leaves])
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args, rows)
    views = [_Row(a, index, k) for k, a in enumerate(leaves)]
    flat = _evaluate(closed.jaxpr, closed.consts, [*jax.tree.leaves(args), *views])
    out, new_state = jax.tree.unflatten(jax.tree.structure(shapes), flat)
    out = jax.tree.map(lambda v: v.value() if isinstance(v, _Row) else v, out)
    new_leaves = []
    for k, (a, leaf) in enumerate(zip(leaves, jax.tree.leaves(new_state))):
        if isinstance(leaf, _Row) and leaf.leaf == k:  # its own row, updated in place
            new_leaves.append(leaf.stacked)
        else:  # computed afresh, or another leaf's row: set into this leaf's row
            value = leaf.value() if isinstance(leaf, _Row) else leaf
            new_leaves.append(a.at[index].set(value))
    return out, jax.tree.unflatten(treedef, new_leaves)


def _evaluate(jaxpr: Any, consts: list, args: list) -> list:
    """Evaluates ``jaxpr`` where some values are :class:`_Row`\\ s: an update of a row writes
    the stacked array; any other equation reads the rows it uses. A call equation that a row
    flows into is evaluated inline (an update inside a ``jax.jit``-ed helper is found)."""

    def inline(ins: list) -> bool:
        return any(isinstance(a, _Row) for a in ins)

    def bind(name: str, ins: list) -> list | None:
        parts = jax_ties.update_slice_parts(name, ins)
        if parts is not None and isinstance(parts.operand, _Row):
            row = parts.operand
            if not any(isinstance(a, _Row) for a in (parts.update, *parts.starts)):
                zero = jax.numpy.zeros((), jax.numpy.int32)
                starts = [jax.numpy.asarray(s, jax.numpy.int32) for s in parts.starts]
                updated = jax.lax.dynamic_update_slice(  # (the update has the row's dtype)
                    row.stacked, parts.update[None], (zero + row.index, *starts))
                return [_Row(updated, row.index, row.leaf)]
        return None

    def read(ins: list) -> list:
        return [a.value() if isinstance(a, _Row) else a for a in ins]

    return jax_ties.eval_jaxpr(jaxpr, consts, args, inline, lambda *_: None,
                               instead=bind, materialize=read)


def _ties_hold() -> bool:
    """Whether the evaluation loop and ``dynamic_update_slice``'s operands are as
    :mod:`stackwise._upstream.jax` expects (probed once)."""
    return jax_ties.holds(jax_ties.EVAL_LOOP) and jax_ties.holds(jax_ties.UPDATE_SLICE)

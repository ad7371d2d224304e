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
    """Whether ``fn(*args, state) -> (out, new_state)`` returns a state of the structure,
    shapes and dtypes it was given (a KV cache does), so that each new leaf has a row of
    the stacked state to go to; traced once, abstractly."""
    if not _ties_hold():
        return True  # (call() then slices, runs and sets back: any state of that layout)
    _, (_, new_state) = jax.make_jaxpr(fn, return_shape=True)(*args, row_state)
    same = lambda a, b: a.shape == b.shape and a.dtype == b.dtype  # noqa: E731
    return jax.tree.structure(new_state) == jax.tree.structure(row_state) and all(
        same(a, b) for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(row_state)))


def call(fn: Callable, args: tuple, stacked: Any, index: int) -> tuple[Any, Any]:
    """``fn(*args, state) -> (out, new_state)`` run on row ``index`` of the stacked state
    ``stacked``; returns ``(out, new_stacked)``, the rows' updates written into the stacked
    leaves (in place when the caller's stacked state is donated). The new state must keep
    the state's layout (:func:`keeps_layout`)."""
    leaves, treedef = jax.tree.flatten(stacked)
    rows = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
                                        for a in leaves])
    if not _ties_hold():  # slice, run, set back: the same values, a copy of each row
        mine = jax.tree.map(lambda a: jax.lax.index_in_dim(a, index, keepdims=False), stacked)
        out, new = fn(*args, mine)
        return out, jax.tree.map(lambda a, v: a.at[index].set(v), stacked, new)
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

"""Exact moves between a :class:`~stackwise.equinox.Stack`'s layout and a list of blocks.

A stacked block is an ordinary ``eqx.Module`` whose every array leaf has a leading layer
axis (what ``eqx.filter_vmap(make_block)(keys)`` builds); everything else (static fields,
activation functions, Python numbers) is shared by all layers. Layer i of it is the block
with every array sliced at ``i``; a list of blocks stacks back into it only if they agree
in everything but their array values (``eqx.nn.StateIndex`` markers aside: see ``_state``).

:meth:`Stack.to_layers`, :meth:`Stack.from_layers` and ``stack[i]`` are built on these
helpers; the ``eqx.nn.State`` of such blocks moves with the helpers of ``_state``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from stackwise import _check
from stackwise.equinox import _state

__all__ = ["layer_of", "stack_blocks"]


# --------------------------------------------------------------------------
# One layer of a stacked block.


def is_array(x: Any) -> bool:
    """An array leaf of a block: ``eqx.is_array``, or abstract (``eqx.filter_eval_shape``)."""
    return eqx.is_array(x) or _check.is_abstract(x)


def arrays(block: Any) -> Any:
    """The block's array leaves (abstract ones too), the rest None: ``eqx.partition``'s half."""
    return eqx.filter(block, is_array)


def layer_of(stacked: Any, j: int) -> Any:
    """The block at index ``j`` of the stacked block: every array sliced, the rest shared."""
    return jax.tree.map(lambda a: _check.take(a, j) if is_array(a) else a, stacked)


# --------------------------------------------------------------------------
# Blocks stacked into one, checked.


def _describe(a: Any) -> str:
    return f"{_check.leaf_dtype(a).name}{list(jnp.shape(a))}"


def _first_difference(a: Any, b: Any, path: str = "", arrays: bool = True) -> tuple | None:
    """Where and how two blocks differ in anything but array values, or None.

    With ``arrays=False`` array shapes and dtypes are not compared: a first pass over the
    static fields names the cause (``out_features``) rather than its effect (``weight``).
    """
    where = path or "<root>"
    if not _check.same_array_kind(a, b):
        return where, f"{type(a).__name__} vs {type(b).__name__}"
    if is_array(a):
        dtypes = _check.leaf_dtype(a), _check.leaf_dtype(b)
        if arrays and (jnp.shape(a) != jnp.shape(b) or dtypes[0] != dtypes[1]):
            return where, f"{_describe(a)} vs {_describe(b)}"
        return None
    if isinstance(a, eqx.Module) and dataclasses.is_dataclass(a):
        static = [f for f in dataclasses.fields(a) if f.metadata.get("static", False)]
        for f in static:
            va, vb = getattr(a, f.name, None), getattr(b, f.name, None)
            same = _same(va, vb)
            if not same:
                why = "" if same is False else ", which `==` cannot compare (arrays inside?)"
                return f"{path}.{f.name}", f"{va!r} vs {vb!r} (a static field{why})"
        children = [
            (f".{f.name}", getattr(a, f.name, None), getattr(b, f.name, None))
            for f in dataclasses.fields(a)
            if f not in static
        ]
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return where, f"{len(a)} vs {len(b)} entries"
        children = [(f"[{i}]", u, v) for i, (u, v) in enumerate(zip(a, b))]
    elif isinstance(a, dict):
        if set(a) != set(b):
            return where, f"keys {sorted(map(repr, a))} vs {sorted(map(repr, b))}"
        children = [(f"[{k!r}]", a[k], b[k]) for k in a]
    else:
        leaves_a, def_a = jax.tree_util.tree_flatten(a)
        leaves_b, def_b = jax.tree_util.tree_flatten(b)
        if leaves_a == [a]:  # a leaf that is not an array: shared, so it must be equal
            same = _same(a, b)
            why = "" if same is not None else ", which `==` cannot compare (arrays inside?)"
            return None if same else (where, f"{a!r} vs {b!r}{why}")
        if def_a != def_b:
            return where, f"{def_a} vs {def_b}"
        children = [(f"[{i}]", u, v) for i, (u, v) in enumerate(zip(leaves_a, leaves_b))]
    for name, u, v in children:
        found = _first_difference(u, v, path + name, arrays)
        if found:
            return found
    return None


def _same(a: Any, b: Any) -> bool | None:
    """``a == b``; None where ``==`` cannot tell (e.g. arrays in a static field): then
    only the one same object is the same."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # e.g. arrays in a static field: compare by identity only
        return None


def stack_blocks(blocks: Sequence[Any], who: str, numbers: Sequence[int]) -> Any:
    """One stacked block from blocks that differ in array values only (bitwise, dtype kept).

    ``numbers`` are the blocks' indices in the caller's list, for messages. The stacked
    block's StateIndexes keep the first block's markers.
    """
    first = _state.unmarked(blocks[0])
    arrays0, static0 = eqx.partition(first, is_array)
    arrays = [arrays0]
    for i, block in zip(numbers[1:], blocks[1:]):
        block = _state.unmarked(block)
        found = _first_difference(first, block, arrays=False) or _first_difference(first, block)
        a, static = eqx.partition(block, is_array)
        if found is None and jax.tree.structure(static) != jax.tree.structure(static0):
            found = "<root>", "another structure or other static fields"
        if found is not None:
            at, how = found
            raise TypeError(
                f"{who}: block {i} ({type(block).__name__}) differs from block "
                f"{numbers[0]} at `{at}`: {how}. Stacked layers share everything but their "
                "array values: build every block with the same arguments (only the key "
                "differing), and keep functions in fields as one shared object (a "
                "module-level function, not a fresh lambda per block); for repeating kinds "
                "of blocks, pass `pattern=k`."
            )
        arrays.append(a)

    def stack(path, *leaves):
        for i, leaf in zip(numbers, leaves):
            _check.exact_dtype(leaf, who, f"`{jax.tree_util.keystr(path)}` of block {i}")
        if all(_check.is_abstract(leaf) for leaf in leaves):  # eqx.filter_eval_shape
            return _check.stack(leaves)
        return jnp.stack(leaves)

    stacked = jax.tree_util.tree_map_with_path(stack, *arrays)
    markers = [x.marker for x in _state.state_indices(blocks[0])]
    return _state.marked(eqx.combine(stacked, static0), markers)

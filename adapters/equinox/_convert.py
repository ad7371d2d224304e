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

from stackwise import _kit
from stackwise.equinox import _state

__all__ = ["first_difference", "layer_of", "stack_blocks"]


# --------------------------------------------------------------------------
# One layer of a stacked block.


def is_array(x: Any) -> bool:
    """An array leaf of a block: ``eqx.is_array``, or abstract (``eqx.filter_eval_shape``)."""
    return eqx.is_array(x) or _kit.is_abstract(x)


def arrays(block: Any) -> Any:
    """The block's array leaves (abstract ones too), the rest None: ``eqx.partition``'s half."""
    return eqx.filter(block, is_array)


def layer_of(stacked: Any, j: int) -> Any:
    """The block at index ``j`` of the stacked block: every array sliced, the rest shared."""
    return jax.tree.map(lambda a: _kit.take(a, j) if is_array(a) else a, stacked)


# --------------------------------------------------------------------------
# Blocks stacked into one, checked.


def _expand(a: Any, b: Any, path: str) -> Any:
    """Equinox's own nodes for :func:`stackwise._kit.contract.first_difference`: a module's
    static fields, which must be equal, and then its other fields."""
    if not (isinstance(a, eqx.Module) and dataclasses.is_dataclass(a)):
        return None
    static = [f for f in dataclasses.fields(a) if f.metadata.get("static", False)]
    for f in static:
        va, vb = getattr(a, f.name, None), getattr(b, f.name, None)
        same = _kit.same_value(va, vb)
        if not same:
            why = "" if same is False else ", which `==` cannot compare (arrays inside?)"
            return f"{path}.{f.name}", f"{va!r} vs {vb!r} (a static field{why})"
    return [
        (f".{f.name}", getattr(a, f.name, None), getattr(b, f.name, None))
        for f in dataclasses.fields(a)
        if f not in static
    ]


def first_difference(a: Any, b: Any, arrays: bool = True) -> tuple | None:
    """Where and how two blocks differ in anything but array values, or None.

    With ``arrays=False`` array shapes and dtypes are not compared: a first pass over
    the static fields names the cause (``out_features``) rather than its effect
    (``weight``).
    """
    return _kit.first_difference(a, b, _expand, arrays=arrays)


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
        found = first_difference(first, block, arrays=False) or first_difference(first, block)
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
            _kit.exact_dtype(leaf, who, f"`{jax.tree_util.keystr(path)}` of block {i}")
        if all(_kit.is_abstract(leaf) for leaf in leaves):  # eqx.filter_eval_shape
            return _kit.stack_abstract(leaves)
        return jnp.stack(leaves)

    stacked = jax.tree_util.tree_map_with_path(stack, *arrays)
    markers = [x.marker for x in _state.state_indices(blocks[0])]
    return _state.marked(eqx.combine(stacked, static0), markers)

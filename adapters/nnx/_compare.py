"""Where two NNX blocks differ in anything but their variables' values, for messages.

:meth:`stackwise.nnx.Stack.from_layers` stacks blocks that must agree in everything but
their values; when two do not, :func:`first_difference` names the first attribute that
differs (``.out_features: 4 vs 5``), as Equinox's ``from_layers`` does;
:func:`stack_blocks` stacks one pattern position's blocks once they agree.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from stackwise import _kit
from stackwise.nnx import _axis

__all__ = ["first_difference", "path_name", "stack_blocks"]


def _attributes(module: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_pytree__")}


def _expand(a: Any, b: Any, path: str) -> Any:
    """NNX's own nodes for :func:`stackwise._kit.contract.first_difference`: a variable's value,
    a module's (or rng stream's) attributes."""
    if isinstance(a, nnx.Variable):
        return [("", a.get_value(), b.get_value())]
    if isinstance(a, nnx.Pytree):  # modules, rng streams
        attrs_a, attrs_b = _attributes(a), _attributes(b)
        if set(attrs_a) != set(attrs_b):
            return path or "<root>", f"attributes {sorted(attrs_a)} vs {sorted(attrs_b)}"
        return [(f".{k}", v, attrs_b[k]) for k, v in attrs_a.items()]
    return None


def first_difference(a: Any, b: Any, arrays: bool = True) -> tuple | None:
    """Where and how two blocks differ in anything but variable values, or None.

    With ``arrays=False`` variables are not compared: a first pass over the other
    attributes names the cause (``out_features``) rather than its effect (``kernel``).
    """
    return _kit.first_difference(a, b, _expand, arrays=arrays)


def path_name(path) -> str:
    """``(DictKey('lin'), DictKey('kernel'), GetAttrKey('value'))`` -> ``lin.kernel``."""
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if name != "value" or not isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(str(name))
    return ".".join(parts) or "<root>"


def stack_blocks(blocks: list, indices: range, layer_axis_name: Any, who: str) -> nnx.Module:
    """Blocks ``indices`` (one position's) as one stacked block, checked against the first."""
    first_i = indices[0]
    graphdef, first = nnx.split(blocks[first_i])
    states = [first]
    for i in indices[1:]:
        block = blocks[i]
        g, state = nnx.split(block)
        found = first_difference(blocks[first_i], block, arrays=False)
        if found is None and (
            g != graphdef or jax.tree.structure(state) != jax.tree.structure(first)
        ):
            found = "<root>", "another structure or other static attributes"
        if found is not None:
            at, how = found
            raise TypeError(
                f"{who}: block {i} ({type(block).__name__}) differs in structure or static "
                f"attributes from block {first_i} at `{at}`: {how}. Every layer of a position "
                "must be built the same way, with the same arguments (only the rngs "
                "differing); for repeating kinds of blocks, pass `pattern=k`."
            )
        found = first_difference(block, blocks[first_i])
        if found is not None:
            at, how = found
            raise TypeError(
                f"{who}: block {i} has variables of other shapes or dtypes than block "
                f"{first_i}: `{at}` is {how} (block {i} vs block {first_i}); every layer's "
                "variable must have one shape "
                "and dtype to be stacked."
            )
        states.append(state)
    for i, state in zip(indices, states):
        for path, a in jax.tree_util.tree_leaves_with_path(state):
            _kit.exact_dtype(a, who, f"{path_name(path)} of block {i}")
    stacked = jax.tree.map(
        lambda *a: _kit.stack_abstract(a) if _kit.is_abstract(a[0]) else jnp.stack(a), *states
    )
    _axis.add(stacked, layer_axis_name)
    return nnx.merge(graphdef, _axis.shard_eagerly(stacked))

"""An NNX :class:`~stackwise.nnx.Stack` in the serving layout: each Variable a
``stackwise.Serving`` of its layers.

``Stack.to_serving()`` converts the Stack in place, as NNX updates a module
(``nnx.update``): every stacked Variable of its block (``nnx.Param``, ``nnx.Cache``,
``nnx.BatchStat``, RNG streams, any custom Variable) keeps its type and metadata, and its
value becomes a ``stackwise.Serving`` of the n per-layer arrays (``_kit.serving.split``:
leaf-wise, so a quantized or LoRA node keeps its own leaves per layer). ``nnx.split``
then flattens each such Variable to n arrays, which ``jax.jit`` donates buffer by buffer.
At the call the Stack regroups them into the core's per-layer trees
(``_kit.serving.gather``), runs the core's serving loop (``Stacked.apply`` over a
``stackwise.Serving``) and writes each layer's new state back into its own buffer
(``_kit.serving.scatter``). ``Stack.from_serving()`` stacks every Variable back, exactly.
Each Variable is converted on its own, so converting holds one Variable twice at most.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from stackwise import _kit
from stackwise.nnx import _inside

__all__ = ["check", "from_serving", "served", "to_serving", "variables"]


def variables(stack: Any) -> list[list[tuple[tuple, nnx.Variable]]]:
    """Each pattern position's ``(path, Variable)`` s, the Variables themselves (not copies),
    without the RNG streams set on the block from outside (they have no layer axis)."""
    out = []
    for block in stack._blocks():
        outside = set(_inside.outside_streams(block))
        out.append(
            [
                (path, node)
                for path, node in nnx.iter_graph(block)
                if isinstance(node, nnx.Variable) and tuple(path[:-1]) not in outside
            ]
        )
    return out


def served(stack: Any) -> bool:
    """Whether any Variable of the Stack's block(s) holds a ``stackwise.Serving``."""
    return any(_kit.serving.served(v.get_raw_value()) for vs in variables(stack) for _, v in vs)


def _show(path: tuple) -> str:
    return ".".join(map(str, path))


def _position_trees(stack: Any) -> list[dict]:
    """Each position's Variable values, ``{"linear.kernel": value}`` (for the checks)."""
    return [{_show(p): v.get_raw_value() for p, v in vs} for vs in variables(stack)]


def check(stack: Any, who: str) -> None:
    """A served Stack's Variables: all served, each position's holding its layers, every
    layer of one shape and dtype (the core runs one block per position).

    Raises:
      TypeError: a stacked Variable among served ones (``_kit.serving.gather``), or a
        served Variable whose layers differ in shape or dtype.
      ValueError: a Variable serving another number of layers than its position runs.
    """
    trees = _position_trees(stack)
    _kit.serving.gather(trees, stack.n, stack.pattern, who, "layers")
    for tree in trees:
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=_kit.serving.is_serving
        )[0]:
            kinds = [(tuple(a.shape), str(a.dtype)) for a in leaf.layers]
            other = next((i for i, kind in enumerate(kinds) if kind != kinds[0]), None)
            if other is not None:
                raise TypeError(
                    f"{who}: the served `layers{jax.tree_util.keystr(path)}` holds layers of "
                    f"other shapes or dtypes: {_describe(kinds[other])} in its layer {other}, "
                    f"{_describe(kinds[0])} in its layer 0. Each layer's buffer keeps the shape "
                    "and dtype it was converted with; set values of that shape (the served "
                    "calls' own state, `nnx.update`), or rebuild the Stack."
                )


def _describe(kind: tuple) -> str:
    shape, dtype = kind
    return f"{dtype}[{', '.join(map(str, shape))}]"


def to_serving(stack: Any, who: str) -> None:
    """Converts ``stack``'s Variables to the serving layout, in place, one at a time."""
    if served(stack):
        raise TypeError(
            f"{who}: the Stack is already in the serving layout (its Variables hold "
            "`stackwise.Serving` s); convert once. `stack.from_serving()` stacks it back."
        )
    _kit.refuse_unservable(
        stack.fsdp,
        stack.nested,
        who,
        ". Build the Stack without `{option}` (e.g. `Stack.from_layers(stack.to_layers(), "
        "...)` with the other options) first.",
    )
    stack._check_layers([_inside.outside_streams(b) for b in stack._blocks()])
    for vs in variables(stack):
        for path, v in vs:
            v.set_raw_value(_kit.serving.split(v.get_raw_value(), who, f"layers.{_show(path)}"))


def from_serving(stack: Any, who: str) -> None:
    """Stacks ``stack``'s served Variables back, in place, one at a time, bit for bit."""
    if not served(stack):
        raise TypeError(
            f"{who}: the Stack is not in the serving layout (its Variables are stacked); "
            "`stack.to_serving()` converts it."
        )
    check(stack, who)
    for vs in variables(stack):
        for path, v in vs:
            v.set_raw_value(_kit.serving.join(v.get_raw_value(), who, f"layers.{_show(path)}"))


def gather(positions: list, stack: Any, who: str, what: str) -> Any:
    """The core's ``stackwise.Serving`` of per-layer States from each position's State
    (checked beforehand by :func:`check`)."""
    return _kit.serving.gather(positions, stack.n, stack.pattern, who, what)


def take(state: Any, j: int) -> Any:
    """Layer ``j`` of a position's State, stacked or served (``stackwise.Serving`` s)."""
    return jax.tree.map(
        lambda a: a.layers[j] if _kit.serving.is_serving(a) else _kit.take(a, j),
        state,
        is_leaf=_kit.serving.is_serving,
    )

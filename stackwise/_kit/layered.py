"""A per-layer function applied to a leaf with as many layer axes as its result needs.

A library that transforms one weight at a time (qwix's ``quantize_params``) sees a stacked
weight ``(n, in, out)`` as one 3-D weight: its per-channel scales then span the layer axis.
:func:`map_layers` maps such a function over the leading layer axes instead, taking the
number of axes (0: not stacked, 1: a Stack's, 2: a Stack within a Stack) from the shapes
the result must have, which the caller knows (qwix's abstract quantized tree).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["holds_qwix", "map_layers", "map_params", "qwix_dequantized_bytes", "qwix_fix"]

#: How many leading layer axes a leaf may have: none, a Stack's, a Stack's in a Stack.
_AXES = (0, 1, 2)


def _shapes(tree: Any) -> list[tuple]:
    return [tuple(leaf.shape) for leaf in jax.tree.leaves(tree)]


def _per_layer(expected: Any, k: int) -> Any:
    """``expected`` with its first ``k`` (layer) axes taken off every leaf, abstractly."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape)[k:], a.dtype), expected)


def _mapped(fn: Callable, expected: Any, k: int) -> Callable:
    """``fn`` over ``k`` leading axes: under ``jax.vmap`` to find the result's shapes, or
    layer by layer (``vmap=False``), so each layer's result is bitwise ``fn`` of that layer
    alone (a vmapped reduction may round its last bit otherwise)."""
    one = _per_layer(expected, k)

    def layer(value, vmap=True):
        if k == 0:
            return fn(value, one)
        inner = _mapped(fn, _per_layer(expected, 1), k - 1)
        if vmap:
            return jax.vmap(inner)(value)
        depth = jax.tree.leaves(value)[0].shape[0]
        outs = [inner(jax.tree.map(lambda a, i=i: a[i], value), vmap=False) for i in range(depth)]
        return jax.tree.map(lambda *a: jnp.stack(a), *outs)

    return layer


def map_layers(
    fn: Callable, value: Any, expected: Any, who: str, name: str, *, axes: int | None = None
) -> Any:
    """``fn(layer_value, layer_expected)`` for each layer of ``value``.

    ``expected`` is what the result must look like, stacked (a tree of arrays or
    ``jax.ShapeDtypeStruct`` s); ``fn`` gets each layer's slice of ``value`` (an array, or a
    tree of arrays with the same layer axes) and the matching per-layer abstract
    ``expected``. The layer axes are ``axes`` if given, else the fewest (0, 1 or 2) for
    which ``fn``'s result has ``expected``'s shapes (found abstractly, so ``fn`` must trace).

    Raises:
      ValueError: no number of layer axes gives ``expected``'s shapes (``value`` comes from
        another model or depth), naming ``name``.
    """
    want = _shapes(expected)
    if axes is not None:
        out = _mapped(fn, expected, axes)(value, vmap=False)
        if _shapes(out) == want:
            return out
    else:
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), value)
        for k in _AXES:
            if k > min(len(shape) for shape in _shapes(value)):
                break
            layer = _mapped(fn, expected, k)
            try:
                got = _shapes(jax.eval_shape(layer, abstract))
            except (TypeError, ValueError, IndexError):  # this k does not fit value's shape
                continue
            if got == want:
                return layer(value, vmap=False)
    shapes = _shapes(value)
    raise ValueError(
        f"{who}: `{name}` of shape{'' if len(shapes) == 1 else 's'} "
        f"{', '.join(map(str, shapes))} does not give the expected shapes "
        f"{want} with {'0, 1 or 2' if axes is None else axes} leading layer axes mapped over. "
        "Give the params of the model the expected (abstract) tree was built from: the same "
        "layers and depth n, stacked as that model's Stacks hold them."
    )


def map_params(
    flat: dict, expected_at: Callable, fn: Callable, who: str, *, sep: str, where: str,
    allow_extra: bool,
) -> dict:
    """:func:`map_layers` of ``fn`` over each param of ``flat`` (path tuple -> array), against
    ``expected_at(path)`` (None where the expected tree lacks the param: left out with
    ``allow_extra``, else refused, naming ``where`` it was looked for)."""
    out = {}
    for path, param in flat.items():
        name = sep.join(str(k) for k in path)
        expected = expected_at(path)
        if expected is None:
            if allow_extra:
                continue
            raise ValueError(
                f"{who}: param `{name}` is not in {where}; give the params of the model it "
                "was built from, or pass `allow_extra_params=True` to leave such params out."
            )
        out[path] = map_layers(fn, param, expected, who, name)
    return out


def _is_qwix(value: Any) -> bool:
    return type(value).__module__.split(".")[0] == "qwix"


def holds_qwix(tree: Any) -> bool:
    """Whether ``tree`` holds a qwix object (a quantized weight), without importing qwix."""
    return any(_is_qwix(v) for v in jax.tree.leaves(tree, is_leaf=_is_qwix))


def _is_qarray(value: Any) -> bool:
    return _is_qwix(value) and type(value).__name__ == "QArray"


def qwix_dequantized_bytes(tree: Any) -> int:
    """The bytes of ``tree``'s qwix-quantized weights once dequantized, all layers together.

    A qwix ``QArray`` dequantizes to its codes' shape (``qvalue.shape``) in its scales' dtype
    (``QArray.dtype``), whatever its qtype (int8 or packed 4-bit): as many bytes as the float
    weight it replaces. qwix's static activation scales (no ``QArray``) count nothing.
    """
    return sum(
        math.prod(v.qvalue.shape) * jnp.dtype(v.scale.dtype).itemsize
        for v in jax.tree.leaves(tree, is_leaf=_is_qarray)
        if _is_qarray(v)
    )


def qwix_fix(bridge: str) -> str:
    """What to do about stacked qwix params of the wrong depth (a depth error's last words)."""
    return (
        " qwix's own `quantize_params` takes a stacked weight's layer axis for a weight axis "
        f"(scales of shape (1, in, 1)); quantize stacked params per layer with `{bridge}("
        "params, abstract_quantized_params)` instead, and build a Stack's params from "
        "stacked ones, not from a single block's."
    )

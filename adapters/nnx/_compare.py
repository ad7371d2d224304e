"""Where two NNX blocks differ in anything but their variables' values, for messages.

:meth:`stackwise.nnx.Stack.from_layers` stacks blocks that must agree in everything but
their values; when two do not, :func:`first_difference` names the first attribute that
differs (``.out_features: 4 vs 5``), as Equinox's ``from_layers`` does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stackwise import _check

__all__ = ["first_difference"]


def _attributes(module: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_pytree__")}


def _describe(a: Any) -> str:
    return f"{_check.leaf_dtype(a).name}{list(jnp.shape(a))}"


def first_difference(a: Any, b: Any, path: str = "", arrays: bool = True) -> tuple | None:
    """Where and how two blocks differ in anything but variable values, or None.

    With ``arrays=False`` variables are not compared: a first pass over the other
    attributes names the cause (``out_features``) rather than its effect (``kernel``).
    """
    where = path or "<root>"
    if not _check.same_array_kind(a, b):
        return where, f"{type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, nnx.Variable):
        a, b = a.get_value(), b.get_value()
    if isinstance(a, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        same = jnp.shape(a) == jnp.shape(b) and _check.leaf_dtype(a) == _check.leaf_dtype(b)
        return None if same or not arrays else (where, f"{_describe(b)} vs {_describe(a)}")
    if isinstance(a, nnx.Pytree):  # modules, rng streams
        attrs_a, attrs_b = _attributes(a), _attributes(b)
        if set(attrs_a) != set(attrs_b):
            return where, f"attributes {sorted(attrs_a)} vs {sorted(attrs_b)}"
        children = [(f".{k}", v, attrs_b[k]) for k, v in attrs_a.items()]
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return where, f"{len(a)} vs {len(b)} entries"
        children = [(f"[{i}]", u, v) for i, (u, v) in enumerate(zip(a, b))]
    elif isinstance(a, dict):
        if set(a) != set(b):
            return where, f"keys {sorted(map(repr, a))} vs {sorted(map(repr, b))}"
        children = [(f"[{k!r}]", a[k], b[k]) for k in a]
    else:
        try:
            same = a is b or bool(a == b)
        except Exception:  # values that do not compare (arrays inside): identity only
            return where, (
                f"{a!r} vs {b!r}, which `==` cannot compare (arrays inside?), so the "
                "blocks must share one object there"
            )
        return None if same else (where, f"{a!r} vs {b!r}")
    for name, u, v in children:
        found = first_difference(u, v, path + name, arrays)
        if found:
            return found
    return None

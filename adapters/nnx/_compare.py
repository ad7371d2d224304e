"""Where two NNX blocks differ in anything but their variables' values, for messages.

:meth:`stackwise.nnx.Stack.from_layers` stacks blocks that must agree in everything but
their values; when two do not, :func:`first_difference` names the first attribute that
differs (``.out_features: 4 vs 5``), as Equinox's ``from_layers`` does.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from stackwise import _kit

__all__ = ["first_difference"]


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

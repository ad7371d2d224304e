"""What makes two equations the same computation up to variable names, and words for how
two differ.

An equation's signature is its primitive, its params (a sub-jaxpr compared as printed,
which names its variables afresh, plus the values of every constant it closes over; a
function by its qualified name) and the shapes and dtypes of its inputs and outputs. Which
variables it reads is not part of it: :mod:`stackwise._autostack.find` follows the data.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from stackwise._upstream import jax as jax_ties

__all__ = ["Signatures", "describe", "difference"]


def _aval(atom: Any) -> tuple:
    aval = atom.aval
    shape = getattr(aval, "shape", None)
    if shape is None:
        return (str(aval),)
    return (tuple(shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)))


def _fingerprint(value: Any) -> tuple:
    """A constant's shape, dtype and bytes (hashed), so that blocks closing over different
    values never look alike."""
    try:
        import jax

        if jax.numpy.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        array = np.asarray(value)
        return (array.shape, str(array.dtype), hashlib.sha1(array.tobytes()).hexdigest())
    except Exception:  # (an object with no bytes: never equal to another)
        return ("object", id(value))


class Signatures:
    """Signatures of equations, each interned as a small int (equal ints: equal signatures).

    Sub-jaxprs are printed once per object (a ``jax.jit``-decorated block shares its jaxpr
    across calls)."""

    def __init__(self) -> None:
        self._ids: dict = {}
        self._jaxprs: dict[int, tuple] = {}
        self._keep: list = []  # (the sub-jaxprs keyed by id stay alive)

    def of(self, eqn: Any) -> int:
        if eqn.effects:  # never repeated: a run holds no effects (find.py says so)
            return self._ids.setdefault(("effects", id(eqn)), len(self._ids))
        key = self.key(eqn)
        return self._ids.setdefault(key, len(self._ids))

    def key(self, eqn: Any) -> tuple:
        params = tuple(sorted((k, self._norm(v)) for k, v in eqn.params.items()))
        ins = tuple(_aval(v) for v in eqn.invars)
        outs = tuple(_aval(v) for v in eqn.outvars)
        return (eqn.primitive.name, params, ins, outs)

    def _norm(self, value: Any) -> Any:
        if hasattr(value, "eqns") or hasattr(value, "consts"):  # Jaxpr, ClosedJaxpr
            return self._jaxpr(value)
        if isinstance(value, (tuple, list)):
            return tuple(self._norm(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, self._norm(v)) for k, v in value.items()))
        if isinstance(value, np.ndarray):
            return _fingerprint(value)
        inner = getattr(value, "f", None)  # a JAX WrappedFun: the function it wraps
        if inner is not None and hasattr(value, "transforms"):
            value = inner
        if callable(value) and not isinstance(value, type):
            return ("function", getattr(value, "__qualname__", type(value).__name__))
        try:
            hash(value)
            return value
        except TypeError:
            return ("repr", repr(value))

    def _jaxpr(self, value: Any) -> tuple:
        found = self._jaxprs.get(id(value))
        if found is None:
            jaxpr = getattr(value, "jaxpr", value)
            consts = tuple(_fingerprint(c) for c in getattr(value, "consts", ()))
            inner = tuple(
                self._norm(v) for e in jaxpr.eqns for v in e.params.values() if _holds_jaxpr(v)
            )
            found = ("jaxpr", str(jaxpr), consts, inner)
            self._jaxprs[id(value)] = found
            self._keep.append(value)
        return found


def _holds_jaxpr(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_holds_jaxpr(v) for v in value)
    return hasattr(value, "eqns") or hasattr(value, "consts")


def describe(eqn: Any, index: int) -> str:
    """``equation 5 (`dot_general`, at model.py:12 (block))``."""
    where = jax_ties.source_line(eqn)
    return f"equation {index} (`{eqn.primitive.name}`" + (f", at {where})" if where else ")")


def _avals_text(atoms: list) -> str:
    return ", ".join(str(v.aval.str_short()) if hasattr(v.aval, "str_short") else str(v.aval)
                     for v in atoms) or "none"


def difference(signatures: Signatures, template: Any, other: Any) -> str:
    """How ``other`` differs from ``template`` (block 0's equation), in words."""
    if other.effects:
        return f"it has effects ({', '.join(map(str, other.effects))}), never part of a run"
    if template.primitive.name != other.primitive.name:
        return f"it is `{other.primitive.name}` where block 0 has `{template.primitive.name}`"
    a, b = signatures.key(template), signatures.key(other)
    if a[2] != b[2]:
        return (f"its inputs are {_avals_text(other.invars)} where block 0's are "
                f"{_avals_text(template.invars)}")
    if a[3] != b[3]:
        return (f"its outputs are {_avals_text(other.outvars)} where block 0's are "
                f"{_avals_text(template.outvars)}")
    for (name, x), (_, y) in zip(a[1], b[1]):
        if x != y:
            if isinstance(x, tuple) and x[:1] == ("jaxpr",):
                return f"its sub-jaxpr `{name}` is another computation"
            return f"its param `{name}` is {_short(y)} where block 0's is {_short(x)}"
    return "its params differ"  # (names of params differ: another primitive version)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

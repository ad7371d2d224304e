"""What makes two equations the same computation up to variable names, and words for how
two differ.

An equation's signature is its primitive, its params (a sub-jaxpr compared as printed,
which names its variables afresh, plus the values of every constant it closes over and the
functions its equations hold; a function, such as a ``custom_vjp``'s backward or a
``custom_jvp``'s rule, by its code and the values it closes over) and the shapes and dtypes
of its inputs and outputs (with their shardings on an explicit mesh). Which variables it
reads is not part of it, nor where a static ``slice`` of unit strides starts (``keys[i]``:
its sizes are): :mod:`stackwise._autostack.find` follows the data and checks where.

A function's key (:meth:`Signatures.function`) is its code object and the keys of its
defaults and closure cells: a Python scalar by value, an array by its bytes, a function
again by its key, any other object by identity. JAX's own plumbing around the user's
functions (``_memoize``'s cache, the trace that made the equation, the stores of output
trees) is made afresh per call: a function from JAX's modules is keyed by its qualified
name and the functions it closes over only, down to the user's. What tells JAX's plumbing,
its ``WrappedFun`` and a concrete array apart leans on JAX internals:
:mod:`stackwise._upstream.jax_functions` holds those ties, dated and probed.

An equation with effects is a block's only where ``lax.scan`` keeps its effect once per step
(a callback's: ``jax.debug.callback``, ``jax.debug.print``, ``io_callback``); its callback is
keyed whole, JAX's wrapper too (the tree and static values of the arguments it passes). An
equation with any other effect (:func:`unkept`) is never repeated, so never in a run.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import types
from typing import Any

import jax
import numpy as np

from stackwise._upstream import jax as jax_ties
from stackwise._upstream import jax_functions

__all__ = ["KEPT", "SIZES", "Signatures", "describe", "difference", "effect_words", "is_index",
           "unkept"]


def _aval(atom: Any) -> tuple:
    """Shape, dtype, weak type and sharding (``jax.typeof(x).sharding``: the mesh axes of an
    explicit mesh that split it; alike for every value traced without one)."""
    aval = atom.aval
    shape = getattr(aval, "shape", None)
    if shape is None:
        return (str(aval),)
    sharding = getattr(aval, "sharding", None)
    try:
        hash(sharding)
    except TypeError:
        sharding = repr(sharding)
    return (tuple(shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)), sharding)


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
    across calls). ``loose``: every function keyed alike, so that blocks differing only in
    the functions they hold (each layer's backward closing over its own object) still line
    up, and the strict signatures then say how they differ."""

    def __init__(self, loose: bool = False) -> None:
        self.loose = loose  # every function alike: to find where functions alone differ
        self._whole = False  # (keying a callback: JAX's wrappers too by all they close over)
        self._ids: dict = {}
        self._jaxprs: dict[int, tuple] = {}
        self._keep: list = []  # (the sub-jaxprs keyed by id stay alive)

    def of(self, eqn: Any) -> int:
        if unkept(eqn):  # never repeated: a run holds no such effect (find.py says so)
            return self._ids.setdefault(("effects", id(eqn)), len(self._ids))
        if self.loose and eqn.effects:  # (callbacks lined up whatever they print or call)
            key = (eqn.primitive.name, "callback", tuple(_aval(v) for v in eqn.invars))
            return self._ids.setdefault(key, len(self._ids))
        key = self.key(eqn)
        return self._ids.setdefault(key, len(self._ids))

    def key(self, eqn: Any) -> tuple:
        items = eqn.params.items()
        if is_index(eqn):  # (where it starts is compared by find.py: `keys[i]` per layer)
            sizes = tuple(b - a for a, b in zip(eqn.params["start_indices"],
                                                eqn.params["limit_indices"]))
            items = [(SIZES, sizes), ("strides", eqn.params["strides"])]
        params = tuple(sorted((k, self._param(eqn, k, v)) for k, v in items))
        ins = tuple(_aval(v) for v in eqn.invars)
        outs = tuple(_aval(v) for v in eqn.outvars)
        return (eqn.primitive.name, params, ins, outs)

    def _param(self, eqn: Any, name: str, value: Any) -> Any:
        """A param's key. A callback (``jax.debug.callback``'s, ``io_callback``'s) is keyed
        whole: JAX's wrapper around the user's function by all it closes over too (the
        arguments' tree, the static arguments), as each call is the layer's own."""
        if not (eqn.effects and name == "callback" and _is_function(value)):
            return self._norm(value)
        self._whole, was = True, self._whole
        try:
            return self.function(value)
        finally:
            self._whole = was

    def _norm(self, value: Any) -> Any:
        if hasattr(value, "eqns") or hasattr(value, "consts"):  # Jaxpr, ClosedJaxpr
            return self._jaxpr(value)
        if isinstance(value, (tuple, list)):
            return tuple(self._norm(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, self._norm(v)) for k, v in value.items()))
        if isinstance(value, np.ndarray):
            return _fingerprint(value)
        if _is_function(value):
            return self.function(value)
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
            inner = tuple(  # (the sub-jaxprs and functions of its equations: a printed
                # jaxpr shows a function param by its name only)
                self._param(e, k, v) for e in jaxpr.eqns for k, v in e.params.items()
                if _holds_jaxpr(v) or _holds_callable(v)
            )
            found = ("jaxpr", str(jaxpr), consts, inner)
            self._jaxprs[id(value)] = found
            self._keep.append(value)
        return found


    def function(self, value: Any, active: tuple = ()) -> tuple:
        """A callable's key: equal keys, the same computation (see the module's docstring).

        ``active``: the ids of the callables and containers being keyed around this one (a
        closure that reaches itself is keyed ``("cycle",)`` there)."""
        if self.loose:
            return ("function",)
        if id(value) in active:
            return ("cycle",)
        active = (*active, id(value))
        if jax_functions.is_wrapped(value):
            parts = jax_functions.wrapped_parts(value)
            if parts is None:  # (its tie broken: by identity)
                return self._identity(value)
            return ("wrapped", self.function(parts[0], active),
                    tuple(self.function(t, active) for t in parts[1]))
        if isinstance(value, functools.partial):
            return ("partial", self.function(value.func, active),
                    self._value(value.args, active), self._value(value.keywords, active))
        if isinstance(value, types.MethodType):
            return ("method", self.function(value.__func__, active),
                    self._value(value.__self__, active))
        code = getattr(value, "__code__", None)
        if code is None and self._whole and dataclasses.is_dataclass(value):
            # (io_callback's `_FlatCallback`: the user's function and the arguments' tree)
            return ("fields", type(value), tuple(
                (f.name, self._value(getattr(value, f.name), active))
                for f in dataclasses.fields(value)))
        if code is None:  # a builtin, an object with __call__: by identity
            return self._identity(value)
        cells = []
        for name, cell in zip(code.co_freevars, value.__closure__ or ()):
            try:
                cells.append((name, cell.cell_contents))
            except ValueError:  # (a cell not yet filled)
                cells.append((name, None))
        name = getattr(value, "__qualname__", code.co_name)
        if not self._whole and jax_functions.is_plumbing(value):
            return ("jax", name, tuple((n, self._value(c, active)) for n, c in cells
                                       if _holds_callable(c)))
        return ("function", name, code, self._value(value.__defaults__, active),
                self._value(value.__kwdefaults__, active),
                tuple((n, self._value(c, active)) for n, c in cells))

    def _value(self, value: Any, active: tuple) -> Any:
        """A closed-over value's key: by value where it has one, else by identity."""
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return (type(value).__name__, value)
        if isinstance(value, (tuple, list, dict)):
            if id(value) in active:  # (a container holding itself)
                return ("cycle",)
            active = (*active, id(value))
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(self._value(v, active) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple((self._value(k, active), self._value(v, active))
                                  for k, v in value.items()))
        if isinstance(value, (type, types.ModuleType)):
            return ("named", value)
        if isinstance(value, jax.tree_util.PyTreeDef):  # (a callback's arguments' tree)
            return ("treedef", value)
        if isinstance(value, (np.ndarray, np.generic)) or jax_functions.is_concrete_array(value):
            return ("array", *_fingerprint(value))
        if _is_function(value):
            return self.function(value, active)
        return self._identity(value)

    def _identity(self, value: Any) -> tuple:
        self._keep.append(value)  # (alive while its id is a key)
        return ("object", type(value).__qualname__, id(value))


SIZES = "limit_indices - start_indices"


def is_index(eqn: Any) -> bool:
    """Whether ``eqn`` is a static ``slice`` of unit strides (``keys[i]``, ``xs[i]``): its
    signature holds the sizes it takes, not where it starts (blocks may slice one array at
    steps: :func:`stackwise._autostack.find.follow` checks where)."""
    if eqn.primitive.name != "slice":
        return False
    strides = eqn.params.get("strides")
    return strides is None or all(s == 1 for s in strides)


def unkept(eqn: Any) -> list:
    """The effects of ``eqn`` that a block may not hold to be stacked: all but callbacks'
    (:func:`~stackwise._upstream.jax_functions.scan_keeps`)."""
    return [e for e in eqn.effects if not jax_functions.scan_keeps(e)]


def effect_words(effects: list) -> str:
    """``ErrorEffect``: the effects' types, named."""
    return ", ".join(sorted({f"`{type(e).__name__}`" for e in effects}))


def _holds_callable(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_holds_callable(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_callable(v) for v in value.values())
    return _is_function(value)


def _is_function(value: Any) -> bool:
    return (callable(value) and not isinstance(value, type)) or jax_functions.is_wrapped(value)


def _holds_jaxpr(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_holds_jaxpr(v) for v in value)
    return hasattr(value, "eqns") or hasattr(value, "consts")


KEPT = ("a block may hold only callbacks' effects: `jax.debug.callback`, `jax.debug.print`, "
        "`io_callback`")


def describe(eqn: Any, index: int) -> str:
    """``equation 5 (`dot_general`, at model.py:12 (block))``."""
    where = jax_ties.source_line(eqn)
    return f"equation {index} (`{eqn.primitive.name}`" + (f", at {where})" if where else ")")


def _avals_text(atoms: list) -> str:
    return ", ".join(str(v.aval.str_short()) if hasattr(v.aval, "str_short") else str(v.aval)
                     for v in atoms) or "none"


def difference(signatures: Signatures, template: Any, other: Any) -> str:
    """How ``other`` differs from ``template`` (block 0's equation), in words."""
    if unkept(other):  # (block 0's equations repeat: none has such an effect)
        return (f"it has the effect {effect_words(unkept(other))}, which autostack never puts "
                f"in a scan ({KEPT})")
    if template.primitive.name != other.primitive.name:
        return f"it is `{other.primitive.name}` where block 0 has `{template.primitive.name}`"
    a, b = signatures.key(template), signatures.key(other)
    if a[2] != b[2]:
        return (f"its inputs are {_avals_text(other.invars)} where block 0's are "
                f"{_avals_text(template.invars)}")
    if a[3] != b[3]:
        return (f"its outputs are {_avals_text(other.outvars)} where block 0's are "
                f"{_avals_text(template.outvars)}")
    how = _params_difference(a[1], b[1])
    if other.effects:  # (a callback: what differs per layer can be passed to it)
        how += (" (a callback's array and number arguments may differ from layer to layer, "
                "its format string and other arguments (a string) may not: pass a per-layer "
                "value as a number, e.g. `jax.debug.print(\"layer {i}\", i=i)`)")
    return how


def _params_difference(a: tuple, b: tuple) -> str:
    for (name, x), (_, y) in zip(a, b):
        if x != y:
            if isinstance(x, tuple) and x[:1] == ("jaxpr",):
                if x[1:3] == y[1:3]:  # the same equations: a function they hold differs
                    how = _walk(x[3], y[3])
                    return (f"its sub-jaxpr `{name}` holds a function that differs from block "
                            f"0's: {how or 'another function'}")
                return f"its sub-jaxpr `{name}` is another computation"
            how = _walk(x, y)
            if how is not None:
                return f"its param `{name}` differs from block 0's: {how}"
            return f"its param `{name}` is {_short(y)} where block 0's is {_short(x)}"
    return "its params differ"  # (names of params differ: another primitive version)


def _walk(x: Any, y: Any) -> str | None:
    """Where two keys first differ, in words, if down to a function (None otherwise)."""
    if x == y or not (isinstance(x, tuple) and isinstance(y, tuple)):
        return None
    if x[:1] == y[:1] == ("function",):
        _, name, code, defaults, kwdefaults, cells = x
        where = _where(code)
        if code != y[2]:
            return f"`{y[1]}` ({_where(y[2])}) where block 0's is `{name}` ({where})"
        for (cell, a), (_, b) in zip(cells, y[5]):
            if a != b:
                inner = _walk(a, b)
                if inner is not None and a[:1] in (("function",), ("jax",), ("wrapped",)):
                    return f"`{name}` ({where}) closes over `{cell}`, which differs: {inner}"
                if a[:1] == b[:1] == ("array",) and a[1:3] == b[1:3]:
                    return (f"`{name}` ({where}) closes over `{cell}`, an array {a[2]}"
                            f"{list(a[1])} whose values differ from block 0's")
                return (f"`{name}` ({where}) closes over `{cell}` = {_value_words(b)} where "
                        f"block 0's closes over {_value_words(a)}")
        return f"`{name}` ({where}) has other default arguments"
    if x[:1] == y[:1] == ("object",):
        return f"another `{y[1]}` object than block 0's (compared by identity)"
    if len(x) == len(y):
        for a, b in zip(x, y):
            if a != b:
                return _walk(a, b)
    return None


def _where(code: Any) -> str:
    return f"{code.co_filename}:{code.co_firstlineno}"


def _value_words(key: Any) -> str:
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and key[0] in (
        "NoneType", "bool", "int", "float", "complex", "str", "bytes"
    ):
        return _short(key[1])
    if isinstance(key, tuple) and key[:1] == ("array",):
        return f"an array {key[2]}{list(key[1])} (its values compared)"
    if isinstance(key, tuple) and key[:1] == ("object",):
        return f"a `{key[1]}` object (compared by identity)"
    if isinstance(key, tuple) and key[:1] in (("function",), ("jax",)):
        return f"the function `{key[1]}`"
    return _short(key)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

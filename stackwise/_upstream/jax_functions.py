"""stackwise's ties to how JAX holds functions in a traced equation's params, read from jax
0.10.2 and guarded.

:func:`stackwise.autostack` compares two blocks' equations by what they compute
(:mod:`stackwise._autostack.signature`), and an equation's params may hold functions: a
``custom_vjp``'s backward, a ``custom_jvp``'s rule, the thunks that make their jaxprs. The user's
functions among them are compared by their code and the values they close over; JAX's own
plumbing around them is made afresh at every call and would never compare equal. Three ties
tell the two apart:

- :func:`is_plumbing`: a function defined in JAX's modules (``jax`` or ``jax.*``) is plumbing,
  keyed by its qualified name and the functions it closes over only (``_memoize``'s cache
  dict, the trace that made the equation, ``out_trees``' store and count are per call).
- :func:`wrapped_parts`: a ``linear_util.WrappedFun`` (:func:`is_wrapped`; not callable
  itself) is its function ``f`` and the functions of its ``transforms`` (``(function,
  params)`` pairs).
- :func:`is_concrete_array`: a value closed over that is a ``jax.Array`` and not a
  ``jax.core.Tracer`` is keyed by its bytes.
- :func:`scan_keeps`: the effects of ``jax.debug.callback``, ``jax.debug.print`` and
  ``io_callback`` (ordered or not) are ones ``lax.scan`` takes in its body, each call kept
  once per step in step order: a block holding them may be stacked. Read from the effects of
  those public calls, traced (the effect types are JAX's internals); any other effect
  (``checkify.check``'s, a ref's reads and writes) is never stacked.

Each has a probe (:data:`TIES`); :func:`check` runs one and raises
:class:`~stackwise._upstream.jax.UpstreamChanged` naming it (the fast tier does, in
``tests/autostack/test_upstream_jax_functions.py``); :func:`holds` runs it once, at first
use, and when it fails warns and takes the exact path: every function keyed as the user's
(its code and every value it closes over, objects by identity), a ``WrappedFun`` and an
array by identity, and no effect kept in a scan. Blocks that hold JAX's per-call plumbing
(or callbacks) then never look alike: a loop of ``custom_vjp`` blocks is refused (or, with
``best_effort=True``, run unchanged), never stacked wrongly.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from stackwise._upstream.jax import MIRRORS, UpstreamChanged, run_probe

__all__ = [
    "MIRRORS",
    "TIES",
    "check",
    "holds",
    "is_concrete_array",
    "is_plumbing",
    "is_wrapped",
    "scan_keeps",
    "wrapped_parts",
]

PLUMBING = "JAX's functions in a custom rule's params"
WRAPPED = "linear_util.WrappedFun's function and transforms"
TRACER = "jax.core.Tracer"
EFFECTS = "the callbacks' effects that lax.scan keeps"
_MODULE = "stackwise/_upstream/jax_functions.py"


def _expect(tie: str, ok: bool, detail: str) -> None:
    if not ok:
        raise UpstreamChanged(tie, detail, _MODULE)


# --------------------------------------------------------------------------
# The ties (jax 0.10.2: jax/_src/interpreters/partial_eval.py, `process_custom_vjp_call` and
# `process_custom_jvp_call` put `_memoize`d thunks, `out_trees_` and the rules, as
# `WrappedFun`s (jax/_src/linear_util.py), in the equation's params).


def is_plumbing(fn: Any) -> bool:
    """Whether ``fn`` is one of JAX's own functions (defined in ``jax`` or ``jax.*``), made
    afresh per call around the user's. With the tie broken: never (every function is the
    user's, keyed by everything it closes over)."""
    return holds(PLUMBING) and _from_jax(fn)


def is_wrapped(value: Any) -> bool:
    """Whether ``value`` is a ``WrappedFun`` (it has ``f``, ``transforms`` and
    ``call_wrapped``)."""
    return _is_wrapped(value)


def wrapped_parts(value: Any) -> tuple[Any, tuple] | None:
    """``(f, transform functions)`` of a ``WrappedFun`` (:func:`is_wrapped`); ``None`` with
    the tie broken (the caller then keys it by identity)."""
    return _parts(value) if holds(WRAPPED) else None


def is_concrete_array(value: Any) -> bool:
    """Whether ``value`` is a ``jax.Array`` with values (not a tracer). With the tie broken:
    never (an array closed over is keyed by identity)."""
    return isinstance(value, jax.Array) and holds(TRACER) and not isinstance(
        value, jax.core.Tracer)


def scan_keeps(effect: Any) -> bool:
    """Whether ``effect`` (one of an equation's ``effects``) is a callback's that a block may
    hold and still be stacked: ``lax.scan`` takes it in its body, run once per step in step
    order. With the tie broken: never (blocks with effects are never stacked)."""
    return holds(EFFECTS) and type(effect) in _callback_effects()


@functools.cache
def _callback_effects() -> frozenset:
    """The types of the effects of ``jax.debug.callback`` and ``io_callback``, ordered or
    not, and of ``jax.debug.print`` (jax 0.10.2: ``DebugEffect``, ``OrderedDebugEffect``,
    ``IOEffect``, ``OrderedIOEffect``), read from those calls traced."""
    return frozenset(type(e) for f in _CALLBACKS for e in _traced_effects(f))


def _traced_effects(fn: Callable) -> set:
    return set(jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((3,), jnp.float32)).effects)


def _io(ordered: bool) -> Callable:
    from jax.experimental import io_callback

    return lambda x: io_callback(lambda v: v, jax.ShapeDtypeStruct((3,), jnp.float32), x,
                                 ordered=ordered)


_CALLBACKS = (
    lambda x: jax.debug.callback(lambda v: None, x),
    lambda x: jax.debug.callback(lambda v: None, x, ordered=True),
    lambda x: jax.debug.print("{}", x),
    lambda x: _io(False)(x),
    lambda x: _io(True)(x),
)


def _from_jax(fn: Any) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return module == "jax" or module.startswith("jax.")


def _is_wrapped(value: Any) -> bool:
    return hasattr(value, "f") and hasattr(value, "transforms") and hasattr(value, "call_wrapped")


def _parts(value: Any) -> tuple[Any, tuple]:
    return value.f, tuple(t for t, _ in value.transforms)


# --------------------------------------------------------------------------
# The probes.


def _walk(value: Any, active: tuple = ()) -> tuple:
    """A function's key as :mod:`stackwise._autostack.signature` makes it, reduced to the
    functions: the user's by code, JAX's by qualified name and the functions they close
    over (found through ``WrappedFun`` and closure cells)."""
    if id(value) in active:
        return ("cycle",)
    active = (*active, id(value))
    if _is_wrapped(value):
        f, transforms = _parts(value)
        return ("wrapped", _walk(f, active), tuple(_walk(t, active) for t in transforms))
    code = getattr(value, "__code__", None)
    if code is None:
        return ("object", type(value).__qualname__)
    if not _from_jax(value):
        return ("user", code)
    cells = []
    for cell in value.__closure__ or ():  # (an empty cell raises: the probe then fails)
        if callable(cell.cell_contents) or _is_wrapped(cell.cell_contents):
            cells.append(_walk(cell.cell_contents, active))
    return ("jax", value.__qualname__, tuple(cells))


def _users(key: Any) -> set:
    if isinstance(key, tuple) and key[:1] == ("user",):
        return {key[1]}
    found = set()
    for part in key if isinstance(key, tuple) else ():
        found |= _users(part)
    return found


def _probe_plumbing() -> None:
    """Traced only: two calls of the same ``custom_vjp`` and ``custom_jvp`` functions hold
    functions whose keys are equal, and reach the user's backward and rule."""

    def fwd(x):
        return jnp.sin(x), x

    def bwd(x, g):
        return (jnp.cos(x) * g,)

    def rule(primals, tangents):
        return jnp.cos(primals[0]), -jnp.sin(primals[0]) * tangents[0]

    vjp = jax.custom_vjp(jnp.sin)
    vjp.defvjp(fwd, bwd)
    jvp = jax.custom_jvp(jnp.cos)
    jvp.defjvp(rule)
    eqns = jax.make_jaxpr(lambda x: jvp(vjp(jvp(vjp(x)))))(jax.ShapeDtypeStruct((3,), jnp.float32))
    eqns = eqns.jaxpr.eqns
    names = [e.primitive.name for e in eqns]
    _expect(PLUMBING, names == ["custom_vjp_call", "custom_jvp_call"] * 2,
            f"two custom_vjp and custom_jvp calls traced as {names}")
    keys = [tuple((k, _walk(v)) for k, v in sorted(e.params.items())
                  if callable(v) or _is_wrapped(v)) for e in eqns]
    _expect(PLUMBING, keys[0] == keys[2] and keys[1] == keys[3],
            f"the same rules, called twice, hold functions keyed {keys[0]} and {keys[2]}")
    users = (_users(keys[0]), _users(keys[1]))
    want = ({fwd.__code__, bwd.__code__}, {rule.__code__})
    _expect(PLUMBING, all(w <= u for w, u in zip(want, users)),
            f"the functions reached are {users}, not the user's forward, backward and rule")


def _probe_wrapped() -> None:
    """Traced only: a ``custom_vjp``'s backward is a ``WrappedFun`` of the user's function."""

    def bwd(_, g):
        return (g,)

    vjp = jax.custom_vjp(jnp.sin)
    vjp.defvjp(lambda x: (jnp.sin(x), None), bwd)
    (eqn,) = jax.make_jaxpr(vjp)(jax.ShapeDtypeStruct((3,), jnp.float32)).jaxpr.eqns
    wrapped = eqn.params.get("bwd")
    parts = _parts(wrapped) if _is_wrapped(wrapped) else None
    _expect(WRAPPED, parts is not None and parts[0] is bwd,
            f"the backward param reads as {parts}, not the user's function")


def _probe_tracer() -> None:
    seen = []
    jax.make_jaxpr(lambda x: seen.append(isinstance(x, jax.core.Tracer)) or x)(1.0)
    with jax.ensure_compile_time_eval():  # (concrete, even inside the user's trace)
        concrete = isinstance(jnp.zeros(2), jax.core.Tracer)
    _expect(TRACER, seen == [True] and not concrete,
            f"a traced value reads as a tracer: {seen}; a concrete array: {concrete}")


def _probe_effects() -> None:
    """Traced only: each callback has one effect, and a scan whose body makes every one of
    them keeps them all (``lax.scan`` refuses an effect it does not take)."""
    each = [_traced_effects(f) for f in _CALLBACKS]
    _expect(EFFECTS, all(len(e) == 1 for e in each), f"the callbacks' effects are {each}")

    def body(c, _):
        for f in _CALLBACKS:
            f(c)
        return c, None

    scanned = _traced_effects(lambda x: jax.lax.scan(body, x, None, length=2)[0])
    want = set().union(*each)
    _expect(EFFECTS, scanned == want, f"a scan of the callbacks has effects {scanned}, not "
                                      f"{want}")


#: Every tie, with its probe.
TIES: dict[str, Callable[[], None]] = {
    PLUMBING: _probe_plumbing,
    WRAPPED: _probe_wrapped,
    TRACER: _probe_tracer,
    EFFECTS: _probe_effects,
}


def check(tie: str) -> None:
    """Runs ``tie``'s probe; raises :class:`UpstreamChanged` naming the tie if it fails."""
    run_probe(TIES, tie, _MODULE)


@functools.cache
def holds(tie: str) -> bool:
    """Whether ``tie`` holds with the installed jax (its probe, run once); warns if not."""
    try:
        check(tie)
    except UpstreamChanged as e:
        warnings.warn(str(e), RuntimeWarning, stacklevel=2)
        return False
    return True

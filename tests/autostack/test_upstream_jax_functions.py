"""autostack's ties to how JAX holds functions in an equation's params
(`stackwise/_upstream/jax_functions.py`), each checked directly, and the exact path each
takes when broken: blocks that hold JAX's per-call plumbing then never look alike, so a loop
of custom-rule blocks is refused, never stacked wrongly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _models import mlp_params

import stackwise
from stackwise._upstream import jax_functions

KEY = jax.random.key(0)
X = jnp.ones((4, 8))


@pytest.fixture
def probed_afresh():
    """``holds`` forgets what it found, before and after the test."""
    jax_functions.holds.cache_clear()
    yield
    jax_functions.holds.cache_clear()


def broken(monkeypatch, *ties: str) -> None:
    """The code sees ``ties`` as no longer holding."""
    monkeypatch.setattr(jax_functions, "holds", lambda tie: tie not in set(ties))


@pytest.mark.every_case
@pytest.mark.parametrize("tie", list(jax_functions.TIES))
def test_each_tie_holds_with_the_installed_jax(tie):
    jax_functions.check(tie)  # raises UpstreamChanged naming the tie


def test_a_tie_that_no_longer_holds_is_named_and_warned_once(monkeypatch, probed_afresh):
    def changed():
        raise AttributeError("'WrappedFun' object has no attribute 'transforms'")

    monkeypatch.setitem(jax_functions.TIES, jax_functions.WRAPPED, changed)
    message = (r"the tie to linear_util.WrappedFun's function and transforms "
               r"\(stackwise/_upstream/jax_functions.py, .* no longer holds: its probe raised "
               r"AttributeError")
    with pytest.raises(RuntimeError, match=message) as e:
        jax_functions.check(jax_functions.WRAPPED)
    assert e.value.tie == jax_functions.WRAPPED and jax.__version__ in str(e.value)
    with pytest.warns(RuntimeWarning, match=message):
        assert not jax_functions.holds(jax_functions.WRAPPED)
    assert not jax_functions.holds(jax_functions.WRAPPED)  # probed once
    # A probe that finds the tie changed says how, unwrapped.
    found = lambda: jax_functions._expect(jax_functions.TRACER, False, "no tracer")  # noqa: E731
    monkeypatch.setitem(jax_functions.TIES, jax_functions.TRACER, found)
    with pytest.raises(RuntimeError, match=r"jax_functions.py, .* no longer holds: no tracer"):
        jax_functions.check(jax_functions.TRACER)


def test_the_probes_hold_inside_a_trace_under_a_mesh_and_without_jit():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

    def probe_all(x):
        for tie in jax_functions.TIES:
            jax_functions.check(tie)
        return x

    with jax.set_mesh(mesh):
        jax.jit(probe_all)(1.0)
    with jax.disable_jit():
        probe_all(1.0)


# --------------------------------------------------------------------------
# Each tie broken: the blocks holding JAX's plumbing are not alike (refused), never stacked
# wrongly; with the ties holding, the same loop is stacked.


def scaled_grad(scale):
    """An identity whose backward scales the gradient by ``scale`` (closed over)."""

    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (g * scale,))
    return f


def tangent_scaled(scale):
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda primals, tangents: (jnp.sin(primals[0]), tangents[0] * scale))
    return f


def looped(wrapper):
    """The mlp loop, layer ``i``'s output through ``wrapper(i)``, made afresh per layer."""

    def model(params, x):
        for i, p in enumerate(params["layers"]):
            x = wrapper(i)(x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"])
        return x @ params["head"]

    return model


HALVES = [jnp.asarray(0.5) for _ in range(3)]  # equal arrays, apart
WRAPPERS = {  # tie -> a loop whose blocks are alike only with the tie
    jax_functions.PLUMBING: lambda i: tangent_scaled(0.5),
    jax_functions.WRAPPED: lambda i: scaled_grad(0.5),
    jax_functions.TRACER: lambda i: scaled_grad(HALVES[i]),
}


@pytest.mark.every_case
@pytest.mark.parametrize("tie", list(WRAPPERS))
def test_with_a_tie_broken_the_blocks_are_refused_not_stacked(monkeypatch, tie):
    model, params = looped(WRAPPERS[tie]), mlp_params(KEY, 3)
    stacked, f = stackwise.autostack(model, params, X)
    assert f.found.n == 3
    assert jnp.allclose(f(stacked, X), model(params, X), atol=1e-6)
    broken(monkeypatch, tie)
    with pytest.raises(ValueError, match="found no run of 2 or more blocks"):
        stackwise.autostack(model, params, X)
    params_back, g = stackwise.autostack(model, params, X, best_effort=True)
    assert params_back is params and (g(params, X) == model(params, X)).all()


def test_with_the_ties_broken_keys_fall_back_to_identity(monkeypatch):
    from stackwise._autostack.signature import Signatures

    (eqn,) = jax.make_jaxpr(scaled_grad(0.5))(1.0).jaxpr.eqns
    wrapped = eqn.params["bwd"]
    assert jax_functions.is_wrapped(wrapped)
    assert Signatures().function(wrapped)[0] == "wrapped"
    array = jnp.asarray(0.5)
    assert jax_functions.is_concrete_array(array)
    broken(monkeypatch, *jax_functions.TIES)
    assert jax_functions.wrapped_parts(wrapped) is None
    assert Signatures().function(wrapped)[:2] == ("object", "WrappedFun")
    assert not jax_functions.is_concrete_array(array)
    assert not jax_functions.is_plumbing(jax.numpy.sin)

"""The misuse catalogue of pipelines of patterns and of layers with state.

One table: the call, the error it must raise, and words its message must hold (the
argument or leaf, and the fix). Meshes are abstract or of one device; calls that need a
trace run under ``jax.eval_shape``, so nothing compiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _misuse import assert_refused, case
from jax.sharding import AbstractMesh, Mesh

import stackwise

ONE = Mesh(np.array(jax.devices()[:1]), ("stage",))
DATA = AbstractMesh((1, 2), ("stage", "data"))


def _init(key):
    return {"w": jnp.ones(2)}, {"k": jnp.zeros((4, 2))}  # a cache with a batch of 4


def _apply(params, state, x):
    return x * params["w"][None, :], {"k": state["k"] + x}


def _pattern(mesh=ONE, n=4, applies=(_apply, _apply), **options):
    return stackwise.pipeline(
        [_init] * len(applies), list(applies), n, mesh, microbatches=2, with_state=True, **options
    )


def _call(pp, params, state, x=None):
    x = jnp.ones((4, 2)) if x is None else x
    return jax.eval_shape(pp.apply, params, state, x)


def _made(pp):
    return jax.eval_shape(pp.init, jax.random.key(0))


def _wrong_depth():
    pp = _pattern()
    params, state = _made(pp)
    state = (jax.tree.map(lambda a: jnp.zeros((1, *a.shape[1:])), state[0]), state[1])
    _call(pp, params, state)


def _state_of_another_batch():
    pp = _pattern()
    params, state = _made(pp)
    _call(pp, params, state, jnp.ones((6, 2)))


def _unbatched_state_over_data():
    pp = _pattern(DATA, data_axis="data", batched_state=False)
    _call(pp, *_made(pp))


def _unbatched_state_over_fsdp():
    pp = _pattern(DATA, fsdp="data", batched_state=False)
    _call(pp, *_made(pp))


def _batched_state_not_a_bool():
    pp = _pattern(batched_state=lambda path: "k" in path and 1)
    _call(pp, *_made(pp))


def _params_not_a_tuple():
    pp = _pattern()
    params, state = _made(pp)
    _call(pp, params[0], state)


def _without_state():
    pp = _pattern()
    params, _ = _made(pp)
    pp.apply(params, jnp.ones((4, 2)))


def _without_x():
    pp = stackwise.pipeline([None, None], [_apply, _apply], 4, ONE, microbatches=2)
    pp.apply(({"w": jnp.ones((2, 2))},) * 2)


def _state_of_another_shape():
    def grows(params, state, x):
        return x, {"k": jnp.concatenate([state["k"], x])}

    pp = _pattern(applies=(_apply, grows))
    _call(pp, *_made(pp))


def _state_not_returned():
    pp = _pattern(applies=(_apply, lambda params, state, x: x))
    _call(pp, *_made(pp))


def _aux_not_returned():
    pp = _pattern(applies=(_apply, _apply), has_aux=True)
    _call(pp, *_made(pp))


PIPELINE_PATTERNS = [
    case(
        "with_state a string",
        lambda: stackwise.pipeline(None, _apply, 4, ONE, microbatches=2, with_state="yes"),
        TypeError,
        "`with_state`",
        "True or False",
    ),
    case(
        "batched_state a string",
        lambda: _pattern(batched_state="k"),
        TypeError,
        "`batched_state`",
        "str 'k'",
    ),
    case(
        "batched_state returning an int",
        _batched_state_not_a_bool,
        TypeError,
        '`batched_state("[0][\'k\']")`',
        "must return a bool",
    ),
    case(
        "state of the wrong depth",
        _wrong_depth,
        ValueError,
        "pattern position 0",
        "stacked state",
        "['k']: shape (1, 4, 2)",
        "n=2",
    ),
    case(
        "state whose batch is not x's",
        _state_of_another_batch,
        ValueError,
        "state[0]['k']: shape (2, 4, 2)",
        "x's batch 6",
        "microbatches=2",
        "batched_state=False",
    ),
    case(
        "state without a batch axis split over the data axis",
        _unbatched_state_over_data,
        ValueError,
        "mesh axes 'data' (of `data_axis`) of size 2",
        "`data_axis=None`",
    ),
    case(
        "state without a batch axis split over the fsdp axis",
        _unbatched_state_over_fsdp,
        ValueError,
        "mesh axes 'data' (of `fsdp`) of size 2",
        "`fsdp=None`",
    ),
    case(
        "params of a pattern not a tuple",
        _params_not_a_tuple,
        TypeError,
        "tuple of 2 stacked trees",
        "got dict",
    ),
    case(
        "with_state apply without the state",
        _without_state,
        TypeError,
        "`apply(params, state, x, *args, **kwargs)`",
    ),
    case(
        "apply without x",
        _without_x,
        TypeError,
        "`apply(params, x, *args, **kwargs)`",
    ),
    case(
        "a layer returning its state in another shape",
        _state_of_another_shape,
        TypeError,
        "pattern position 1",
        "float32[4, 2]",
        "dynamic_update_slice",
    ),
    case(
        "a layer with state returning only x",
        _state_not_returned,
        TypeError,
        "position 1 returned one array float32[2, 2]",
        "`(out, layer_state)`",
    ),
    case(
        "has_aux but a layer returns only x",
        _aux_not_returned,
        TypeError,
        "`has_aux=True`",
        "position 0 returned one array",
    ),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", PIPELINE_PATTERNS)
def test_misuse_pipeline_patterns(call, error, words):
    assert_refused(call, error, words)

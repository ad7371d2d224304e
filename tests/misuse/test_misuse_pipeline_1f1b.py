"""The misuse catalogue of the 1F1B pipeline schedule (``schedule="1f1b", loss=``).

Checked before any device computes: a one-device (or abstract) mesh and abstract evaluation
will do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _misuse import assert_refused, case
from jax.sharding import AbstractMesh, Mesh

import stackwise

MESH = Mesh(np.array(jax.devices()[:1]), ("stage",))
PARAMS = {"w": jnp.ones((2, 3))}


def _apply(params, x, *args):
    return x * params["w"]


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def _1f1b(**kw):
    return stackwise.pipeline(None, _apply, 2, MESH, microbatches=2, schedule="1f1b", **kw)


def _call(pp, *args, **kwargs):
    return jax.eval_shape(lambda *a: pp.apply(*a, **kwargs), PARAMS, jnp.ones((4, 3)), *args)


MISUSES = [
    case(
        "1f1b without loss",
        lambda: _1f1b(),
        ValueError,
        "schedule='1f1b' needs `loss=`",
        "loss=lambda y, targets",
    ),
    case(
        "loss with the gpipe schedule",
        lambda: stackwise.pipeline(None, _apply, 2, MESH, microbatches=2, loss=_mse),
        ValueError,
        "`loss=`",
        "schedule='gpipe'",
        "schedule='1f1b'",
    ),
    case(
        "loss not a function",
        lambda: _1f1b(loss="mse"),
        TypeError,
        "`loss`",
        "loss(y, targets)",
        "str",
    ),
    case(
        "1f1b with has_aux",
        lambda: _1f1b(loss=_mse, has_aux=True),
        ValueError,
        "`has_aux=True`",
        "schedule='gpipe'",
    ),
    case(
        "interleaved 1f1b (repeats) on one stage",
        lambda: _1f1b(loss=_mse, repeats=2),
        ValueError,
        "'1f1b' schedule with repeats=2",
        "at least 2 stages",
        "repeats=1",
    ),
    case(
        "interleaved 1f1b with microbatches not a multiple of the stages",
        lambda: stackwise.pipeline(None, _apply, 8, AbstractMesh((2,), ("stage",)),
                                   microbatches=3, schedule="1f1b", loss=_mse, repeats=2),
        ValueError,
        "groups of S=2",
        "multiple of 2, got microbatches=3",
        "microbatches=2 or 4",
    ),
    case(
        "interleaved 1f1b with repeats not an int",
        lambda: _1f1b(loss=_mse, repeats=2.0),
        TypeError,
        "`repeats` must be a positive Python int",
    ),
    case(
        "1f1b apply without targets",
        lambda: _call(_1f1b(loss=_mse)),
        TypeError,
        "`targets`",
        "apply(params, x, targets, *args)",
    ),
    case(
        "1f1b with state, apply without targets",
        lambda: jax.eval_shape(
            _1f1b(loss=_mse, with_state=True, batched_state=False).apply,
            PARAMS,
            {"calls": jnp.zeros((2,))},
            jnp.ones((4, 3)),
        ),
        TypeError,
        "`targets`",
        "apply(params, state, x, targets, *args)",
    ),
    case(
        "1f1b targets of another batch",
        lambda: _call(_1f1b(loss=_mse), jnp.ones((2, 3))),
        ValueError,
        "`targets`",
        "batch is 4",
    ),
    case(
        "1f1b targets not divisible by the microbatches",
        lambda: _call(_1f1b(loss=_mse), {"t": jnp.ones((3, 3))}),
        ValueError,
        "`targets`",
        "['t']: shape (3, 3)",
    ),
    case(
        "1f1b loss that is not a scalar",
        lambda: _call(_1f1b(loss=lambda y, t: (y - t) ** 2), jnp.ones((4, 3))),
        TypeError,
        "`loss(y, targets)` must return one float scalar",
        "float32[2, 3]",
        "jnp.mean",
    ),
    case(
        "1f1b loss_params= with a loss of two arguments",
        lambda: _call(_1f1b(loss=_mse), jnp.ones((4, 3)), loss_params=jnp.ones(3)),
        TypeError,
        "`loss(y, targets, loss_params)`",
        "third argument",
    ),
    case(
        "1f1b loss that is an int",
        lambda: _call(_1f1b(loss=lambda y, t: jnp.sum(t)), jnp.ones((4,), jnp.int32)),
        TypeError,
        "`loss(y, targets)`",
        "int32[]",
    ),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", MISUSES)
def test_misuse_pipeline_1f1b(call, error, words):
    assert_refused(call, error, words)

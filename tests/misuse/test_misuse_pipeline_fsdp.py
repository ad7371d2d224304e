"""The misuse catalogue of FSDP inside pipeline stages: ``stackwise.pipeline(..., fsdp=,
fsdp_gather=)``.

Meshes are abstract (``AbstractMesh``: the arguments are checked before any device is
used) or of one device with axes of size 1 (a leaf placed over the FSDP axes in another
way than ``fsdp=`` says, found at call time). After the table, what must work: a batch
split over the FSDP axes without ``data_axis``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _misuse import assert_refused, case
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import stackwise

MESH = AbstractMesh((2, 2), ("stage", "data"))


def _apply(params, x):
    return x + jnp.tanh(x @ params["w"])


def _pipeline(mesh=MESH, **options):
    return stackwise.pipeline(None, _apply, 2, mesh, microbatches=1, **options)


def _placed_over(spec, fsdp, k=None):
    """A 1-device explicit mesh (stage, data, model: size 1 each), params placed with
    ``spec`` per layer, then applied with ``fsdp`` (traced only: the check is at trace
    time); with ``k``, a pattern of k layers (params: a tuple of k stacked trees)."""
    mesh = jax.make_mesh((1, 1, 1), ("stage", "data", "model"))
    params = {"w": jnp.zeros((2, 4, 4))} if k is None else ({"w": jnp.zeros((1, 4, 4))},) * k
    specs = {"w": spec} if k is None else ({"w": spec},) * k
    params = stackwise.shard_stacked(params, mesh, specs, layer_axis="stage")
    apply = _apply if k is None else [_apply] * k
    pp = stackwise.pipeline(None, apply, 2, mesh, microbatches=1, fsdp=fsdp)
    return jax.eval_shape(pp.apply, params, jnp.ones((2, 4)))


PIPELINE_FSDP = [
    case(
        "fsdp axis the mesh lacks",
        lambda: _pipeline(fsdp="fsdp"),
        ValueError,
        "`fsdp='fsdp'`",
        "not an axis of the mesh",
        "'data': 2",
    ),
    case(
        "one of the fsdp axes the mesh lacks",
        lambda: _pipeline(fsdp=("data", "fsdp")),
        ValueError,
        "names 'fsdp'",
    ),
    case("fsdp an int", lambda: _pipeline(fsdp=1), TypeError, "`fsdp`", "fsdp='data'"),
    case(
        "the stage axis as an fsdp axis",
        lambda: _pipeline(fsdp=("data", "stage")),
        ValueError,
        "names the stage axis 'stage'",
        "fsdp='data'",
    ),
    case(
        "an fsdp axis twice",
        lambda: _pipeline(fsdp=("data", "data")),
        ValueError,
        "`fsdp=('data', 'data')`",
        "twice",
    ),
    case(
        "fsdp_gather not a schedule of gathers",
        lambda: _pipeline(fsdp="data", fsdp_gather="layer"),
        ValueError,
        "`fsdp_gather`",
        "('step', 'tick')",
        "'layer'",
    ),
    case(
        "fsdp_gather without fsdp",
        lambda: _pipeline(fsdp_gather="tick"),
        ValueError,
        "`fsdp_gather='tick'`",
        "`fsdp` is not given",
        "fsdp='data'",
    ),
    case(
        "a leaf split over the fsdp axis and another axis at once",
        lambda: _placed_over(P(("data", "model")), "data"),
        ValueError,
        "leaf ['w']",
        "('data', 'model')",
        "stackwise.fsdp_specs",
    ),
    case(
        "a pattern's leaf split over the fsdp axis and another axis at once",
        lambda: _placed_over(P(("data", "model")), "data", k=2),
        ValueError,
        "leaf [0]['w']",
        "the stacked (layers, ...) layout",
        "stackwise.fsdp_specs",
    ),
    case(
        "a leaf split over the fsdp axes in the other order",
        lambda: _placed_over(P(("model", "data")), ("data", "model")),
        ValueError,
        "leaf ['w']",
        "in that order",
    ),
    case(
        "a batch that the microbatches times the fsdp axes do not divide",
        lambda: _pipeline(fsdp="data").apply({"w": jnp.zeros((2, 4, 4))}, jnp.ones((3, 4))),
        ValueError,
        "`x`",
        "'data' axis size 2",
    ),
]


@pytest.mark.parametrize("call, error, words", PIPELINE_FSDP)
def test_pipeline_fsdp_misuse(call, error, words):
    assert_refused(call, error, words)


@pytest.mark.parametrize("k", [None, 2])
def test_a_leaf_placed_as_fsdp_says_is_taken(k):
    # The same 1-device mesh and a placement over the one fsdp axis: no error, and the
    # output is split over the batch axes (the fsdp axis, then the stages); a pattern too.
    y = _placed_over(P("data"), "data", k)
    assert y.shape == (2, 4) and y.sharding.spec[0] == ("data", "stage")

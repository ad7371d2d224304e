"""The misuse catalogue of `stackwise.autostack`: one row per bad call, the error it must raise
and words its message must hold (the argument or leaf, and the fix)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _misuse import assert_refused, case
from jax.experimental import checkify
from jax.sharding import PartitionSpec as P

import stackwise

LAYERS = [{"w": jnp.eye(4) * 0.5} for _ in range(3)]
X = jnp.ones((2, 4))


def loop(params, x):
    for p in params:
        x = jnp.tanh(x @ p["w"])
    return x


def _made():
    return stackwise.autostack(loop, LAYERS, X)


def _call_other_shape():
    stacked, f = _made()
    f(stacked, jnp.ones((3, 4)))


def _call_other_structure():
    stacked, f = _made()
    f(stacked, (X,))


def _call_with_the_loop_params():
    _, f = _made()
    f(LAYERS, X)


def _call_with_missing_blocks():
    stacked, f = _made()
    f({"blocks": {}, "rest": stacked["rest"]}, X)


def _stack_other_params():
    _, f = _made()
    f.stack(LAYERS[:2])


def two_stacks(params, x):
    """Two runs: 3 layers of width 4, then 2 of width 6."""
    for p in params["a"]:
        x = jnp.tanh(x @ p["w"])
    x = x @ params["proj"]
    for p in params["b"]:
        x = jnp.sin(x @ p["w"])
    return x


TWO = {"a": LAYERS, "proj": jnp.ones((4, 6)), "b": [{"w": jnp.eye(6)} for _ in range(2)]}


def _call_with_the_layer_axis_split():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        stacked, f = _made()
        split = jax.tree.map(lambda a: jax.sharding.reshard(a, P("data")), stacked)
        f(split, X)


def checked(params, x):
    """A loop whose every layer calls `checkify.check`: an effect no scan of autostack's holds."""
    for p in params:
        x = jnp.tanh(x @ p["w"])
        checkify.check(jnp.all(x < 2), "too large")
    return x


ROWS = jnp.ones((4, 4, 2, 4))  # (a per-layer array: row i for layer i)


def rows_permuted(params, x, rows):
    """Layer i reads ``rows[perm[i]]``: static indices that are no arithmetic progression."""
    for p, j in zip(params, [0, 2, 1]):
        x = jnp.tanh(x @ p["w"] + rows[j, 0])
    return x


def rows_on_the_diagonal(params, x, rows):
    """Layer i reads ``rows[i, i]``: the index steps along two axes."""
    for i, p in enumerate(params):
        x = jnp.tanh(x @ p["w"] + rows[i, i])
    return x


def rows_of_the_carry(params, x):
    """Layer i reads row i of the carry, a value made in the run, not before it."""
    for i, p in enumerate(params):
        x = jnp.tanh(x @ p["w"] + x[i:i + 1])
    return x


def own_value_then_carry(params, x):
    """Block 0 adds its own product; the others add what they were given."""
    for i, p in enumerate(params):
        h = x @ p["w"]
        x = jnp.tanh(h) + (h if i == 0 else x)
    return x


def back_to_the_input(params, x):
    """Block 2 reads the loop's input where block 1 reads block 0's output."""
    x0 = x
    for i, p in enumerate(params):
        x = jnp.tanh((x if i != 2 else x0) @ p["w"])
    return x


def one_output_in_two_places(params, a, b):
    """Block 0 reads two inputs; block 1 reads block 0's one output in both places."""
    for p in params:
        z = jnp.tanh(a @ p["w"]) * b
        a, b = z, z
    return a


def swapped_outputs(params, a, b):
    """Block 1 hands its two outputs on swapped: block 2 reads another slot than block 1."""
    for i, p in enumerate(params):
        u, v = jnp.tanh(a @ p["w"]), jnp.sin(b @ p["w"])
        a, b = (u, v) if i != 1 else (v, u)
    return a + b


def two_blocks_back(params, x):
    """Each block adds the output of the block two before it (the input, for the first two)."""
    a, b = x, x
    for p in params:
        a, b = jnp.tanh(a @ p["w"]) + b, a
    return a


AUTOSTACK = [
    case("fn not callable", lambda: stackwise.autostack("loop", LAYERS, X), TypeError,
         "`fn` must be callable", "stackwise.autostack(fn, params"),
    case("a params leaf that is not an array",
         lambda: stackwise.autostack(loop, [{"w": 0.5}, {"w": 0.5}], X), TypeError,
         "params[0]['w']", "example_args"),
    case("no params", lambda: stackwise.autostack(loop, [], X), ValueError, "no leaves"),
    case("n below 2", lambda: stackwise.autostack(loop, LAYERS, X, n=1), ValueError,
         "`n` must be at least 2"),
    case("n a float", lambda: stackwise.autostack(loop, LAYERS, X, n=3.0), TypeError, "`n`"),
    case("best_effort not a bool",
         lambda: stackwise.autostack(loop, LAYERS, X, best_effort="yes"), TypeError,
         "`best_effort` must be True or False"),
    case("remat=jax.checkpoint", lambda: stackwise.autostack(loop, LAYERS, X,
                                                             remat=jax.checkpoint),
         TypeError, "`remat`", "remat=True"),
    case("n that is not the loop's", lambda: stackwise.autostack(loop, LAYERS, X, n=4),
         ValueError, "`n=4` blocks were expected, but 3 were found"),
    case("an argument of another shape", _call_other_shape, TypeError,
         "float32[3, 4]", "call `stackwise.autostack` again"),
    case("arguments of another structure", _call_other_structure, TypeError, "`args`"),
    case("the loop's params instead of the stacked", _call_with_the_loop_params, TypeError,
         "`stacked_params`", "f.stack(params)"),
    case("stacked params without their blocks", _call_with_missing_blocks, TypeError,
         "stacked_params['blocks']"),
    case("stack of params of another structure", _stack_other_params, TypeError, "`params`"),
    case("n an empty tuple", lambda: stackwise.autostack(loop, LAYERS, X, n=()), TypeError,
         "`n` must be None, an int", "a tuple of ints"),
    case("n a tuple holding a float",
         lambda: stackwise.autostack(two_stacks, TWO, X, n=(3, 2.0)), TypeError,
         "`n` must be None, an int", "(3, 2.0)"),
    case("n a tuple holding a count below 2",
         lambda: stackwise.autostack(two_stacks, TWO, X, n=(3, 1)), ValueError,
         "`n` must be at least 2", "(3, 1)"),
    case("n an int where two runs are found",
         lambda: stackwise.autostack(two_stacks, TWO, X, n=3), ValueError,
         "`n=3` expects one run, but 2 were found", "pass `n=(3, 2)`"),
    case("n a tuple of another count of runs",
         lambda: stackwise.autostack(two_stacks, TWO, X, n=(3, 2, 2)), ValueError,
         "`n=(3, 2, 2)` expects 3 runs, but 2 were found"),
    case("n a tuple whose count of a run differs",
         lambda: stackwise.autostack(two_stacks, TWO, X, n=(3, 4)), ValueError,
         "`n=(3, 4)`: run 1", "has 2 blocks, not 4"),
    case("stacked params with the layer axis split over an explicit mesh axis",
         _call_with_the_layer_axis_split, ValueError,
         "`stacked_params['blocks'][\"[0]['w']\"]` is float32[3@data,4,4]",
         "layer axis is split over the mesh axis 'data'",
         "jax.sharding.reshard(leaf, P(None, None, None))"),
    case("a loop whose layers have an effect other than a callback's",
         lambda: stackwise.autostack(checked, LAYERS, X), ValueError,
         "(`check`", "the effect `ErrorEffect`", "only callbacks' effects",
         "`jax.debug.callback`", "best_effort=True"),
    case("blocks slicing one array at static indices that are no arithmetic progression",
         lambda: stackwise.autostack(rows_permuted, LAYERS, X, ROWS), ValueError,
         "(`slice`", "its param `start_indices` is", "no arithmetic progression",
         "pass each layer's value in its params"),
    case("blocks slicing one array at a static index stepping along two axes",
         lambda: stackwise.autostack(rows_on_the_diagonal, LAYERS, X, ROWS), ValueError,
         "breaks at block 1", "its param `start_indices` is (1, 1, 0, 0)",
         "along 2 axes, not one"),
    case("blocks slicing a value made in the run at static indices stepping alike",
         lambda: stackwise.autostack(rows_of_the_carry, LAYERS, jnp.ones((4, 4))), ValueError,
         "breaks at block 1", "its param `start_indices` is (1, 0)",
         "not one array from before the run"),
    # Blocks of one computation whose operands come from elsewhere, each named.
    case("a block reading its given value where block 0 reads its own",
         lambda: stackwise.autostack(own_value_then_carry, LAYERS, X), ValueError,
         "breaks at block 1", "(`add`", "reads the previous block's equation 2 output",
         "where block 0 reads its own equation 0's output", "best_effort=True"),
    case("a block reading the input where the block before read the carry",
         lambda: stackwise.autostack(back_to_the_input, LAYERS, X), ValueError,
         "broken at block 2", "(`dot_general`",
         "reads a value from before the run where block 1 reads block 0's"),
    case("one output read where block 0 reads two values",
         lambda: stackwise.autostack(one_output_in_two_places, LAYERS, X, 2 * X), ValueError,
         "(`mul`", "reads block 0's equation 2 output at two places",
         "where block 0 reads two different values"),
    case("outputs handed on in another order",
         lambda: stackwise.autostack(swapped_outputs, LAYERS, X, 2 * X), ValueError,
         "broken at block 2", "where block 1 reads another value"),
    case("a block reading the output of two blocks back",
         lambda: stackwise.autostack(two_blocks_back, LAYERS, X), ValueError,
         "broken at block 2", "2 blocks back",
         "a block reads only its own values, the previous block's, and values from before "
         "the run"),
]


@pytest.mark.parametrize("call, error, words", AUTOSTACK)
def test_refused(call, error, words):
    assert_refused(call, error, words)

"""The misuse catalogue of multi-LoRA serving, `stackwise.lora.attach(base, batch, rows=idx)`:
one row per bad call, the error it must raise and the words its message must hold (the
argument, what was expected and what came).

Indices out of range are refused when concrete; traced ones (under jit) are not checked and
run the base alone, as -1 does (tests/finetune/test_adapters_rows.py)."""

from __future__ import annotations

from functools import partial

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _misuse import assert_refused, case

import stackwise
import stackwise.equinox
import stackwise.haiku

KEY = jax.random.key(0)
BASE = {"w": jnp.ones((3, 4, 4))}
ONE = stackwise.lora.init(KEY, BASE, rank=2)
BATCH = stackwise.lora.stack_adapters([ONE, ONE, ONE])  # g = 3
X = jnp.ones((2, 4))
attach = stackwise.lora.attach


def _run(apply, rows=(0, -1), x=X, **options):
    layers = stackwise.lora.stack(apply, 3, **options)
    return layers.apply(attach(BASE, BATCH, rows=jnp.asarray(rows)), x)


def _cache_without_the_rows():
    def layer(p, cache, x):
        return x @ p["w"], cache

    layers = stackwise.lora.stack(layer, 3, with_state=True)
    layers.apply(attach(BASE, BATCH, rows=[0, 1]), jnp.zeros((3, 5, 4)), X)


def _with_and_without_rows():
    two = {"w": BASE["w"], "v": BASE["w"]}
    adapters = stackwise.lora.stack_adapters([stackwise.lora.init(KEY, two, rank=2)] * 2)
    params = {"w": attach(two["w"], adapters["w"], per_leaf=True, rows=[0, 1]),
              "v": attach(two["v"], adapters["v"], per_leaf=True)}
    stackwise.lora.stack(lambda p, x: x @ p["w"] @ p["v"], 3).apply(params, jnp.ones((2, 2, 4)))


def _haiku_state_per_row():
    def block(x):
        total = hk.get_state("total", (4,), jnp.float32, jnp.zeros)
        hk.set_state("total", total + x.sum(0))  # from the row's own values
        return hk.Linear(4)(x)

    forward = hk.transform_with_state(lambda x: stackwise.haiku.Stack(block, n=3)(x))
    params, state = forward.init(KEY, X)
    batch = stackwise.lora.stack_adapters([stackwise.lora.init(KEY, params, rank=2)] * 2)
    forward.apply(attach(params, batch, per_leaf=True, rows=[0, 1]), state, None, X)


def _equinox_one_example():
    stack = stackwise.equinox.Stack(partial(eqx.nn.Linear, 4, 4), 3, key=KEY)
    one = stackwise.lora.init(KEY, stack, rank=2)
    attach(stack, stackwise.lora.stack_adapters([one, one]), per_leaf=True, rows=[0, 1])(
        jnp.ones(4))


def _ranks_2_and_3():
    three = stackwise.lora.init(KEY, BASE, rank=3)
    stackwise.lora.stack_adapters([ONE, three])


def _another_depth():
    short = stackwise.lora.stack_adapters([stackwise.lora.init(KEY, {"w": BASE["w"][:2]},
                                                               rank=2)] * 2)
    attach(BASE, short, rows=[0, 1])


def _both_axes_contracted(p, x):  # a product over both axes of the weight
    return x + jnp.einsum("ij,ij->", jnp.outer(x[0], x[0]), p["w"])


CASES = [
    case("rows with a compute dtype", lambda: _run(lambda p, x: x @ p["w"], dtype=jnp.bfloat16),
         ValueError, "`dtype=bfloat16`", "rows=", "leave `dtype` None"),
    case("rows with one adapter, not a batch",
         lambda: attach(BASE, ONE, rows=[0, 0]), ValueError, "`rows`", "one adapter",
         "stack_adapters"),
    case("rows of floats", lambda: attach(BASE, BATCH, rows=jnp.array([0.0, 1.0])), TypeError,
         "`rows`", "integer", "float32"),
    case("rows as a list of floats", lambda: attach(BASE, BATCH, rows=[0.0, 1.0]), TypeError,
         "`rows`", "int array", "list"),
    case("rows of bools", lambda: attach(BASE, BATCH, rows=np.array([True, False])),
         TypeError, "`rows`", "integer", "bool"),
    case("rows as one int", lambda: attach(BASE, BATCH, rows=1), TypeError, "`rows`",
         "int array", "int"),
    case("rows of shape (2, 1)", lambda: attach(BASE, BATCH, rows=jnp.zeros((2, 1), int)),
         ValueError, "`rows`", "shape (batch,)", "(2, 1)"),
    case("an index past the batch of 3", lambda: attach(BASE, BATCH, rows=[0, 3]), ValueError,
         "`rows`", "[3]", "outside [-1, 3)"),
    case("an index below -1", lambda: attach(BASE, BATCH, rows=[-2, 0]), ValueError, "[-2]",
         "outside [-1, 3)", "-1 runs a row on the base"),
    case("rows with DoRA adapters", lambda: attach(BASE, stackwise.lora.stack_adapters(
        [stackwise.lora.init(KEY, BASE, rank=2, dora=True)] * 2), rows=[0, 1]), ValueError,
         "`rows`", "DoRA", "['w']"),
    case("adapters of ranks 2 and 3 in one batch", _ranks_2_and_3, ValueError,
         "adapters[1]['w']", "rank 3", "rank 2", "one rank"),
    case("adapters of other widths in one batch", lambda: stackwise.lora.stack_adapters(
        [ONE, stackwise.lora.init(KEY, {"w": jnp.ones((3, 5, 4))}, rank=2)]), ValueError,
         "adapters[1]['w'].a", "(3, 5, 2)", "(3, 4, 2)"),
    case("a batch with 2 layers on a base of 3", _another_depth, ValueError, "2 layers",
         "n=3", "adapters of another depth"),
    case("x of 3 rows where rows picks for 2", lambda: _run(lambda p, x: x @ p["w"],
                                                            x=jnp.ones((3, 4))),
         ValueError, "`rows` for 2 rows", "`x` has shape (3, 4)"),
    case("a cache without the rows leading", _cache_without_the_rows, ValueError,
         "`state` has shape (5, 4)", "KV cache of shape (batch, ...)"),
    case("an adapted weight used in an elementwise product",
         lambda: _run(lambda p, x: x * p["w"].sum(0)[None]), ValueError, "['w']",
         "only in a matrix product", "`reduce_sum`"),
    case("an adapted weight returned", lambda: _run(lambda p, x: (x, p["w"]), has_aux=True),
         ValueError, "['w']", "returns it"),
    case("an adapted weight in a product over both its axes",
         lambda: _run(_both_axes_contracted), ValueError, "['w']", "dimension numbers"),
    case("an adapted weight times itself", lambda: _run(lambda p, x: x @ (p["w"] @ p["w"])),
         ValueError, "['w']", "`dot_general`"),
    case("one layer's adapters attached with rows and without", _with_and_without_rows,
         ValueError, "mix adapters attached with `rows` and without"),
    case("Haiku state updated from each row", _haiku_state_per_row, ValueError,
         "stackwise.haiku.Stack", "different for each row", "with_state=True"),
    case("rows on an Equinox Stack's one example", _equinox_one_example, ValueError,
         "stackwise.equinox.Stack", "`rows` for 2 rows", "`x` has shape (4,)"),
    case("a batch serving groups, with a KV cache", lambda: stackwise.lora.stack(
        lambda p, c, x: (x @ p["w"], c + x.sum()), 3, with_state=True).apply(
            attach(BASE, BATCH), jnp.zeros((3, 4)), jnp.ones((3, 2, 4))), ValueError,
         "different for each group", "rows=rows"),
]


@pytest.mark.every_case
@pytest.mark.parametrize(("call", "error", "words"), CASES)
def test_misuse(call, error, words):
    assert_refused(call, error, words)

"""The example trains through `stackwise.optax.layerwise`: its first steps with
``--optimizer muon`` and ``lamb`` equal the plain optimizer's on the loop model's params
(``lm.to_loop``; the example's own tests check that the stack and the loop compute the same
logits). Both get the same gradients, the stack's, laid out by
``lm.to_loop`` for the loop: Adam's first steps turn a gradient's rounding into a relative
change of its update where the gradient is near zero, which would drown what is compared."""

from __future__ import annotations

import math

import jax
import optax
import pytest
from _scripts import load_example
from _tolerance import LAMBDA, check, compare

pytestmark = pytest.mark.slow  # compiles the LM's step and Muon's orthogonalisation

STEPS = 2
# The stacked model's params within LOOP_BOUND * eps * (the leaf's largest magnitude) of the loop
# model's (tests/_tolerance.py): the same optimizer arithmetic, batched or not, each step's update
# (LAMB's norms and Muon's orthogonalisation: sums over a layer's 16 x 64 matrix) within
# LAMBDA * sqrt(1024) eps of itself, at most 0.1 of the params (lr = 1e-2), and each step's sum
# rounded to the params' float32 (1 eps): STEPS * (1 + 0.1 * 6 * 32) = 41 eps.
LOOP_BOUND = math.ceil(STEPS * (1 + 0.1 * LAMBDA * math.sqrt(16 * 64)))


@pytest.fixture(scope="module")
def example():
    """The example's package, and one tiny LM with its jitted gradient function, shared by the
    optimizers (one compile of the gradients)."""
    module = load_example()
    lm_models = module.model
    lm = lm_models.build(FRAMEWORK, lm_models.Config(vocab=11, layers=2, d_model=16, heads=2,
                                                     seq_len=8))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 11)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    grads = jax.jit(jax.grad(lambda p: lm_models.loss_fn(lm, p, inputs, targets)))
    return module, lm, lm.init(jax.random.key(0)), grads


# Every framework's params name the stacked leaves "blocks" (what make_optimizer relies on):
# tests/optax/test_optax_adapters.py trains each adapter's tree. Compiling the LM's step with
# Muon costs several seconds of CPU, so one framework here.
FRAMEWORK = "jax"


@pytest.mark.parametrize("optimizer", ["muon", "lamb"])
def test_first_steps_equal_the_loop_model(example, optimizer):
    t, lm, params, grads = example
    args = t.cli.parse_args(["--optimizer", optimizer, "--steps", "10", "--lr", "1e-2"])
    t.run.settle_args(args, None, t.cli.RUN_DEFAULTS)
    stacked_tx = t.train.make_optimizer(args)
    loop_tx = t.train.make_optimizer(args, layerwise=False)

    def step_of(tx, layout=lambda g: g):
        @jax.jit
        def step(params, state, grads):
            updates, state = tx.update(layout(grads), state, params)
            return optax.apply_updates(params, updates), state
        return step

    # Separate programs: XLA compiles the Newton-Schulz steps of one faster than of all. Each
    # compiles once (the states `init` makes are placed as the steps' outputs are:
    # tests/optax/test_optax_wrapper.py::test_state_placed_as_the_params_are).
    stacked_step, plain_step = step_of(stacked_tx), step_of(loop_tx)
    loop_step = step_of(loop_tx, lm.to_loop)  # the stack's gradients, as the loop holds them
    stacked, loop, plain = params, lm.to_loop(params), params
    states = stacked_tx.init(stacked), loop_tx.init(loop), loop_tx.init(plain)
    for _ in range(STEPS):
        g = grads(stacked)
        (stacked, s1), (loop, s2), (plain, s3) = (
            stacked_step(stacked, states[0], g), loop_step(loop, states[1], g),
            plain_step(plain, states[2], g))
        states = s1, s2, s3
    got, want = jax.tree.leaves(lm.to_loop(stacked)), jax.tree.leaves(loop)
    assert len(got) == len(want)
    check(compare(got, want), LOOP_BOUND, optimizer)
    assert compare(jax.tree.leaves(lm.to_loop(params)), want)["in_eps"] > 100 * LOOP_BOUND
    # Unwrapped, the same optimizer given the same gradients on the stacked params would train
    # another model.
    assert compare(jax.tree.leaves(lm.to_loop(plain)), want)["in_eps"] > 10 * LOOP_BOUND

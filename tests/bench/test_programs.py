"""stackwise.bench.programs: whether two compiled programs are the same, up to names."""

import jax
import jax.numpy as jnp

from stackwise.bench import instructions_unlike, program_fingerprint, program_instructions

D = 4
X = jnp.ones((2, D))


def _compiled(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


def test_instructions_of_a_renamed_program_are_the_same_and_of_another_differ():
    w = jnp.ones((D, D))
    same = _compiled(lambda a, b: jnp.tanh(b @ a), w, X)
    ref = _compiled(lambda w, x: jnp.tanh(x @ w), w, X)
    other = _compiled(lambda w, x: jnp.sin(x @ w), w, X)
    assert program_fingerprint(same) == program_fingerprint(ref)
    assert instructions_unlike(program_instructions(same), program_instructions(ref)) == 0
    assert program_fingerprint(other) != program_fingerprint(ref)
    # tanh -> sin: one instruction (or fusion) on each side at least
    assert instructions_unlike(program_instructions(other), program_instructions(ref)) >= 2

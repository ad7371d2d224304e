"""Strict numerics for every test (as in equinox's conftest)."""

import jax

# Implicit rank promotion hides shape bugs in layer code; make it an error.
jax.config.update("jax_numpy_rank_promotion", "raise")

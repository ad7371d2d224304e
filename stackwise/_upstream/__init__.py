"""Every tie to a library's internals, one module per library and concern, dated and guarded.

Lowest layer of the package, below :mod:`stackwise._core`; it imports nothing of stackwise.

- :mod:`.jax`: what stackwise relies on in JAX beyond its public API: the jaxpr evaluation
  loop that finds a layer's in-place state updates, and the primitive names the remat
  policies match (``reshard``, ``all_gather``, ``name``, the slices and their params).
- :mod:`.jax_functions`: how JAX holds functions in a traced equation's params (its own
  plumbing around a custom rule, ``WrappedFun``, ``jax.core.Tracer``), which
  :func:`stackwise.autostack` reads to tell two blocks' custom rules alike, and which
  callbacks' effects a block may hold to be stacked.
- :mod:`.peft`: PEFT's rules (mirrored, peft is never imported) for which module of a model
  gets a LoRA adapter and of what rank and alpha: ``rank_pattern``, ``alpha_pattern``,
  ``layers_to_transform``, ``layers_pattern``, ``exclude_modules``. Its test compares them
  with peft's own functions where peft is installed.

Each tie is a function that names the version it mirrors, what it relies on and what breaks
if upstream changes. Each has a probe that the fast tier runs (``tests/*/test_upstream_*``)
and that the code runs once, on first use: when a tie no longer holds, a warning names it and
the code takes an exact path instead (slower, or saving less, never a different result).
:mod:`.peft` mirrors a file format's meaning, with peft never imported: it has no runtime
probe, and its test runs where peft is installed.
"""

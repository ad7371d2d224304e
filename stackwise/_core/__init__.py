"""The core: one layer stacked ``n`` times and run as one scan (jax and numpy only).

Lowest layer of the package but :mod:`stackwise._upstream` (the ties to JAX internals,
which :mod:`.inplace` and the remat policies call); it imports nothing else of stackwise.

- :mod:`.stack`: :func:`stackwise.stack` and :class:`Stacked` (scan, remat, state, unroll).
- :mod:`.options`: the stack's options, validated once (also by the pipeline and adapters).
- :mod:`.markers`: per-layer and per-example arguments (``per_layer``, ``layer_index``, ...).
- :mod:`.inplace`: state leaves a layer updates in place (KV caches written per layer).
- :mod:`.gather`: ``fsdp=``'s per-layer all-gather inside the loop.
- :mod:`.layout`: ``stack_layers`` / ``unstack_layers`` / ``slice_layers``.
- :mod:`.convert`: bitwise stacking and unstacking, pattern depths, layer names.
- :mod:`.checks` and :mod:`.trees`: the argument checks and the tree helpers all layers share.
"""

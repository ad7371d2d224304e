"""Checkpoints of stacked params: streamed, sharded loads and saves, in the loop's layout.

Above the core and sharding.

- :mod:`.read`: :func:`stackwise.open_checkpoint` (safetensors, an index, orbax, ``.npz``).
- :mod:`.names`: :class:`stackwise.Tensor` and how a leaf's layers are named in a file.
- :mod:`.load`: :func:`stackwise.load_checkpoint` (each device reads its own shard);
  :mod:`.placements`: its ``shardings``, read against the target.
- :mod:`.save`: ``save_safetensors`` / ``save_orbax``.
- :mod:`.inspect`: :func:`stackwise.inspect_checkpoint`.
- :mod:`.staging`: a save claimed, staged and moved into place, all or nothing.
- :mod:`.hosts`: several JAX processes writing one checkpoint.
"""

"""Checkpoints of stacked params: streamed, sharded loads and saves, in the loop's layout.

Above the core and sharding (and the quantizer of :mod:`stackwise._finetune.quant`).

- :mod:`.read`: :func:`stackwise.open_checkpoint` (safetensors, an index, orbax, ``.npz``).
- :mod:`.names`: :class:`stackwise.Tensor` and how a leaf's layers are named in a file.
- :mod:`.load`: :func:`stackwise.load_checkpoint` (each device reads its own shard);
  :mod:`.placements`: its ``shardings``, read against the target; :mod:`.quantized`: its
  ``quantize``, each chosen leaf quantized one layer at a time as it is read.
- :mod:`.save`: ``save_safetensors`` / ``save_orbax``.
- :mod:`.inspect`: :func:`stackwise.inspect_checkpoint`.
- :mod:`.staging`: a save claimed, staged and moved into place, all or nothing.
- :mod:`.hosts`: several JAX processes writing one checkpoint.
"""

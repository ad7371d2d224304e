"""Sharding stacked params: specs with the layer axis, FSDP specs, logical axis names.

Above the core; below the pipelines and checkpoints.

- :mod:`.specs`: ``stacked_spec`` / ``stacked_shardings`` (a per-layer spec, layer axis first).
- :mod:`.fsdp`: ``fsdp_specs`` and ``shard_stacked``.
- :mod:`.logical`: ``logical_specs`` (logical axis names to mesh axes).
"""

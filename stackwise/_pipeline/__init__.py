"""Pipeline parallelism over stacked layers: GPipe, circular and (interleaved) 1F1B.

Above the core and sharding.

- :mod:`.api`: :func:`stackwise.pipeline`, its argument checks and plan.
- :mod:`.program`: the device program of a tick loop (GPipe and circular).
- :mod:`.pattern`: a pattern of k layers, and layers with state, as one stage.
- :mod:`.schedule_1f1b`: the 1F1B schedule's program (forward and backward interleaved).
- :mod:`.stage_fsdp`: FSDP inside the stages (gathers per step or per tick).
"""

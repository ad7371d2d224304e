"""Pipeline parallelism over stacked layers: GPipe, circular and (interleaved) 1F1B.

Above the core and sharding.

- :mod:`.api`: :func:`stackwise.pipeline`, its argument checks, and its apply (one for
  every schedule, pattern and state).
- :mod:`.program`: the plan, the params' layouts on the devices, the :class:`Stage` the
  schedules run and its state.
- :mod:`.pattern`: a pattern of k layers, and layers with state, laid out on the stages.
- :mod:`.ticks`: which microbatch and chunk each stage runs at each tick (integers).
- :mod:`.schedule_gpipe`: the GPipe and circular schedules' tick loop.
- :mod:`.schedule_1f1b`: the 1F1B schedule's program (forward and backward interleaved).
- :mod:`.stage_fsdp`: FSDP inside the stages (gathers per step or per tick).
"""

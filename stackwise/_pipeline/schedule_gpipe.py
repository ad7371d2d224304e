"""The GPipe and circular schedules: one device's tick loop.

Every stage runs its chunks on one microbatch per tick, in the order of
``ticks.circular_order``; :func:`jax.lax.ppermute` hands each tick's output to the
next stage (round the ring, V > 1, where stage 0 parks what comes back until its
microbatch's next round). The stage's state, if any, is read before the chunk runs and
written after it (``program.StageState``); bubble ticks write nothing. The backward
pass is JAX's, of this loop. The same :class:`program.Stage` runs in the 1F1B schedule
(``schedule_1f1b.py``), whose primal, without differentiation, is this loop.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from stackwise._core.options import Options
from stackwise._pipeline import stage_fsdp, ticks
from stackwise._pipeline.program import (
    Plan,
    Stage,
    chunk_rows,
    never_sliced,
    nth,
    select,
    split_batch,
    stack_rows,
    vary,
)


def device_program(
    stage: Stage, options: Options, plan: Plan, out_spec: PartitionSpec,
    params, state, per_layer, x, examples, consts, gather=None,
):  # fmt: skip
    """What one device runs: its V chunks over the ``M*V + S - 1`` ticks: ``(y, aux, new
    state)``. With FSDP, ``gather`` gathers the stage's params before the tick loop
    (``fsdp_gather="step"``), or each tick gathers its chunk's (``"tick"``)."""
    M, V = plan.M, plan.V
    s = jax.lax.axis_index(plan.stage_axis)
    d = jax.lax.axis_index(plan.batch_axes) if plan.batch else 0
    # Cast the loop-invariant inputs once, so that their gradients are summed
    # over the data axis (and the consts' over the stages) once, outside the loops.
    params, state, per_layer, x, examples, consts = vary(
        (params, state, per_layer, x, examples, consts), plan.manual
    )
    # This device's chunks as (V*R, ...) stacks, chunk r at rows r*R:(r+1)*R.
    stacks = (stack_rows(params, stage.lead), stack_rows(per_layer, 2))
    if gather is not None:
        stacks = (gather(stacks[0]), stacks[1])
    state = stage.state.enter(state)
    mbs, examples = split_batch(x, M), split_batch(examples, M)
    per_tick = plan.fsdp and plan.gather == "tick"

    def gathered(chunk):  # the chunk's params gathered at this tick (FSDP per tick)
        return (stage_fsdp.gather(chunk[0], stage.dims, plan), chunk[1]) if per_tick else chunk

    def run_stage(stacks, r, h, st, m):
        """This stage's chunk r on microbatch m (index d*M + m over the whole batch)."""
        chunk = gathered(chunk_rows(stacks, r, V))
        return stage.run(chunk, h, st, d * M + m, nth(examples, m), consts)

    if per_tick:  # the gathered chunk, taken and gathered again, never saved
        shapes = jax.eval_shape(lambda c: gathered(chunk_rows(c, 0, V))[0], stacks)
        policy = stage_fsdp.per_tick_policy(options, stacks, shapes, V)
        run_stage = jax.checkpoint(run_stage, prevent_cse=False, policy=policy)
    elif V > 1:  # a per-tick slice, taken again in the backward pass rather than saved
        policy = never_sliced(stacks, options, V)
        run_stage = jax.checkpoint(run_stage, prevent_cse=False, policy=policy)
    st0 = stage.state.take(state, 0, 0)
    aux_shape = jax.eval_shape(run_stage, stacks, 0, nth(mbs, 0), st0, 0)[1]
    aux0 = jax.tree.map(lambda a: jnp.zeros((V, *a.shape), a.dtype), aux_shape)

    def tick(carry, t):
        """Tick t: stage s runs step t - s (``ticks.circular_order``)."""
        h, parked, state, aux = carry
        valid, m, r, h, parked = _entering(plan, mbs, s, h, parked, t)
        st = stage.state.take(state, r, m)
        (out, new), layer_aux = run_stage(stacks, r, h, st, m)
        state = stage.state.put(state, select(valid, new, st), r, m)
        aux = _add_aux(aux, layer_aux, valid, r)
        return (_pass_on(out, plan), parked, state, aux), out

    parked = jax.tree.map(jnp.zeros_like, mbs) if V > 1 else None
    carry = vary((nth(mbs, 0), parked, state, aux0), plan.manual)
    (_, _, state, aux), ys = jax.lax.scan(tick, carry, jnp.arange(plan.ticks))
    # The last stage finished microbatch m (last round) at tick T - M + m.
    y = jax.tree.map(lambda v: v[plan.ticks - M :].reshape(-1, *v.shape[2:]), ys)
    return _gather_output(y, s, plan, out_spec), _gather_aux(aux, s, plan), stage.state.leave(state)


def _entering(plan, mbs, s, h, parked, t):
    """What stage s runs at tick t (``ticks.circular_order``): whether it is a real step,
    its microbatch m and round r, its input and the parked microbatches."""
    S, V, M = plan.S, plan.V, plan.M
    k = ticks.forward_step(t, s)
    valid = ticks.is_step(k, M, V)
    m, r = ticks.circular_order(jnp.clip(k, 0, M * V - 1), M)
    fresh = nth(mbs, m)
    if V > 1:
        # What reached stage 0 came round the ring: park it until its microbatch's next
        # round comes up.
        back = ticks.returned_step(t, S)
        arrived = (s == 0) & ticks.is_step(back, M, V)
        slot, _ = ticks.circular_order(jnp.clip(back, 0, M * V - 1), M)
        parked = jax.tree.map(
            lambda b, v: jax.lax.dynamic_update_index_in_dim(
                b, jnp.where(arrived, v, nth(b, slot)), slot, 0
            ),
            parked,
            h,
        )
        fresh = select(r == 0, fresh, nth(parked, m))
    return valid, m, r, select(s == 0, fresh, h), parked


def _add_aux(aux, layer_aux, valid, r):
    """Chunk r's aux of this tick added to its running sum (nothing on a bubble tick)."""
    return jax.tree.map(
        lambda acc, a: jax.lax.dynamic_update_index_in_dim(
            acc, nth(acc, r) + jnp.where(valid, a, jnp.zeros_like(a)), r, 0
        ),
        aux,
        layer_aux,
    )


def _pass_on(out, plan):
    """This tick's output to the next stage (round the ring with the circular schedule)."""
    S = plan.S
    ring = [(i, (i + 1) % S) for i in range(S if plan.V > 1 else S - 1)]
    return jax.lax.ppermute(out, plan.stage_axis, ring) if S > 1 else out


def _gather_output(y: Any, s: Any, plan: Plan, out_spec: PartitionSpec) -> Any:
    """The last stage's outputs, split over the stages (or, if they do not divide, to all)."""
    last = s == plan.S - 1

    def one(v):
        v = jnp.where(last, v, jnp.zeros_like(v))
        cast = v.dtype == jnp.bool_
        v = v.astype(jnp.int8) if cast else v
        if out_spec == PartitionSpec(plan.batch):
            v = jax.lax.psum(v, plan.stage_axis)
        else:
            v = jax.lax.psum_scatter(v, plan.stage_axis, scatter_dimension=0, tiled=True)
        return v.astype(jnp.bool_) if cast else v

    return jax.tree.map(one, y)


def _gather_aux(aux: Any, s: Any, plan: Plan) -> Any:
    """Each stage's ``(V, L, ...)`` aux into ``(n, ...)`` in layer order, on every device."""
    S, V = plan.S, plan.V

    def one(a):
        full = jnp.zeros((V, S, *a.shape[1:]), a.dtype)
        full = jax.lax.dynamic_update_index_in_dim(full, a, s, 1)
        full = jax.lax.psum(full, plan.manual)
        return full.reshape(plan.n, *a.shape[2:])

    return jax.tree.map(one, aux)

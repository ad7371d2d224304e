"""The 1F1B (one-forward-one-backward) pipeline schedule: a loss and its gradients.

With ``jax.grad`` around a forward pipeline the backward pass starts only after
all M forwards, so every microbatch's activations live until then (GPipe). 1F1B
starts a microbatch's backward as soon as its forward leaves the last stage, so
the loss is part of the schedule: :func:`loss_and_grads` is a
:func:`jax.custom_vjp` function of the pipeline's inputs whose value is the mean
of ``loss(y_m, targets_m[, loss_params])`` over the microbatches (and, with state, of
the new state). Its forward rule runs the whole schedule and returns the gradients as
the residual (the backward rule only scales them by the incoming cotangent); without
differentiation the primal runs, the plain GPipe (circular, for V > 1) forward and the
loss.

What a stage runs comes from the pipeline that builds it, as a ``program.Stage``: "run
chunk r of this stage on microbatch m", its params' layout and FSDP split, and how its
state is carried; the GPipe schedule (``schedule_gpipe.py``) runs the same stage.

The schedule, on stage s of S holding V chunks of L layers (chunks s, s + S, ...; V = 1
unless interleaved, ``repeats=V``); all stages in lockstep over ``T = M*V + V*S + S - 2``
ticks (``M + 2S - 2`` for V = 1), in three ``lax.scan`` s (``ticks.one_f_one_b_phases``):
the first ``V*S - 1`` ticks run forwards only, the last ``V*S - 1`` backwards only, the
ones between both. A stage's steps are numbered (``ticks.py``)
``k = g*S*V + r*S + i`` (Megatron's interleaved order: microbatches in groups of S, each
group going round the ring V times): step k is microbatch ``g*S + i`` on the stage's chunk
r. At tick t the stage runs the forward of step ``t - s`` and the backward of step
``t - (V*S - 1) - (S - 1 - s)``, whose rounds count down from V - 1 (each masked outside
``[0, M*V)``). So the last stage runs a microbatch's last forward, its loss and the first
step of its backward in the same tick; activations go one stage on per tick and
cotangents one stage back (``ppermute``, round the ring for V > 1), and what leaves one
end of the ring reaches the other end exactly when the next (previous) round needs it:
nothing waits. The forward's input is kept in a ring of ``K = min(M*V, 2*V*S - 1)``
slots, by forward step (an input lives at most ``2VS - 2`` ticks), with the state that
forward read (a batched leaf's rows of the microbatch, an unbatched leaf's whole chunk);
the backward is :func:`jax.vjp` of the stage's chunk, recomputed from that input and
that state, which is not differentiated (no gradient flows through the state, from one
microbatch to the next either). The forwards write the new state as the GPipe schedule's
tick loop does: each chunk runs its forwards in microbatch order. Params' gradients (and
the loss params') are accumulated in the scan's carry, each chunk's into its rows, so
nothing the scan keeps grows with M except the gradients of the per-example inputs (x,
per-example arguments, float targets), which are as large as those inputs.

With FSDP (``fsdp=``) nothing here is differentiated by JAX, so the gathers are explicit:
``fsdp_gather="step"`` all-gathers the stage's params once before the loop and
reduce-scatters their summed gradients once after it; ``"tick"`` gathers each tick's
forward chunk and backward chunk (one gather for V = 1, where both are the whole stage) and
reduce-scatters the backward chunk's gradient into a sharded accumulator at that tick.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from stackwise._pipeline import stage_fsdp, ticks
from stackwise._pipeline.program import (
    WHO,
    Plan,
    Stage,
    check_batch,
    check_same_batch,
    chunk_rows,
    nth,
    reshard,
    select,
    split_batch,
    stack_rows,
    vary,
)


def _inexact(v: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(v), jnp.inexact)


def _floats(tree: Any) -> list:
    """The leaves that have gradients (float and complex), in tree order."""
    return [v for v in jax.tree.leaves(tree) if _inexact(v)]


def _vjp(f: Callable[[Any], Any], tree: Any) -> tuple[Any, Callable[[list], list]]:
    """``f(tree)`` and the pullback of its float output leaves to ``tree``'s float leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    keep = [_inexact(v) for v in leaves]

    def of_floats(*floats):
        it = iter(floats)
        full = [next(it) if k else v for v, k in zip(leaves, keep)]
        return _floats(f(jax.tree.unflatten(treedef, full)))

    out, pull = jax.vjp(of_floats, *[v for v, k in zip(leaves, keep) if k])
    return out, lambda ct: list(pull(ct))


def targets_of(args: tuple, kwargs: dict, call: str) -> tuple:
    """``(targets, loss_params, args, kwargs)`` of ``apply(..., x, targets, *args,
    loss_params=..., **kwargs)``; ``call`` is that signature, for the error."""
    if not args:
        raise TypeError(
            f"{WHO} apply: with schedule='1f1b' the call is `{call}`: `targets` (the "
            "per-example values `loss(y, targets)` takes, or None) is missing."
        )
    kwargs = dict(kwargs)
    loss_params = kwargs.pop("loss_params", None)
    return args[0], loss_params, tuple(args[1:]), kwargs


def with_params(loss: Callable[..., Any], loss_params: Any) -> Callable[..., Any]:
    """``loss`` as a function of ``(y, targets, loss_params)``, called with the user's arity."""
    if loss_params is None:
        return lambda y, t, lp: loss(y, t)
    return loss


def check_loss(loss: Callable[..., Any], y: Any, targets: Any, loss_params: Any, plan: Plan):
    """``loss(y_m, targets_m[, loss_params])`` is a float scalar (traced abstractly, before
    the pipeline)."""

    def rows(tree):
        split = plan.M * plan.D
        return jax.tree.map(
            lambda v: jax.ShapeDtypeStruct(
                (jnp.shape(v)[0] // split, *jnp.shape(v)[1:]), jnp.result_type(v)
            ),
            tree,
        )

    call = "loss(y, targets)" if loss_params is None else "loss(y, targets, loss_params)"
    try:
        out = jax.eval_shape(with_params(loss, loss_params), rows(y), rows(targets), loss_params)
    except TypeError as e:
        raise TypeError(
            f"{WHO}: with schedule='1f1b' the pipeline calls `{call}` on each microbatch, "
            f"which raised TypeError: {e}. "
            + (
                ""
                if loss_params is None
                else "With `loss_params=` given, `loss` takes it as a third argument. "
            )
        ) from e
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and _inexact(out)):
        got = jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", out)
        raise TypeError(
            f"{WHO}: with schedule='1f1b', `{call}` must return one float scalar "
            f"for a microbatch (the pipeline returns the mean over microbatches), got {got}. "
            "Reduce it inside `loss`, e.g. `lambda y, t: jnp.mean((y - t) ** 2)`."
        )


def loss_and_grads(stage, plan, mesh, loss, forward, inputs, state, targets, loss_params):
    """The mean microbatch loss and the new state, differentiable: the forward rule runs
    the 1F1B schedule.

    ``stage`` is a :class:`Stage`; ``inputs`` the pipeline's placed ``(params, per_layer,
    x, examples, consts)`` (``params`` with ``stage.params``' spec, ``per_layer`` the
    per-layer values ``(V, n/V, ...)``), ``state`` its placed state blocks (``()``
    without state); ``loss`` the user's, ``targets`` and ``loss_params`` as ``apply``
    got them; ``forward(inputs, state)`` is the GPipe (or circular) program's ``(y,
    new_state)`` (the primal, run when nothing differentiates). The state is not
    differentiated: its cotangent is zero.
    """
    x = inputs[2]
    check_batch(targets, plan, "targets")
    check_same_batch(targets, x, "targets")
    check_loss(loss, x, targets, loss_params, plan)
    if plan.explicit:  # the targets split over the batch like x; the loss params whole
        targets = reshard(targets, mesh, (plan.batch,), plan.manual)
        loss_params = reshard(loss_params, mesh, (), plan.manual)
    loss = with_params(loss, loss_params)
    diff = (*inputs, targets, loss_params)
    leaves, treedef = jax.tree.flatten(diff)
    is_float = [_inexact(v) for v in leaves]
    layer, batch = PartitionSpec(None, plan.stage_axis), PartitionSpec(plan.batch)
    specs = (stage.params, layer, batch, batch, PartitionSpec(), batch, PartitionSpec())

    def grads_tree(floats):
        """The float gradients back in ``diff``'s tree, ``None`` at the other leaves."""
        it = iter(floats)
        return jax.tree.unflatten(treedef, [next(it) if f else None for f in is_float])

    def primal(diff, state):
        *ins, tg, lp = diff
        y, new_state = forward(tuple(ins), state)
        if plan.explicit:  # y split like the targets, for the vmap below
            y = reshard(y, mesh, (plan.batch,), plan.manual)

        def split(tree):
            return jax.tree.map(lambda v: v.reshape(plan.M * plan.D, -1, *v.shape[1:]), tree)

        return jnp.mean(jax.vmap(loss, in_axes=(0, 0, None))(split(y), split(tg), lp)), new_state

    def schedule(diff, state):
        run = jax.shard_map(
            lambda diff, state: _device_program(stage, plan, loss, grads_tree, diff, state),
            mesh=mesh,
            in_specs=(specs, stage.state.specs),
            out_specs=((PartitionSpec(), stage.state.specs), specs),
            axis_names=frozenset(plan.manual),
        )
        return run(diff, state)

    @jax.custom_vjp
    def value(diff, state):
        return primal(diff, state)

    def bwd(grads, g):
        g = g[0]  # the new state's cotangent is dropped: the state is not differentiated
        it = iter(jax.tree.leaves(grads))
        out = [
            (g * next(it)).astype(jnp.result_type(v)) if f else _zero_cotangent(v)
            for v, f in zip(leaves, is_float)
        ]
        return jax.tree.unflatten(treedef, out), jax.tree.map(_zero_cotangent, state)

    value.defvjp(schedule, bwd)
    return value(diff, state)


def _zero_cotangent(v: Any) -> Any:
    """A zero cotangent for ``v``: zeros of its dtype, ``float0`` for a leaf without one."""
    if _inexact(v):
        return jnp.zeros(jnp.shape(v), jnp.result_type(v))
    return np.zeros(jnp.shape(v), jax.dtypes.float0)


def _step(plan: Plan, k: Any) -> tuple:
    """Step k of a stage, forward or backward (``ticks.interleaved_order``): ``(valid, m,
    r)``, clipped to a real step where k is none."""
    S, V, M = plan.S, plan.V, plan.M
    m, r = ticks.interleaved_order(jnp.clip(k, 0, M * V - 1), S, V)
    return ticks.is_step(k, M, V), m, r


class _Grads(NamedTuple):
    """The gradients the tick loops accumulate, each a list of float leaves: the stage's
    ``(V*R, ...)`` stacks (params, then per-layer values), x's and the per-example
    arguments' per microbatch, the consts', the targets' per microbatch, the loss params'."""

    stacks: list
    x: list
    examples: list
    consts: list
    targets: list
    loss_params: list


class _Carry(NamedTuple):
    """What one 1F1B tick hands the next."""

    h: Any  # the activation this stage's forward sends on (received: its next input)
    g: list  # the cotangent this stage's backward sends back (received: its next one)
    state: Any  # the stage's state, as ``Stage.state`` carries it
    ring: Any  # K slots of (forward input, state it read), by forward step mod K
    grads: _Grads
    total: Any  # the summed loss of the microbatches the last stage finished


class _Forward(NamedTuple):
    """This tick's forward step, for the loss and the backward of the same tick."""

    on: Any  # a real step (not a bubble)
    m: Any  # its microbatch
    r: Any  # its round
    chunk: Any  # the chunk it ran
    h: Any  # its output


def _device_program(stage, plan, loss, grads_tree, inputs, state):
    """One device's 1F1B schedule: the summed loss, the new state and every float input's
    gradient."""
    inputs, state = vary((inputs, state), plan.manual)
    params, per_layer = inputs[:2]
    device = _Device(stage, plan, loss, inputs)
    carry = device.start(stage.state.enter(state))
    for first, stop, forward, backward in ticks.one_f_one_b_phases(plan.S, plan.M, plan.V):
        phase = functools.partial(device.tick, forward=forward, backward=backward)
        carry, _ = jax.lax.scan(phase, carry, jnp.arange(first, stop))
    total, grads = device.finish(carry, (params, per_layer))
    return (total, stage.state.leave(carry.state)), grads_tree(grads)


class _Device:
    """The 1F1B schedule on this device (stage s, data shard d): its inputs split into
    microbatches, its chunks, and one tick of the schedule (:meth:`tick`)."""

    def __init__(self, stage: Stage, plan: Plan, loss: Callable, inputs: tuple):
        self.stage, self.plan, self.loss = stage, plan, loss
        S, M = plan.S, plan.M
        self.K = ticks.ring_slots(S, M, plan.V)
        self.s = jax.lax.axis_index(plan.stage_axis)
        self.d = jax.lax.axis_index(plan.batch_axes) if plan.batch else 0
        self.last = self.s == S - 1
        params, per_layer, x, examples, self.consts, targets, self.loss_params = inputs
        self.mbs, self.examples, self.targets = (split_batch(v, M) for v in (x, examples, targets))
        # This device's V chunks as (V*R, ...) stacks, chunk r at rows r*R:(r+1)*R.
        stacks = (stack_rows(params, stage.lead), stack_rows(per_layer, 2))
        self.fsdp = _Fsdp(plan, stage.dims, stacks)
        self.per_tick = plan.fsdp and plan.gather == "tick"
        if plan.fsdp and not self.per_tick:
            stacks = self.fsdp.gather(stacks)  # the whole stage, once
        self.stacks = stacks
        self.scale = 1.0 / (M * plan.D)  # the loss is the mean over all M*D microbatches

    def run(self, m: Any, st: Any) -> Callable:
        """This stage's chunk on microbatch m from state ``st``, a function of ``(chunk,
        h, examples, consts)``: ``(h, new state)``."""
        j = self.d * self.plan.M + m
        return lambda a: self.stage.run(a[0], a[1], st, j, a[2], a[3])[0]

    def chunk(self, r: Any) -> Any:
        """Chunk r of this stage (gathered, with FSDP per tick)."""
        c = chunk_rows(self.stacks, r, self.plan.V)
        return self.fsdp.gather(c) if self.per_tick else c

    def start(self, state: Any) -> _Carry:
        """The carry before tick 0: zeros, the ring empty, the state entered."""
        zeros = lambda tree: [jnp.zeros_like(v) for v in _floats(tree)]  # noqa: E731
        h0, st0 = nth(self.mbs, 0), self.stage.state.take(state, 0, 0)
        out = jax.eval_shape(
            lambda: self.loss(
                self.run(0, st0)((self.chunk(0), h0, nth(self.examples, 0), self.consts))[0],
                nth(self.targets, 0),
                self.loss_params,
            )
        )
        ring = jax.tree.map(lambda v: jnp.zeros((self.K, *v.shape), v.dtype), (h0, st0))
        parts = (self.stacks, self.mbs, self.examples, self.consts, self.targets)
        grads = _Grads(*(zeros(v) for v in (*parts, self.loss_params)))
        carry = _Carry(h0, zeros(h0), state, ring, grads, jnp.zeros((), out.dtype))
        return vary(carry, self.plan.manual)

    def tick(self, carry: _Carry, t: Any, forward=True, backward=True) -> tuple:
        """Tick t; a phase of ticks where no stage has a backward (forward) step to run
        leaves it out (``backward=False``, ``forward=False``)."""
        dy = None
        if forward:
            carry, f = self.forward(carry, t)
        if forward and backward:
            carry, dy = self.loss_of(carry, f)
        if backward:
            carry = self.backward(carry, t, f if forward else None, dy)
        # Activations go one stage on, cotangents one stage back (round the ring, V > 1).
        S, V = self.plan.S, self.plan.V
        if S > 1:
            links = range(S if V > 1 else S - 1)
            axis = self.plan.stage_axis
            if forward:
                h = jax.lax.ppermute(carry.h, axis, [(i, (i + 1) % S) for i in links])
                carry = carry._replace(h=h)
            if backward:
                g = jax.lax.ppermute(carry.g, axis, [((i + 1) % S, i) for i in links])
                carry = carry._replace(g=g)
        return carry, None

    def forward(self, carry: _Carry, t: Any) -> tuple[_Carry, _Forward]:
        """Forward step t - s; stage 0 takes round 0 from x, the next rounds from the last
        stage (which ran them one tick ago). The ring keeps its input and the state it read."""
        k = ticks.forward_step(t, self.s)
        on, m, r = _step(self.plan, k)
        h_in = select((self.s == 0) & (r == 0), nth(self.mbs, m), carry.h)
        st_in = self.stage.state.take(carry.state, r, m)
        ring = jax.tree.unflatten(
            jax.tree.structure(carry.ring),
            _write(jax.tree.leaves(carry.ring), k % self.K, jax.tree.leaves((h_in, st_in)), on),
        )
        chunk = self.chunk(r)
        h, st = self.run(m, st_in)((chunk, h_in, nth(self.examples, m), self.consts))
        state = self.stage.state.put(carry.state, select(on, st, st_in), r, m)
        return carry._replace(h=h, state=state, ring=ring), _Forward(on, m, r, chunk, h)

    def loss_of(self, carry: _Carry, f: _Forward) -> tuple[_Carry, list]:
        """The loss, on the last stage's last round (never in the other phases): its value
        and cotangents for y (returned), targets and loss params (accumulated)."""
        primals = (f.h, nth(self.targets, f.m), self.loss_params)
        value, pull = _vjp(lambda a: self.loss(*a), primals)
        seed = vary(jnp.asarray(self.scale, value[0].dtype), self.plan.manual)
        dy, dt, dlp = _regroup(pull([seed]), primals)
        now = f.on & self.last & (f.r == self.plan.V - 1)
        total = carry.total + jnp.where(now, value[0], 0).astype(carry.total.dtype)
        grads = carry.grads._replace(
            targets=_write(carry.grads.targets, f.m, dt, now),
            loss_params=[jnp.where(now, a + b, a) for a, b in zip(carry.grads.loss_params, dlp)],
        )
        return carry._replace(total=total, grads=grads), dy

    def backward(self, carry: _Carry, t: Any, f: _Forward | None, dy: list | None) -> _Carry:
        """Backward step t - (V*S - 1) - (S - 1 - s), its rounds counted down from V - 1,
        recomputed from its input and state in the ring (at its forward step's slot)."""
        S, V, s = self.plan.S, self.plan.V, self.s
        on, m, down = _step(self.plan, ticks.backward_step(t, s, S, V))
        r = V - 1 - down
        slot = ticks.interleaved_step(m, r, S, V) % self.K
        chunk = f.chunk if f is not None and V == 1 else self.chunk(r)
        h_in, st_in = nth(carry.ring, slot)
        primals = (chunk, h_in, nth(self.examples, m), self.consts)
        # The last stage's last round starts from the loss, every other step from the
        # cotangent the next chunk sent.
        g = carry.g
        if f is not None:
            g = [jnp.where(self.last & (r == V - 1), a, b) for a, b in zip(dy, g)]
        _, pull = _vjp(lambda a: self.run(m, st_in)(a)[0], primals)
        dchunk, g, dex, dconsts = _regroup(pull(g), primals)
        if self.per_tick:
            dchunk = self.fsdp.scatter(dchunk)  # the gathered chunk's gradient, to its shards
        acc = carry.grads
        grads = acc._replace(
            stacks=_add(acc.stacks, r if V > 1 else None, dchunk, on),
            x=_write(acc.x, m, g, on & (s == 0) & (r == 0)),  # x's: the first chunk's
            examples=_add(acc.examples, m, [v[None] for v in dex], on),
            consts=[jnp.where(on, a + b, a) for a, b in zip(acc.consts, dconsts)],
        )
        return carry._replace(g=g, grads=grads)

    def finish(self, carry: _Carry, local: tuple) -> tuple[Any, list]:
        """The summed loss and the float gradients in the inputs' order: params and
        per-layer values (``local``'s float leaves) from ``(V*R, ...)`` back to this
        device's layout, summed over the data shards (reduce-scattered over the FSDP
        axes); per-example gradients summed over the stages (each adds its layers' part)."""
        plan, acc = self.plan, carry.grads
        sum_over = lambda vs, axes: [jax.lax.psum(v, axes) if axes else v for v in vs]  # noqa: E731
        unsplit = lambda vs: [v.reshape(-1, *v.shape[2:]) for v in vs]  # noqa: E731
        reduced = self.fsdp.reduce(acc.stacks, self.per_tick)
        grads = (
            [g.reshape(v.shape) for g, v in zip(reduced, _floats(local))]
            + unsplit(sum_over(acc.x, plan.stage_axis))
            + unsplit(sum_over(acc.examples, plan.stage_axis))
            + sum_over(acc.consts, plan.manual)
            + unsplit(sum_over(acc.targets, plan.stage_axis))
            + sum_over(acc.loss_params, plan.manual)
        )
        total = jax.lax.psum(carry.total, plan.manual) * jnp.asarray(self.scale, carry.total.dtype)
        return total, grads


def _write(bufs: list, i: Any, values: list, on: Any) -> list:
    """``buf[i] = value`` where ``on``, for each buffer and value."""
    return [
        jax.lax.dynamic_update_index_in_dim(
            b, jnp.where(on, v, jax.lax.dynamic_index_in_dim(b, i, keepdims=False)), i, 0
        )
        for b, v in zip(bufs, values)
    ]


def _add(bufs: list, i: Any, values: list, on: Any) -> list:
    """``buf[i*k:(i+1)*k] += value`` (block i of ``k = len(value)`` rows) where ``on``
    (``i=None``: the whole buffer)."""
    out = []
    for b, v in zip(bufs, values):
        if i is None:
            out.append(jnp.where(on, b + v, b))
            continue
        at = i * v.shape[0]
        old = jax.lax.dynamic_slice_in_dim(b, at, v.shape[0])
        out.append(jax.lax.dynamic_update_slice_in_dim(b, jnp.where(on, old + v, old), at, 0))
    return out


class _Fsdp:
    """FSDP inside the 1F1B program: the stage's params gathered over the FSDP axes, and
    their gradients (a flat list of the stacks' float leaves) reduce-scattered. Nothing
    here is differentiated by JAX: the schedule is the explicit backward pass."""

    def __init__(self, plan: Plan, dims: Any, stacks: tuple):
        self.plan, self.dims = plan, dims
        params, per_layer = stacks
        every = (
            jax.tree.leaves(dims, is_leaf=lambda v: v is None)
            if plan.fsdp
            else [None] * len(jax.tree.leaves(params))
        )
        # Each float leaf's split dimension (None: not split; the per-layer values never are).
        floats = [d for v, d in zip(jax.tree.leaves(params), every) if _inexact(v)]
        self.flat = floats + [None] * len(_floats(per_layer))

    def gather(self, stacks: tuple) -> tuple:
        """``(params, per_layer)`` rows with the params all-gathered."""
        params, per_layer = stacks
        return stage_fsdp.gather(params, self.dims, self.plan), per_layer

    def scatter(self, grads: list) -> list:
        """Gathered rows' gradients summed over the FSDP axes, each device its shard."""
        return stage_fsdp.scatter(grads, self.flat, self.plan)

    def reduce(self, grads: list, scattered: bool) -> list:
        """The accumulated gradients summed over the batch axes: reduce-scattered over the
        FSDP axes (unless ``scattered`` already), all-reduced over the others."""
        plan = self.plan
        if plan.fsdp and not scattered:
            grads = self.scatter(grads)
        others = tuple(a for a in plan.batch_axes if a not in plan.fsdp)
        out = []
        for v, d in zip(grads, self.flat):
            axes = plan.batch_axes if d is None else others
            out.append(jax.lax.psum(v, axes) if axes else v)
        return out


def _regroup(flat: list, trees: tuple) -> list[list]:
    """Splits the flat float gradients of ``trees`` into one list per tree."""
    out, i = [], 0
    for tree in trees:
        k = len(_floats(tree))
        out.append(flat[i : i + k])
        i += k
    return out

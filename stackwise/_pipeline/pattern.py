"""Pipelines of layer patterns and of layers with state (``with_state``).

:func:`stackwise.pipeline` hands a pattern of k layers (``init``/``apply``
sequences) or a stack ``with_state=True`` to :func:`pattern_pipeline`.
Every stage runs the same SPMD program, so every device needs the same
layout whatever its stage's phase in the pattern:

* **Chunk blocks.** Chunk ``c = r*S + s`` (round r of stage s; GPipe has
  one round, V = 1) holds layers ``c*L`` to ``(c+1)*L - 1`` (``L =
  n/(S*V)``); layer i is pattern position ``i % k``. Position p's stacked
  params ``(count_p, ...)`` (layers p, p+k, ...) are regrouped into
  ``(V, S, C_p, ...)``: entry ``[r, s]`` holds, in order, the layers of
  position p in chunk ``r*S + s``, padded to ``C_p``, the most any chunk
  holds (padding rows repeat a real layer and are never run; their gradient
  is zero). The stage axis is split over the mesh. With one chunk a stage
  and as many layers of each position in every chunk, the blocks are the
  stack's layout reshaped (nothing moves); otherwise a gather. The state is
  regrouped the same way and comes back in the stack's layout, as do the
  params' gradients.
* **Dispatch.** A table per layer, split over the stages like per-layer
  arguments, gives each layer its position and its row in its chunk's
  block; a chunk's L layers run as one :func:`stackwise.stack` (the core's
  scan and remat) of a layer that takes its row and runs its position's
  ``apply`` with :func:`jax.lax.switch`. Chunk boundaries may cut the
  pattern anywhere.
* **FSDP** (``fsdp=``, ``stage_fsdp.py``). A position's leaf keeps the
  inner split over the FSDP axes that the stacked params have (or that
  :func:`stackwise.fsdp_specs`' rule gives it) in its blocks; a device
  gathers its stage's blocks before the tick loop, or each tick's chunk of
  them at that tick, and a layer takes its row of the gathered block.
  Neither is kept for the backward pass.
* **State.** A stage's state is carried through the tick loop. A leaf with
  a batch axis (``batched_state``: a KV cache) is split into microbatches
  with ``x`` (and over the batch's mesh axes), and microbatch m reads and
  writes its own rows; a leaf without one (statistics, counters) is
  threaded through the microbatches in order, as a loop over the M
  microbatches would. Bubble ticks write nothing.

The tick loop follows ``program._tick`` (the same schedules, the
same parking of microbatches between rounds) with one addition: the chunk's
state (``program._StageState``), read before the stage runs and
written after it. With ``schedule="1f1b"`` the 1F1B program
(``schedule_1f1b.py``) runs the same stage (its chunk's blocks and table rows
on one microbatch, the state carried the same way) in its own tick loops; the
tick loop here is its primal, run when nothing differentiates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from stackwise._core import trees
from stackwise._core.checks import check_depth
from stackwise._core.options import check_layers
from stackwise._core.stack import Stacked, _apply_args, _check_pair, stack
from stackwise._pipeline import schedule_1f1b, stage_fsdp
from stackwise._pipeline.program import (
    _WHO,
    _add_aux,
    _check_batch,
    _check_same_batch,
    _entering,
    _gather_aux,
    _gather_output,
    _never_sliced,
    _out_spec,
    _pass_on,
    _Plan,
    _reshard,
    _split_batch,
    _StageState,
    _take,
    _to_chunks,
    _vary,
    _where,
)

__all__ = ["pattern_pipeline"]


# --------------------------------------------------------------------------
# The layout: each position's layers in stage blocks.


class _Layout(NamedTuple):
    """Where each layer lives: position blocks ``(V, S, C_p, ...)`` and per-layer tables."""

    k: int
    S: int
    V: int
    even: bool  # every chunk holds C_p layers of each position p: blocks are a reshape
    counts: tuple  # layers of position p in the stack: len(range(p, n, k))
    gather: tuple  # per position: (V, S, C_p) indices into its stack (padding: a real row)
    back: tuple  # per position: (round, stage, row) of each of its count_p layers
    position: np.ndarray  # (n,): layer i's position, i % k
    row: np.ndarray  # (n,): layer i's row in its chunk's block of its position


def _layout(n: int, k: int, S: int, V: int) -> _Layout:
    """Chunk c = r*S + s (round r of stage s) holds layers c*L to (c+1)*L - 1."""
    L = n // (S * V)
    chunk_of = np.arange(n) // L
    counts, gather, back, even = [], [], [], True
    row = np.zeros(n, np.int32)
    for p in range(k):
        layers = np.arange(p, n, k)  # position p's layers, in its stack's order
        chunks = chunk_of[layers]
        per_chunk = [np.flatnonzero(chunks == c) for c in range(S * V)]  # stack indices
        width = max(len(t) for t in per_chunk)
        even = even and all(len(t) == width for t in per_chunk)
        block = np.zeros((S * V, width), np.int32)
        rows = np.zeros(len(layers), np.int32)
        for c, t in enumerate(per_chunk):
            block[c, : len(t)] = t
            block[c, len(t) :] = t[0] if len(t) else 0  # padding: never run
            rows[t] = np.arange(len(t))
        row[layers] = rows
        counts.append(len(layers))
        gather.append(block.reshape(V, S, width))
        back.append(((chunks // S).astype(np.int32), (chunks % S).astype(np.int32), rows))
    position = (np.arange(n) % k).astype(np.int32)
    return _Layout(k, S, V, even, tuple(counts), tuple(gather), tuple(back), position, row)


def _spec(a: Any) -> tuple:
    sharding = getattr(jax.typeof(a), "sharding", None)
    return tuple(getattr(sharding, "spec", ()) or ())


def _to_blocks(tree: Any, layout: _Layout, p: int, explicit: bool) -> Any:
    """Position p's ``(count_p, ...)`` leaves as ``(V, S, C_p, ...)`` chunk blocks."""
    V, S = layout.V, layout.S

    def one(a):
        spec = _spec(a)
        split = explicit and spec and spec[0] is not None
        shape = (V, S, a.shape[0] // (S * V), *a.shape[1:])
        if layout.even and V == 1:  # the stack split evenly: a reshape, nothing moves
            if split:
                out = PartitionSpec(None, spec[0], None, *spec[1:])
                out = NamedSharding(jax.typeof(a).sharding.mesh, out)
                return jax.lax.reshape(a, shape, out_sharding=out)
            return jnp.reshape(a, shape)
        if split:
            # Layers split over a mesh axis: gather them first (a collective), keeping the
            # inner axes' sharding, since a stage's block takes rows from several shards.
            out = NamedSharding(jax.typeof(a).sharding.mesh, PartitionSpec(None, *spec[1:]))
            a = jax.reshard(a, out)
        return jnp.take(a, layout.gather[p], axis=0)

    return jax.tree.map(one, tree)


def _from_blocks(tree: Any, layout: _Layout, p: int, explicit: bool) -> Any:
    """``(V, S, C_p, ...)`` chunk blocks back as position p's ``(count_p, ...)`` stack."""
    rounds, stages, rows = layout.back[p]

    def one(a):
        spec = _spec(a)
        shape = (-1, *a.shape[3:])
        if layout.even and layout.V == 1:
            if explicit and spec and spec[1] is not None:
                out = NamedSharding(jax.typeof(a).sharding.mesh, PartitionSpec(spec[1], *spec[3:]))
                return jax.lax.reshape(a, (a.shape[1] * a.shape[2], *a.shape[3:]), out_sharding=out)
            return jnp.reshape(a, shape)
        if explicit:  # gather the stages first: the layers' rows are read across them
            out = PartitionSpec(None, None, None, *spec[3:])
            a = jax.reshard(a, NamedSharding(jax.typeof(a).sharding.mesh, out))
        return a[rounds, stages, rows]

    return jax.tree.map(one, tree)


# --------------------------------------------------------------------------
# The public entry, called by stackwise.pipeline.


def pattern_pipeline(
    plain: Stacked,
    init: Any,
    apply: Any,
    plan: _Plan,
    mesh: Any,
    *,
    remat: Any,
    nested: Any,
    unroll: Any,
    options: Any,
    has_aux: bool,
    with_state: bool,
    batched_state: Any,
    loss: Callable[..., Any] | None,
    split_args: Callable,
) -> Stacked:
    """The pipeline of a pattern and/or of layers with state, any schedule (``loss``: the
    1F1B schedule's).

    ``plain`` is the stack (its init is the pipeline's); ``split_args`` is
    ``stackwise.pipeline``'s own, shared with it.
    """
    _, applies, pattern = check_layers(init, apply, _WHO)
    k, n = len(applies), plan.n
    if not (isinstance(batched_state, bool) or callable(batched_state)):
        raise TypeError(
            f"{_WHO}: `batched_state` must be a bool or a function of a state leaf's path "
            "(a `jax.tree_util.keystr` string) returning a bool, got "
            f"{type(batched_state).__name__} {batched_state!r}."
        )
    layout = _layout(n, k, plan.S, plan.V)
    tables = (jnp.asarray(layout.position), jnp.asarray(layout.row))
    signature = "apply(params, " + "state, " * with_state + "x, targets, *args)"

    def pipelined(*args, **kwargs):
        params, state, x, args = _apply_args(args, with_state, _WHO, call="apply")
        if loss is not None:
            targets, loss_params, args, kwargs = schedule_1f1b.targets_of(args, kwargs, signature)
        params = _positions(params, "params", pattern, layout)
        state = _positions(state, "state", pattern, layout) if with_state else (None,) * k
        _check_batch(x, plan, "x")
        state_of = _StageState(_batched_leaves(state, batched_state, x, plan, pattern), plan)
        call = split_args(tuple(args), kwargs, n)
        for i, v in enumerate(call.examples):
            _check_batch(v, plan, f"stackwise.per_example argument {i}")
            _check_same_batch(v, x, f"stackwise.per_example argument {i}")
        dims = _fsdp_dims(params, mesh, plan, pattern)
        blocks = tuple(_to_blocks(params[p], layout, p, plan.explicit) for p in range(k))
        state_blocks = tuple(_to_blocks(state[p], layout, p, plan.explicit) for p in range(k))
        per_layer = _to_chunks((tables, call.per_layer), plan)
        inputs = (blocks, state_blocks, per_layer, x, call.examples, call.consts)
        if plan.explicit:
            inputs = _place(inputs, state_of.specs, dims, mesh, plan)
        out_spec = _out_spec(x, plan)
        dispatch = _Dispatch(applies, has_aux, with_state, call, plan.manual)
        stage = stack(
            None, dispatch, plan.L, remat=remat, nested=nested, unroll=unroll, has_aux=True,
            name=_WHO,
        )  # fmt: skip
        per_tick = None
        if plan.fsdp and plan.gather == "tick":
            per_tick = lambda rows: stage_fsdp.gather(rows, dims, plan)  # noqa: E731

        def program(*inputs, gather=None):
            return _device_program(
                stage, options, plan, state_of, out_spec, *inputs, gather=gather, per_tick=per_tick
            )

        if plan.fsdp and plan.gather == "step":
            program = stage_fsdp.gathered_once(program, dims, plan, options, lead=3)
        layers = PartitionSpec(None, plan.stage_axis)
        block_specs = stage_fsdp.in_specs(dims, plan, lead=3) if plan.fsdp else layers
        run = jax.shard_map(
            program,
            mesh=mesh,
            in_specs=(
                block_specs,
                state_of.specs,
                layers,
                PartitionSpec(plan.batch),
                PartitionSpec(plan.batch),
                PartitionSpec(),
            ),
            out_specs=(out_spec, PartitionSpec(), state_of.specs),
            axis_names=frozenset(plan.manual),
        )

        unwrap = (lambda t: t) if pattern else (lambda t: t[0])

        def unblocked(new_state):  # the new state in the stack's layout
            return unwrap(
                tuple(_from_blocks(new_state[p], layout, p, plan.explicit) for p in range(k))
            )

        if loss is not None:
            blocks, state_blocks, *rest = inputs

            def run_chunk(chunk, h, state, j, examples, consts):
                """A chunk's ``(blocks, per_layer)`` rows on one microbatch."""
                blocks, per_layer = chunk
                return stage.apply(per_layer, (h, state), j, examples, consts, blocks)[0]

            def forward(inputs, state):  # the primal: GPipe's output and new state
                y, _, new_state = run(inputs[0], state, *inputs[1:])
                return y, new_state

            value, new_state = schedule_1f1b.loss_and_grads(
                schedule_1f1b.Stage(run_chunk, block_specs, 3, dims, state_of),
                plan, mesh, loss, forward, (blocks, *rest), state_blocks, targets, loss_params,
            )  # fmt: skip
            return (value, unblocked(new_state)) if with_state else value
        y, aux, new_state = run(*inputs)
        aux = tuple(jax.tree.map(lambda a, p=p: a[p::k], aux[p]) for p in range(k))
        out = (y, unwrap(aux)) if has_aux else y
        return (out, unblocked(new_state)) if with_state else out

    return Stacked(plain.init, pipelined, n)


def _fsdp_dims(params: tuple, mesh: Any, plan: _Plan, pattern: bool) -> tuple | None:
    """With ``fsdp``: per position, each leaf's inner dimension split over the FSDP axes,
    read from the stacked params as the user placed them (leaf paths as the user's)."""
    if not plan.fsdp:
        return None
    if pattern:
        return stage_fsdp.dims(params, mesh, plan, lead=1)
    return (stage_fsdp.dims(params[0], mesh, plan, lead=1),)


def _positions(tree: Any, what: str, pattern: bool, layout: _Layout) -> tuple:
    """The params (or state) as one stacked tree per position, each leaf's depth checked."""
    k = layout.k
    if pattern and tree is None:
        tree = (None,) * k
    if pattern:
        if not isinstance(tree, (tuple, list)) or len(tree) != k:
            raise TypeError(
                f"{_WHO} apply: with a pattern of {k} layers, the {what} are a tuple of {k} "
                f"stacked trees (position p holds layers p, p+{k}, ...), as `Stacked.init` "
                f"returns them; got {trees.describe(tree)}."
            )
        tree = tuple(tree)
    else:
        tree = (tree,)
    fix = f"Stacked {what} come from `Stacked.init` (or `stackwise.stack_layers`)."
    for p, sub in enumerate(tree):
        where = f"{_WHO} apply" + (f", pattern position {p}" if pattern else "")
        check_depth(trees.named_leaves(sub), layout.counts[p], where, what, fix)
    return tree


def _batched_leaves(state: tuple, batched_state: Any, x: Any, plan: _Plan, pattern: bool):
    """Per state leaf: whether it has a batch axis (after the layer axis), checked."""
    batch = jnp.shape(jax.tree.leaves(x)[0])[0]
    paths = jax.tree_util.tree_leaves_with_path(state if pattern else state[0])
    flags, bad = [], []
    for path, leaf in paths:
        name = jax.tree_util.keystr(path) or "<root>"
        flag = batched_state if isinstance(batched_state, bool) else batched_state(name)
        if not isinstance(flag, bool):
            raise TypeError(
                f"{_WHO} apply: `batched_state({name!r})` returned "
                f"{type(flag).__name__} {flag!r}; it must return a bool."
            )
        shape = jnp.shape(leaf)
        if flag and (len(shape) < 2 or shape[1] != batch):
            bad.append(f"  state{name}: shape {shape}")
        flags.append(flag)
    if bad:
        raise ValueError(
            f"{_WHO} apply: with `batched_state`, a state leaf has a batch axis after its "
            f"layer axis, of x's batch {batch}, so that it is split into "
            f"microbatches={plan.M} with x; these leaves do not:\n"
            + "\n".join(bad)
            + "\nGive the state x's batch (a cache made for that batch), or pass "
            "`batched_state=False` (or a function of the leaf's path) for leaves shared "
            "by every example, such as statistics."
        )
    if plan.D > 1 and not all(flags) and flags:
        args = ["data_axis"] * bool(plan.data_axis) + ["fsdp"] * bool(plan.fsdp)
        axes = ", ".join(repr(a) for a in plan.batch_axes)
        raise ValueError(
            f"{_WHO} apply: state leaves without a batch axis (`batched_state` says so) "
            f"cannot be split over the batch's mesh axes {axes} (of "
            + " and ".join(f"`{a}`" for a in args)
            + f") of size {plan.D}: each data shard would update them differently. Use "
            + " and ".join(f"`{a}=None`" for a in args)
            + ", or give such state a batch axis."
        )
    tree = state if pattern else state[0]
    flags = jax.tree.unflatten(jax.tree.structure(tree), flags)
    return flags if pattern else (flags,)


def _place(inputs: tuple, state_specs: Any, dims: Any, mesh: Any, plan: _Plan) -> tuple:
    """With explicit mesh axes, moves each input to the layout ``shard_map`` takes (with
    ``fsdp``, the blocks keep their inner split over the FSDP axes: nothing is gathered)."""
    blocks, state, per_layer, x, examples, consts = inputs
    state = jax.tree.map(
        lambda v, spec: _reshard(v, mesh, tuple(spec), plan.manual), state, state_specs
    )
    if plan.fsdp:
        blocks = stage_fsdp.place(blocks, dims, mesh, plan, lead=3)
    else:
        blocks = _reshard(blocks, mesh, (None, plan.stage_axis), plan.manual)
    return (
        blocks,
        state,
        _reshard(per_layer, mesh, (None, plan.stage_axis), plan.manual),
        _reshard(x, mesh, (plan.batch,), plan.manual),
        _reshard(examples, mesh, (plan.batch,), plan.manual),
        _reshard(consts, mesh, (), plan.manual),
    )


# --------------------------------------------------------------------------
# One layer: its position's apply, chosen by the table.


class _Dispatch:
    """The layer a stage's stack runs: position ``table[j]``'s apply on its block's row."""

    def __init__(self, applies: tuple, has_aux: bool, with_state: bool, call: Any, axes: tuple):
        self.applies, self.has_aux, self.with_state, self.call = applies, has_aux, with_state, call
        self.axes = axes  # the manual mesh axes: every branch's outputs vary over them

    def __call__(self, per_layer, carry, j, examples, consts, blocks):
        (position, row), slices = per_layer
        h, state = carry
        # Per-layer keys differ per microbatch too: fold in its index over the batch.
        slices = [
            jax.random.fold_in(v, j) if kind == "keys" else v
            for v, kind in zip(slices, self.call.kinds)
        ]
        args, kwargs = self.call.build(slices, examples, consts)
        branches = [self._branch(p, row, args, kwargs) for p in range(len(self.applies))]
        if len(branches) == 1:
            (h, state), aux = branches[0](h, state, blocks)
            return (h, state), (aux,)
        shapes = [jax.eval_shape(b, h, state, blocks)[1] for b in branches]

        def padded(p):
            def run(h, state, blocks):
                carry, aux = branches[p](h, state, blocks)
                zeros = [jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t) for t in shapes]
                aux = tuple(aux if q == p else zeros[q] for q in range(len(shapes)))
                return _vary((carry, aux), self.axes)

            return run

        return jax.lax.switch(position, [padded(p) for p in range(len(branches))], h, state, blocks)

    def _branch(self, p: int, row: Any, args: tuple, kwargs: dict) -> Callable:
        apply = self.applies[p]

        def run(h, state, blocks):
            params = _take(blocks[p], row)
            if not self.with_state:
                out = apply(params, h, *args, **kwargs)
            else:
                old = _take(state[p], row)
                out, new = _check_pair(
                    apply(params, old, h, *args, **kwargs),
                    _WHO,
                    "with `with_state=True` a layer returns `(out, layer_state)`",
                    "Return the state with the output, e.g. `return x, state`.",
                    by=f"position {p}",
                )
                _check_state(old, new, p)
                state = list(state)
                state[p] = jax.tree.map(
                    lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, row, 0), state[p], new
                )
                state = tuple(state)
            if self.has_aux:
                h, aux = _check_pair(
                    out,
                    _WHO,
                    "with `has_aux=True` a layer returns `(x, aux)`",
                    "Return `(x, aux)`, or build the pipeline without `has_aux`.",
                    by=f"position {p}",
                )
            else:
                h, aux = out, None
            return (h, state), aux

        return run


def _check_state(old: Any, new: Any, p: int) -> None:
    """A layer returns its state with the structure, shapes and dtypes it received."""
    same = jax.tree.structure(old) == jax.tree.structure(new) and all(
        jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b)
        for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new))
    )
    if not same:
        shapes = lambda t: jax.tree.map(  # noqa: E731
            lambda v: f"{jnp.result_type(v).name}{list(jnp.shape(v))}", t
        )
        raise TypeError(
            f"{_WHO}: a pipelined layer (pattern position {p}) must return its state with the "
            f"structure, shapes and dtypes it received (it is written back into the stacked "
            f"state), but it took\n  {shapes(old)}\nand returned\n  {shapes(new)}\n"
            "Return the updated state in the input's layout, e.g. "
            "`jax.lax.dynamic_update_slice(cache, new, pos)` for a cache."
        )


# --------------------------------------------------------------------------
# One device's program: the tick loop, the stage's state carried.


def _device_program(
    stage, options, plan, state_of, out_spec, blocks, state, per_layer, x, examples, consts,
    gather=None, per_tick=None,
):  # fmt: skip
    """What one device runs: its V chunks of L layers over the M*V + S - 1 ticks, the
    state carried as ``state_of`` (a :class:`_StageState`) says. With FSDP, ``gather``
    gathers the stage's blocks before the tick loop, or ``per_tick`` each tick's chunk of
    them."""
    M, V = plan.M, plan.V
    s = jax.lax.axis_index(plan.stage_axis)
    d = jax.lax.axis_index(plan.batch_axes) if plan.batch else 0
    blocks, state, per_layer, x, examples, consts = _vary(
        (blocks, state, per_layer, x, examples, consts), plan.manual
    )
    # This stage's blocks as (V*C_p, ...) rows and its tables as (V*L, ...): chunk r at
    # rows r*C_p:(r+1)*C_p (r*L:(r+1)*L).
    blocks = jax.tree.map(lambda v: v.reshape(-1, *v.shape[3:]), blocks)
    per_layer = jax.tree.map(lambda v: v.reshape(-1, *v.shape[2:]), per_layer)
    if gather is not None:
        blocks = gather(blocks)
    state = state_of.enter(state)
    mbs, examples = _split_batch(x, M), _split_batch(examples, M)

    def chunk(tree, r):  # chunk r's rows: all of them for one chunk a stage
        if V == 1:
            return tree
        return jax.tree.map(
            lambda v: jax.lax.dynamic_slice_in_dim(v, r * (v.shape[0] // V), v.shape[0] // V),
            tree,
        )

    def run_stage(chunks, r, h, st, m):
        """This stage's chunk r on microbatch m (index d*M + m over the whole batch)."""
        layers, rows = chunk(chunks, r)
        if per_tick is not None:
            rows = per_tick(rows)
        return stage.apply(layers, (h, st), d * M + m, _take(examples, m), consts, rows)

    chunks = (per_layer, blocks)
    if per_tick is not None:  # the gathered chunk, taken and gathered again, never saved
        gathered = jax.eval_shape(lambda c: per_tick(chunk(c, 0)[1]), chunks)
        policy = stage_fsdp.per_tick_policy(options, chunks, gathered, V)
        run_stage = jax.checkpoint(run_stage, prevent_cse=False, policy=policy)
    elif V > 1:  # a per-tick slice, taken again in the backward pass rather than saved
        run_stage = jax.checkpoint(
            run_stage, prevent_cse=False, policy=_never_sliced(chunks, options, V)
        )
    st0 = state_of.take(state, 0, 0)
    aux_shape = jax.eval_shape(run_stage, chunks, 0, _take(mbs, 0), st0, 0)[1]
    aux0 = jax.tree.map(lambda a: jnp.zeros((V, *a.shape), a.dtype), aux_shape)

    def tick(carry, t):
        """Tick t: stage s runs step k = t - s, microbatch k % M of round k // M."""
        h, parked, state, aux = carry
        valid, m, r, h, parked = _entering(plan, mbs, s, h, parked, t)
        st = state_of.take(state, r, m)
        (out, new), layer_aux = run_stage(chunks, r, h, st, m)
        state = state_of.put(state, _where(valid, new, st), r, m)
        aux = _add_aux(aux, layer_aux, valid, r)
        return (_pass_on(out, plan), parked, state, aux), out

    parked = jax.tree.map(jnp.zeros_like, mbs) if V > 1 else None
    carry = _vary((_take(mbs, 0), parked, state, aux0), plan.manual)
    (_, _, state, aux), ys = jax.lax.scan(tick, carry, jnp.arange(plan.ticks))
    # The last stage finished microbatch m (last round) at tick T - M + m.
    y = jax.tree.map(lambda v: v[plan.ticks - M :].reshape(-1, *v.shape[2:]), ys)
    return _gather_output(y, s, plan, out_spec), _gather_aux(aux, s, plan), state_of.leave(state)

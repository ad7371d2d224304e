"""A pattern of layers, or layers with state (``with_state``), on the pipeline's stages.

:func:`stackwise.pipeline` lays a pattern of k layers (``init``/``apply``
sequences), or a stack ``with_state=True``, out with :class:`Blocks`; the rest of
the pipeline (``api.py``, the schedules) is the same as for one layer function,
which is a pattern of one layer without state. Every stage runs the same SPMD
program, so every device needs the same layout whatever its stage's phase in the
pattern:

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

The schedules (``schedule_gpipe.py``, ``schedule_1f1b.py``) carry the chunk's state
(``program.StageState``), read before the stage runs and written after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from stackwise._core.options import Options
from stackwise._core.stack import Run, Stacked, check_pair
from stackwise._pipeline import stage_fsdp
from stackwise._pipeline.program import (
    WHO,
    Plan,
    StageState,
    nth,
    to_chunks,
    vary,
)

__all__ = ["Blocks"]


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
# The params and state of a pattern (or of layers with state) on the stages.


class Blocks:
    """Where a pattern's params and state live on the stages: each position's layers in
    chunk blocks ``(V, S, C_p, ...)``, a layer finding its block and row by the per-layer
    tables. The same methods as ``api._Stacks`` (one layer function, no state)."""

    lead = 3  # a param leaf's dimensions before its inner ones

    def __init__(
        self, applies: tuple, pattern: bool, with_state: bool, batched_state: Any,
        plan: Plan, mesh: Any, options: Options,
    ):  # fmt: skip
        self.k, self.pattern, self.with_state = len(applies), pattern, with_state
        self.batched_state, self.plan, self.mesh = batched_state, plan, mesh
        self.layout = _layout(plan.n, self.k, plan.S, plan.V)
        self.tables = (jnp.asarray(self.layout.position), jnp.asarray(self.layout.row))
        self.core = Run(applies, plan.n, options, with_state, WHO)  # the stack's checks

    def enter(self, params: Any, state: Any) -> tuple:
        """The params (and state) as one stacked tree per position, depth checked."""
        params = self.core.positions(params, "params", self.pattern)
        if not self.with_state:
            return params, (None,) * self.k
        return params, self.core.positions(state, "state", self.pattern)

    def state_of(self, state: tuple, x: Any) -> StageState:
        flags = _batched_leaves(state, self.batched_state, x, self.plan, self.pattern)
        return StageState(flags, self.plan)

    def dims(self, params: tuple) -> tuple:
        return _fsdp_dims(params, self.mesh, self.plan, self.pattern)

    def device(self, params: tuple, state: tuple) -> tuple:
        """Each position's params and state as chunk blocks."""
        to = lambda tree: tuple(  # noqa: E731
            _to_blocks(tree[p], self.layout, p, self.plan.explicit) for p in range(self.k)
        )
        return to(params), to(state)

    def per_layer(self, call: Any) -> Any:
        """The tables and the per-layer arguments, ``(V, n/V, ...)``."""
        return to_chunks((self.tables, call.per_layer), self.plan)

    @staticmethod
    def run(one: Stacked) -> Callable:
        """``Stage.run`` of a chunk's stack ``one``: its tables' rows scanned with the
        layers, its params blocks whole (each layer takes its row)."""

        def run(chunk, h, state, j, examples, consts):
            blocks, per_layer = chunk
            return one.apply(per_layer, (h, state), j, examples, consts, blocks)

        return run

    def aux(self, aux: tuple) -> Any:
        """Each position's aux, its layers' rows of the ``(n, ...)`` aux."""
        aux = tuple(jax.tree.map(lambda a, p=p: a[p :: self.k], aux[p]) for p in range(self.k))
        return aux if self.pattern else aux[0]

    def leave(self, new_state: tuple) -> Any:
        """The new state's blocks back in the stack's layout."""
        out = tuple(
            _from_blocks(new_state[p], self.layout, p, self.plan.explicit) for p in range(self.k)
        )
        return out if self.pattern else out[0]


def _fsdp_dims(params: tuple, mesh: Any, plan: Plan, pattern: bool) -> tuple | None:
    """With ``fsdp``: per position, each leaf's inner dimension split over the FSDP axes,
    read from the stacked params as the user placed them (leaf paths as the user's)."""
    if not plan.fsdp:
        return None
    if pattern:
        return stage_fsdp.dims(params, mesh, plan, lead=1)
    return (stage_fsdp.dims(params[0], mesh, plan, lead=1),)


def _batched_leaves(state: tuple, batched_state: Any, x: Any, plan: Plan, pattern: bool):
    """Per state leaf: whether it has a batch axis (after the layer axis), checked."""
    batch = jnp.shape(jax.tree.leaves(x)[0])[0]
    paths = jax.tree_util.tree_leaves_with_path(state if pattern else state[0])
    flags, bad = [], []
    for path, leaf in paths:
        name = jax.tree_util.keystr(path) or "<root>"
        flag = batched_state if isinstance(batched_state, bool) else batched_state(name)
        if not isinstance(flag, bool):
            raise TypeError(
                f"{WHO} apply: `batched_state({name!r})` returned "
                f"{type(flag).__name__} {flag!r}; it must return a bool."
            )
        shape = jnp.shape(leaf)
        if flag and (len(shape) < 2 or shape[1] != batch):
            bad.append(f"  state{name}: shape {shape}")
        flags.append(flag)
    if bad:
        raise ValueError(
            f"{WHO} apply: with `batched_state`, a state leaf has a batch axis after its "
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
            f"{WHO} apply: state leaves without a batch axis (`batched_state` says so) "
            f"cannot be split over the batch's mesh axes {axes} (of "
            + " and ".join(f"`{a}`" for a in args)
            + f") of size {plan.D}: each data shard would update them differently. Use "
            + " and ".join(f"`{a}=None`" for a in args)
            + ", or give such state a batch axis."
        )
    tree = state if pattern else state[0]
    flags = jax.tree.unflatten(jax.tree.structure(tree), flags)
    return flags if pattern else (flags,)


# --------------------------------------------------------------------------
# One layer: its position's apply, chosen by the table.


class Layer:
    """The layer a stage's stack runs, its arguments rebuilt (per-layer keys folded with the
    microbatch's index j). With one layer function (``api._Stacks``), its params come
    with the per-layer values; with ``blocks`` (``Blocks``), the table gives its position
    and its row of the position's block, and :func:`jax.lax.switch` runs that
    position's apply."""

    def __init__(self, applies: tuple, has_aux: bool, with_state: bool, call: Any, axes: tuple):
        self.applies, self.has_aux, self.with_state, self.call = applies, has_aux, with_state, call
        self.axes = axes  # the manual mesh axes: every branch's outputs vary over them

    def __call__(self, per_layer, carry, j, examples, consts, blocks=None):
        where, slices = per_layer
        slices = [
            jax.random.fold_in(v, j) if kind == "keys" else v
            for v, kind in zip(slices, self.call.kinds)
        ]
        args, kwargs = self.call.build(slices, examples, consts)
        if blocks is None:  # one layer function: `where` is its params
            out = self.applies[0](where, carry, *args, **kwargs)
            return out if self.has_aux else (out, ())
        position, row = where
        h, state = carry
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
                return vary((carry, aux), self.axes)

            return run

        return jax.lax.switch(position, [padded(p) for p in range(len(branches))], h, state, blocks)

    def _branch(self, p: int, row: Any, args: tuple, kwargs: dict) -> Callable:
        apply = self.applies[p]

        def run(h, state, blocks):
            params = nth(blocks[p], row)
            if not self.with_state:
                out = apply(params, h, *args, **kwargs)
            else:
                old = nth(state[p], row)
                out, new = check_pair(
                    apply(params, old, h, *args, **kwargs),
                    WHO,
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
                h, aux = check_pair(
                    out,
                    WHO,
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
            f"{WHO}: a pipelined layer (pattern position {p}) must return its state with the "
            f"structure, shapes and dtypes it received (it is written back into the stacked "
            f"state), but it took\n  {shapes(old)}\nand returned\n  {shapes(new)}\n"
            "Return the updated state in the input's layout, e.g. "
            "`jax.lax.dynamic_update_slice(cache, new, pos)` for a cache."
        )

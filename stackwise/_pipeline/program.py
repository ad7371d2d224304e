"""What the schedules share: the plan, the params' layouts, the stage and its state.

:func:`stackwise.pipeline` (``api.py``) checks its arguments into a :class:`Plan`
and builds a :class:`Stage`; the schedules (``schedule_gpipe.py``,
``schedule_1f1b.py``) run it on each device, its chunks ``(V*R, ...)`` stacks
(:func:`stack_rows`, :func:`chunk_rows`) and its state carried by :class:`StageState`. The
remat policies of a stage that slices its chunk out of its stacks are here too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from stackwise._core import trees
from stackwise._core.checks import check_depth
from stackwise._core.options import Options
from stackwise._core.stack import CARRY_NAME
from stackwise._pipeline import ticks
from stackwise._upstream import jax as jax_ties

WHO = "stackwise.pipeline"


class Plan(NamedTuple):
    """A checked pipeline schedule: S stages, V chunks per stage of L layers, M microbatches."""

    n: int
    S: int
    V: int
    L: int
    M: int
    D: int  # data-axis size (1 without one)
    stage_axis: str
    data_axis: str | None
    explicit: bool  # the mesh axes are Explicit: inputs must carry their layout
    fsdp: tuple[str, ...] = ()  # mesh axes each stage's params are also split over
    gather: str = "step"  # with fsdp: gather once per call ("step") or per tick ("tick")

    @property
    def ticks(self) -> int:
        """T = M*V + S - 1: every stage runs one chunk on one microbatch per tick."""
        return ticks.gpipe_ticks(self.S, self.M, self.V)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over: ``data_axis``, then the FSDP axes."""
        first = (self.data_axis,) if self.data_axis else ()
        return first + tuple(a for a in self.fsdp if a != self.data_axis)

    @property
    def batch(self) -> str | tuple[str, ...] | None:
        """The batch's ``PartitionSpec`` entry."""
        axes = self.batch_axes
        return None if not axes else axes[0] if len(axes) == 1 else axes

    @property
    def manual(self) -> tuple[str, ...]:
        return (self.stage_axis,) + self.batch_axes


# --------------------------------------------------------------------------
# The call's batch, checked.


def check_same_batch(tree: Any, x: Any, what: str) -> None:
    """A per-example value has x's batch: a smaller one that divides the microbatches would
    be split and broadcast, where ``Stacked.apply`` gives every layer the whole value."""
    batch = jnp.shape(jax.tree.leaves(x)[0])[0]
    bad = [
        f"  {jax.tree_util.keystr(p) or '<root>'}: shape {jnp.shape(v)}"
        for p, v in jax.tree_util.tree_leaves_with_path(tree)
        if jnp.shape(v)[0] != batch
    ]
    if bad:
        raise ValueError(
            f"{WHO} apply: every leaf of `{what}` has one row per example of `x`, whose "
            f"batch is {batch}, but these leaves do not:\n"
            + "\n".join(bad)
            + f"\nGive it {batch} rows (e.g. `jnp.broadcast_to(mask, (x.shape[0], ...))`), "
            "or pass it unmarked if every example shares it."
        )


def check_batch(tree: Any, plan: Plan, what: str) -> None:
    split = plan.M * plan.D
    bad = [
        f"  {jax.tree_util.keystr(p) or '<root>'}: shape {jnp.shape(v)}"
        for p, v in jax.tree_util.tree_leaves_with_path(tree)
        if jnp.ndim(v) == 0 or jnp.shape(v)[0] % split
    ]
    if bad:
        by = f"microbatches={plan.M}"
        if plan.D > 1:
            by += f" times the {plan.batch!r} axis size {plan.D}"
        raise ValueError(
            f"{WHO} apply: every leaf of `{what}` needs a leading batch axis divisible by "
            f"{by} = {split}, but these leaves do not:\n"
            + "\n".join(bad)
            + f"\nUse a batch size that is a multiple of {split}, or another `microbatches`."
        )


# --------------------------------------------------------------------------
# Layouts: the params as (V, n/V, ...), chunk c = r*S + s at [r, s*L:(s+1)*L].


def device_layout(params: Any, plan: Plan) -> Any:
    """Params in the layout the devices run: ``(V, n/V, ...)``, from either layout."""
    leaves = trees.named_leaves(params)
    if (
        plan.V > 1
        and leaves
        and all(
            jnp.ndim(a) >= 2 and jnp.shape(a)[:2] == (plan.V, plan.n // plan.V) for _, a in leaves
        )
    ):
        return params  # already in the circular layout
    layout = (
        ""
        if plan.V == 1
        else (
            f" (or, in the circular layout of `stackwise.shard_stacked(..., repeats={plan.V})`, "
            f"({plan.V}, {plan.n // plan.V}, ...))"
        )
    )
    check_depth(
        leaves,
        plan.n,
        f"{WHO} apply",
        "params",
        f"Stacked params come from `Stacked.init` (or `stackwise.stack_layers`){layout}.",
    )
    return to_chunks(params, plan)


def to_chunks(tree: Any, plan: Plan) -> Any:
    """``(n, ...)`` leaves as ``(V, n/V, ...)``: row r holds chunks r*S, ..., r*S + S - 1."""

    def one(a):
        shape = (plan.V, plan.n // plan.V, *jnp.shape(a)[1:])
        sharding = getattr(jax.typeof(a), "sharding", None)
        spec = tuple(getattr(sharding, "spec", ()) or ())
        if plan.explicit and spec and spec[0] is not None:
            # Layers split over the stages: regroup them (a collective), keeping
            # the inner axes' sharding.
            out = NamedSharding(sharding.mesh, PartitionSpec(None, spec[0], *spec[1:]))
            return jax.lax.reshape(a, shape, out_sharding=out)
        return jnp.reshape(a, shape)

    return jax.tree.map(one, tree)


def reshard(tree: Any, mesh: Any, lead: tuple, manual: tuple) -> Any:
    """Each leaf to ``P(*lead, ...)``: its other axes keep their non-manual sharding."""
    names = lambda e: e if isinstance(e, tuple) else (e,)  # noqa: E731

    def one(v):
        if not jnp.ndim(v):
            return jax.reshard(v, NamedSharding(mesh, PartitionSpec()))
        spec = tuple(jax.typeof(v).sharding.spec)
        inner = spec[len(lead) :] if len(spec) > len(lead) else ()
        inner = [None if e is None or set(names(e)) & set(manual) else e for e in inner]
        return jax.reshard(v, NamedSharding(mesh, PartitionSpec(*lead, *inner)))

    return jax.tree.map(one, tree)


def output_spec(x: Any, plan: Plan) -> PartitionSpec:
    """The output's batch split: over data and stages when S divides a data shard's batch."""
    rows = {jnp.shape(v)[0] // plan.D for v in jax.tree.leaves(x)}
    if all(r % plan.S == 0 for r in rows):
        return PartitionSpec((*plan.batch_axes, plan.stage_axis) if plan.batch else plan.stage_axis)
    return PartitionSpec(plan.batch)


# --------------------------------------------------------------------------
# On a device: the inputs cast once, the stage, its state, its remat policy.


def vary(tree: Any, axes: tuple) -> Any:
    """Marks every leaf as varying over ``axes``: a leaf used on varying data is
    then cast once, here, and its gradient summed over ``axes`` once, here,
    instead of at every use inside the loops."""

    def one(v):
        for axis in axes:
            try:
                v = jax.lax.pcast(v, axis, to="varying")
            except ValueError:  # already varying over `axis`
                pass
        return v

    return jax.tree.map(one, tree)


def split_batch(tree: Any, M: int) -> Any:
    return jax.tree.map(lambda v: v.reshape(M, v.shape[0] // M, *v.shape[1:]), tree)


def nth(tree: Any, i: Any) -> Any:
    return jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, i, keepdims=False), tree)


def select(c: Any, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda u, v: jnp.where(c, u, v), a, b)


class StageState:
    """A stage's state in a tick loop (GPipe's or 1F1B's), from this device's ``(V, 1,
    C_p, ...)`` blocks of a pattern's state (``pattern.py``). A leaf with a batch
    axis (``batched``) runs as ``(V, C_p, M, b, ...)``: microbatch m of chunk r reads and
    writes ``[r, :, m]``; one without, as ``(V, C_p, ...)``: chunk r's ``[r]``, which the
    microbatches update in turn. Layers without state: ``batched=()``, nothing to carry."""

    def __init__(self, batched: Any, plan: Plan):
        self.batched, self.plan = batched, plan

    @property
    def specs(self) -> Any:
        """The blocks' ``shard_map`` specs: the stages, then a batched leaf's batch over the
        batch axes (``data_axis`` and the FSDP axes)."""
        plan = self.plan

        def one(batched):
            if batched and plan.batch:
                return PartitionSpec(None, plan.stage_axis, None, plan.batch)
            return PartitionSpec(None, plan.stage_axis)

        return jax.tree.map(one, self.batched)

    def enter(self, blocks: Any) -> Any:
        """The device's blocks as the tick loop carries them."""
        V, M = self.plan.V, self.plan.M
        return jax.tree.map(
            lambda v, b: v[:, 0].reshape(V, v.shape[2], M, -1, *v.shape[4:]) if b else v[:, 0],
            blocks,
            self.batched,
        )

    def _chunk_state(self, state: Any, r: Any) -> Any:
        return jax.tree.map(lambda v: v[0], state) if self.plan.V == 1 else nth(state, r)

    def take(self, state: Any, r: Any, m: Any) -> Any:
        """What chunk r reads on microbatch m: its rows of a batched leaf, an unbatched one."""
        return jax.tree.map(
            lambda v, b: jax.lax.dynamic_index_in_dim(v, m, 1, keepdims=False) if b else v,
            self._chunk_state(state, r),
            self.batched,
        )

    def put(self, state: Any, new: Any, r: Any, m: Any) -> Any:
        """``state`` with chunk r's microbatch m's part written (:meth:`take`'s inverse)."""

        def one(v, u, b):
            if b:
                u = jax.lax.dynamic_update_index_in_dim(self._chunk_state(v, r), u, m, 1)
            return u[None] if self.plan.V == 1 else jax.lax.dynamic_update_index_in_dim(v, u, r, 0)

        return jax.tree.map(one, state, new, self.batched)

    def leave(self, state: Any) -> Any:
        """The carried state back as the device's ``(V, 1, C_p, ...)`` blocks."""
        V, plan = self.plan.V, self.plan

        def one(v, b):
            return (v.reshape(V, v.shape[1], -1, *v.shape[4:]) if b else _same(v, plan))[:, None]

        return jax.tree.map(one, state, self.batched)


class Stage(NamedTuple):
    """A pipeline's stage as the schedules run it (``schedule_gpipe.py``,
    ``schedule_1f1b.py``), from the pipeline that builds it (``api.py``: one layer
    function's stack, or a pattern's blocks, ``pattern.py``). On a device the stage's V
    chunks are ``(params, per_layer)`` stacks of ``V*R`` rows (R: a leaf's rows in one
    chunk), chunk r at rows ``r*R`` to ``(r+1)*R - 1``.

    * ``run(chunk, h, state, j, examples, consts) -> ((h, state), aux)``: one chunk (its
      ``(params, per_layer)`` rows, the params gathered with FSDP) on microbatch j (its
      index over the whole batch) with its state; ``examples`` are the microbatch's rows.
    * ``params``: the params' ``shard_map`` spec; ``lead``: a param leaf's dimensions before
      its inner ones (2 in the ``(V, n/V, ...)`` layout, 3 in a pattern's ``(V, S, C_p,
      ...)`` blocks); ``dims``: with FSDP, each param leaf's inner dimension split over
      the FSDP axes (else ``None``).
    * ``state``: how the tick loops carry the stage's state (:class:`StageState`).
    """

    run: Callable[..., tuple]
    params: Any
    lead: int
    dims: Any
    state: StageState


def stack_rows(tree: Any, lead: int) -> Any:
    """Leaves with ``lead`` leading dimensions (a device's ``(V, ..., ...)`` part) as the
    ``(rows, ...)`` stacks it runs."""
    return jax.tree.map(lambda v: v.reshape(-1, *v.shape[lead:]), tree)


def chunk_rows(tree: Any, r: Any, V: int) -> Any:
    """Chunk r's rows of ``(V*R, ...)`` stacks (all of them for one chunk a stage)."""
    if V == 1:
        return tree
    return jax.tree.map(
        lambda v: jax.lax.dynamic_slice_in_dim(v, r * (v.shape[0] // V), v.shape[0] // V), tree
    )


def _same(v: Any, plan: Plan) -> Any:
    """An unbatched state leaf, the same on every device of the batch axes (all of size 1:
    ``pattern._batched_leaves`` refuses more), marked so: it met the batch in the
    tick loop."""
    if not plan.batch_axes:
        return v
    reduce = jax.lax.psum if jnp.issubdtype(v.dtype, jnp.inexact) else jax.lax.pmax
    return reduce(v, plan.batch_axes)


def never_sliced(chunks: Any, options: Options, V: int = 1) -> Callable[..., bool] | None:
    """The checkpoint policy around a circular stage: what the stage's own remat
    keeps (:func:`kept_policy`), but never a slice of ``chunks``, the device's ``(rows,
    ...)`` stacks: a tick's chunk, or a row of it (a pattern's layer takes its row).

    With ``unroll=True`` it is ``None`` (keep nothing: the stage's forward pass
    runs again in the backward pass): jax 0.10's remat DCE fails on a checkpoint
    with a policy around the Python loop's checkpoints.
    """
    if options.unroll is True:
        return None
    return unless_sliced(kept_policy(options), sliced_shapes(chunks, V))


def sliced_shapes(stacks: Any, V: int) -> set:
    """The shapes of what a stage slices out of its ``(rows, ...)`` stacks, and of
    those: the stacks, a chunk of them (``rows / V``) and one row (``(1, ...)``)."""
    shapes = set()
    for v in jax.tree.leaves(stacks):
        rows, rest = v.shape[0], tuple(v.shape[1:])
        shapes |= {(rows, *rest), (rows // V, *rest), (1, *rest)}
    return shapes


def kept_policy(options: Options) -> Callable[..., bool]:
    """What a stage's ``remat`` keeps, and the carry entering each layer: all of it with
    ``remat=False``, the carries with ``remat=True``, the policy's choice and the
    carries with a policy."""
    carries = jax.checkpoint_policies.save_only_these_names(CARRY_NAME)
    if not options.remat:
        return jax.checkpoint_policies.everything_saveable
    if options.policy is None:
        return carries
    return jax.checkpoint_policies.save_from_both_policies(options.policy, carries)


def unless_sliced(keep: Callable[..., bool], shapes: set) -> Callable[..., bool]:
    """``keep``, except that rows taken of an operand of one of ``shapes`` are never saved
    (a row of a block, a chunk of a stack; matched by primitive, its params and the
    operand's shape: :func:`stackwise._upstream.jax.unless_sliced`)."""
    return jax_ties.unless_sliced(keep, shapes)

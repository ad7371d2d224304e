"""FSDP inside pipeline stages: each stage's params also sharded over data-parallel axes.

``stackwise.pipeline(..., fsdp=axes)`` keeps every stage's params split over the
FSDP mesh axes as well as over the stages. The FSDP axes are data-parallel axes:
the batch is split over them too (with ``data_axis``, over both). Inside
:func:`jax.shard_map` they are manual axes, so a gather is one
:func:`jax.lax.all_gather` per leaf, whose transpose is a ``psum_scatter``: the
gradients come back reduce-scattered, in the params' sharded layout.

Where the gather runs (``fsdp_gather=``):

- ``"step"``: once per call, before the tick loop (MaxText's
  ``pipeline_fsdp_ag_once``); the device program runs under a checkpoint that
  saves everything but the gathered params, so the backward pass gathers them
  once more instead of keeping them from the forward pass.
- ``"tick"``: at every tick, only the chunk of layers that tick runs, inside a
  checkpoint that keeps what ``remat`` keeps but never the gathered chunk.

A pattern's pipeline (``pattern.py``) uses the same pieces with its
per-position blocks ``(V, S, C_p, ...)`` (``lead``: the dimensions before a
leaf's inner ones), gathering the blocks per step or each tick's chunk of them.

The 1F1B schedule (``schedule_1f1b.py``) is its own backward pass, which JAX does
not differentiate: it calls :func:`gather` and its transpose :func:`scatter` itself.

Which dimension of a leaf is split: the one its placement already splits over
the FSDP axes, else :func:`stackwise.fsdp_specs`' rule (the largest inner axis
the FSDP axes divide that no other mesh axis splits); a leaf with no such axis
stays replicated over them, its gradient all-reduced once per call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from stackwise._core import checks
from stackwise._core.options import Options
from stackwise._pipeline.program import WHO, kept_policy, sliced_shapes, stack_rows, unless_sliced
from stackwise._sharding.fsdp import fsdp_specs
from stackwise._upstream import jax as jax_ties

GATHERS = ("step", "tick")

# The name of a stage's params after the FSDP gather: never saved for the backward pass.
_GATHERED_NAME = "stackwise_pipeline_gathered"


# --------------------------------------------------------------------------
# The arguments, checked once.


def check(mesh: Any, fsdp: Any, gather: Any, stage_axis: str, who: str) -> tuple:
    """``(fsdp axes or (), gather)``: the FSDP axes are the mesh's, and not the stages'."""
    axes = checks.axis_names(fsdp, who, "fsdp", mesh=mesh, optional=True) or ()
    if stage_axis in axes:
        raise ValueError(
            f"{who}: `fsdp={fsdp!r}` names the stage axis {stage_axis!r}; the layers are "
            "already split over it. Name the data-parallel axes to shard each stage's params "
            f"over, e.g. `fsdp='data'`."
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"{who}: `fsdp={fsdp!r}` names a mesh axis twice; name each once.")
    if gather not in GATHERS:
        raise ValueError(
            f"{who}: `fsdp_gather` must be one of {GATHERS} (gather each stage's params once "
            f"per call, or each tick's chunk at every tick), got {gather!r}."
        )
    if not axes and gather != "step":
        raise ValueError(
            f"{who}: `fsdp_gather={gather!r}` says when FSDP gathers the params, but `fsdp` "
            "is not given: nothing is sharded. Pass `fsdp=` the mesh axes to shard the "
            "params over (e.g. `fsdp='data'`), or leave `fsdp_gather` out."
        )
    return axes, gather


def size(mesh: Any, axes: tuple) -> int:
    """The number of devices along ``axes`` of ``mesh``."""
    return math.prod(mesh.shape[a] for a in axes)


# --------------------------------------------------------------------------
# Where each leaf is split: the dimension, and the specs shard_map takes.


def dims(params: Any, mesh: Any, plan: Any, lead: int = 2) -> Any:
    """Each leaf's inner dimension split over the FSDP axes (None: it stays replicated
    over them), for params whose leaves have ``lead`` dimensions before the inner ones:
    2 in the device layout ``(V, n/V, ...)``, 1 for stacked ``(n, ...)`` leaves (a
    pattern position's)."""
    entry = plan.fsdp[0] if len(plan.fsdp) == 1 else plan.fsdp
    manual = set(plan.manual)
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    leaves = jax.tree.leaves(params)
    shapes, bases, placed = [], [], []
    for path, leaf in zip(paths, leaves):
        name = jax.tree_util.keystr(path) or "<root>"
        spec = tuple(getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", ()) or ())
        inner = _inner(spec, jnp.ndim(leaf), lead)
        at = [d for d, e in enumerate(inner) if set(_names(e)) & set(plan.fsdp)]
        if at and _names(inner[at[0]]) != plan.fsdp:
            raise ValueError(
                f"{WHO}: leaf {name} is placed with spec {PartitionSpec(*spec)} (in "
                f"{_LAYOUTS[lead]} layout), whose inner axis {at[0]} (after the layer "
                f"axis) is split over {inner[at[0]]!r}; with `fsdp={entry!r}` a stage's "
                f"params are split over exactly {entry!r}, in that order. Place it with "
                "`stackwise.shard_stacked(params, mesh, stackwise.fsdp_specs(params, mesh, "
                f"{entry!r}), layer_axis={plan.stage_axis!r})`, or pass the `fsdp` axes it "
                "is split over."
            )
        placed.append(at[0] if at else None)
        shapes.append(jax.ShapeDtypeStruct((1, *jnp.shape(leaf)[lead:]), jnp.result_type(leaf)))
        # Other mesh axes (tensor parallel) keep their dimensions; the manual ones move.
        bases.append(PartitionSpec(*[None if set(_names(e)) & manual else e for e in inner]))
    treedef = jax.tree.structure(params)
    shapes, bases = jax.tree.unflatten(treedef, shapes), jax.tree.unflatten(treedef, bases)
    specs = fsdp_specs(shapes, mesh, plan.fsdp, base=bases)
    chosen = []
    for at, spec in zip(placed, jax.tree.leaves(specs, is_leaf=_is_spec)):
        found = [d for d, e in enumerate(spec) if _names(e) == plan.fsdp]
        chosen.append(at if at is not None else found[0] if found else None)
    return jax.tree.unflatten(treedef, chosen)


def in_specs(dims_tree: Any, plan: Any, lead: int = 2) -> Any:
    """The params' ``shard_map`` specs: for leaves ``(V, S-split, ...)`` with ``lead``
    dimensions before the inner ones (3 for a pattern's ``(V, S, C_p, ...)`` blocks),
    the second over the stages and inner dimension d over the FSDP axes."""
    entry = plan.fsdp[0] if len(plan.fsdp) == 1 else plan.fsdp

    def one(d):
        inner = [] if d is None else [None] * d + [entry]
        return PartitionSpec(None, plan.stage_axis, *[None] * (lead - 2), *inner)

    return jax.tree.map(one, dims_tree, is_leaf=lambda d: d is None)


def place(params: Any, dims_tree: Any, mesh: Any, plan: Any, lead: int = 2) -> Any:
    """With explicit mesh axes: params to their ``in_specs``, other axes kept."""
    manual = set(plan.manual)
    entry = plan.fsdp[0] if len(plan.fsdp) == 1 else plan.fsdp

    def one(v, d):
        inner = _inner(tuple(jax.typeof(v).sharding.spec), jnp.ndim(v), lead)
        inner = [None if set(_names(e)) & manual else e for e in inner]
        if d is not None:
            inner[d] = entry
        spec = PartitionSpec(None, plan.stage_axis, *[None] * (lead - 2), *inner)
        return jax.reshard(v, NamedSharding(mesh, spec))

    return jax.tree.map(one, params, dims_tree, is_leaf=lambda d: d is None)


# --------------------------------------------------------------------------
# The gathers, inside the device program.


def gather(chunks: Any, dims_tree: Any, plan: Any, lead: int = 1) -> Any:
    """Leaves with ``lead`` dimensions before the inner ones (``(rows, ...)``) all-gathered
    over the FSDP axes on their split dimension."""

    def one(v, d):
        if d is None:
            return v
        whole = jax.lax.all_gather(v, plan.fsdp, axis=lead + d, tiled=True)
        return checkpoint_name(whole, _GATHERED_NAME)

    return jax.tree.map(one, chunks, dims_tree, is_leaf=lambda d: d is None)


def scatter(grads: Any, dims_tree: Any, plan: Any, lead: int = 1) -> Any:
    """The transpose of :func:`gather`: ``(rows, ...)`` gradients of gathered leaves summed
    over the FSDP axes (``psum_scatter``), each device keeping its shard."""

    def one(g, d):
        if d is None:
            return g
        return jax.lax.psum_scatter(g, plan.fsdp, scatter_dimension=lead + d, tiled=True)

    return jax.tree.map(one, grads, dims_tree, is_leaf=lambda d: d is None)


def gathered_once(
    program: Callable, dims_tree: Any, plan: Any, options: Options, lead: int = 2
) -> Callable:
    """``program(params, *rest, gather=...)`` run under a checkpoint that saves all but
    the gathered params: the backward pass gathers them again, once. ``params`` are a
    device's part of its stage's params, their leaves with ``lead`` dimensions before the
    inner ones (``(V, 1, ...)``; a pattern's blocks ``(V, 1, C_p, ...)``), which
    ``gather`` gets as ``(rows, ...)`` stacks. ``prevent_cse`` keeps the compiler from
    merging the backward pass's gather with the forward pass's (which would keep the
    gathered copy alive from one to the other)."""

    def run(*inputs):
        return program(*inputs, gather=lambda chunks: gather(chunks, dims_tree, plan))

    def checkpointed(params, *rest):
        # A circular stage slices its chunk out of the gathered stack at each tick, a
        # pattern's layer its row out of the chunk: none is saved.
        gathered = jax.eval_shape(lambda p: gather(stack_rows(p, lead), dims_tree, plan), params)
        policy = _never_gathered(options, sliced_shapes(gathered, plan.V))
        # With unroll=True the whole device program is saved nothing and runs again in
        # the backward pass: jax 0.10's remat DCE fails on a checkpoint with a policy
        # around the Python loop's checkpoints (as for the circular stage's).
        policy = None if options.unroll is True else policy
        return jax.checkpoint(run, prevent_cse=True, policy=policy)(params, *rest)

    return checkpointed


def per_tick_policy(
    options: Options, stacks: Any, gathered: Any, V: int
) -> Callable[..., bool] | None:
    """The checkpoint policy around a stage that gathers its chunk at each tick (a
    pattern's, ``gathered`` its gathered ``(C_p, ...)`` blocks): what ``remat`` keeps,
    never the gathered blocks nor a row of them, nor a chunk sliced out of ``stacks``
    (the device's ``(rows, ...)`` stacks, V chunks). ``None`` with ``unroll=True``, as
    for the step's."""
    if options.unroll is True:
        return None
    return _never_gathered(options, sliced_shapes(stacks, V) | sliced_shapes(gathered, 1))


def _never_gathered(options: Options, shapes: set = frozenset()) -> Callable[..., bool]:
    """What the stage's ``remat`` keeps (and the carries), but never a gathered chunk,
    nor a slice of an operand of one of ``shapes`` (what is sliced out of it)."""
    return _unless_gathered(unless_sliced(kept_policy(options), shapes))


def _unless_gathered(keep: Callable[..., bool]) -> Callable[..., bool]:
    """``keep``, except that an all-gather's output (the gathered params) is never saved
    (matched by primitive name: :func:`stackwise._upstream.jax.unless_all_gathered`)."""
    return jax_ties.unless_all_gathered(keep, _GATHERED_NAME)


# --------------------------------------------------------------------------

_LAYOUTS = {1: "the stacked (layers, ...)", 2: "the pipeline's (V, n/V, ...)"}


def _inner(spec: tuple, ndim: int, lead: int) -> list:
    """The entries of a leaf's spec after its ``lead`` dimensions, one per dimension."""
    return list(spec[lead:]) + [None] * (ndim - lead - len(spec[lead:]))


def _names(entry: Any) -> tuple:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _is_spec(v: Any) -> bool:
    return v is None or isinstance(v, PartitionSpec)

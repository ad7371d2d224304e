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

The 1F1B schedule (``_pipeline_1f1b.py``) is its own backward pass, which JAX does
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

from stackwise import _check
from stackwise._adapt import Options
from stackwise._sharding import fsdp_specs
from stackwise._stack import CARRY_NAME, Stacked

GATHERS = ("step", "tick")

# The name of a stage's params after the FSDP gather: never saved for the backward pass.
_GATHERED_NAME = "stackwise_pipeline_gathered"


# --------------------------------------------------------------------------
# The arguments, checked once.


def check(mesh: Any, fsdp: Any, gather: Any, stage_axis: str, who: str) -> tuple:
    """``(fsdp axes or (), gather)``: the FSDP axes are the mesh's, and not the stages'."""
    axes = _check.axis_names(fsdp, who, "fsdp", mesh=mesh, optional=True) or ()
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


def dims(params: Any, mesh: Any, plan: Any) -> Any:
    """For params in the device layout ``(V, n/V, ...)``: each leaf's inner dimension
    split over the FSDP axes (None: it stays replicated over them)."""
    entry = plan.fsdp[0] if len(plan.fsdp) == 1 else plan.fsdp
    manual = set(plan.manual)
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    leaves = jax.tree.leaves(params)
    shapes, bases, placed = [], [], []
    for path, leaf in zip(paths, leaves):
        name = jax.tree_util.keystr(path) or "<root>"
        spec = tuple(getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", ()) or ())
        inner = list(spec[2:]) + [None] * (jnp.ndim(leaf) - 2 - len(spec[2:]))
        at = [d for d, e in enumerate(inner) if set(_names(e)) & set(plan.fsdp)]
        if at and _names(inner[at[0]]) != plan.fsdp:
            raise ValueError(
                f"{_WHO}: leaf {name} is placed with spec {PartitionSpec(*spec)} (in the "
                f"pipeline's (V, n/V, ...) layout), whose inner axis {at[0]} (after the layer "
                f"axis) is split over {inner[at[0]]!r}; with `fsdp={entry!r}` a stage's "
                f"params are split over exactly {entry!r}, in that order. Place it with "
                "`stackwise.shard_stacked(params, mesh, stackwise.fsdp_specs(params, mesh, "
                f"{entry!r}), layer_axis={plan.stage_axis!r})`, or pass the `fsdp` axes it "
                "is split over."
            )
        placed.append(at[0] if at else None)
        shapes.append(jax.ShapeDtypeStruct((1, *jnp.shape(leaf)[2:]), jnp.result_type(leaf)))
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


def in_specs(dims_tree: Any, plan: Any) -> Any:
    """The params' ``shard_map`` specs: layers over the stages, dimension d over FSDP."""
    entry = plan.fsdp[0] if len(plan.fsdp) == 1 else plan.fsdp

    def one(d):
        inner = [] if d is None else [None] * d + [entry]
        return PartitionSpec(None, plan.stage_axis, *inner)

    return jax.tree.map(one, dims_tree, is_leaf=lambda d: d is None)


def place(params: Any, dims_tree: Any, mesh: Any, plan: Any) -> Any:
    """With explicit mesh axes: params to their ``in_specs``, other axes kept."""
    manual = set(plan.manual)
    entry = plan.fsdp[0] if len(plan.fsdp) == 1 else plan.fsdp

    def one(v, d):
        spec = tuple(jax.typeof(v).sharding.spec)
        inner = list(spec[2:]) + [None] * (jnp.ndim(v) - 2 - len(spec[2:]))
        inner = [None if set(_names(e)) & manual else e for e in inner]
        if d is not None:
            inner[d] = entry
        return jax.reshard(v, NamedSharding(mesh, PartitionSpec(None, plan.stage_axis, *inner)))

    return jax.tree.map(one, params, dims_tree, is_leaf=lambda d: d is None)


# --------------------------------------------------------------------------
# The gathers, inside the device program.


def gather(chunks: Any, dims_tree: Any, plan: Any) -> Any:
    """``(rows, ...)`` leaves all-gathered over the FSDP axes on their split dimension."""

    def one(v, d):
        if d is None:
            return v
        whole = jax.lax.all_gather(v, plan.fsdp, axis=1 + d, tiled=True)
        return checkpoint_name(whole, _GATHERED_NAME)

    return jax.tree.map(one, chunks, dims_tree, is_leaf=lambda d: d is None)


def scatter(grads: Any, dims_tree: Any, plan: Any) -> Any:
    """The transpose of :func:`gather`: ``(rows, ...)`` gradients of gathered leaves summed
    over the FSDP axes (``psum_scatter``), each device keeping its shard."""

    def one(g, d):
        if d is None:
            return g
        return jax.lax.psum_scatter(g, plan.fsdp, scatter_dimension=1 + d, tiled=True)

    return jax.tree.map(one, grads, dims_tree, is_leaf=lambda d: d is None)


def gathered_once(program: Callable, dims_tree: Any, plan: Any, options: Options) -> Callable:
    """``program(*inputs, gather=...)`` run under a checkpoint that saves all but the
    gathered params: the backward pass gathers them again, once. ``prevent_cse`` keeps
    the compiler from merging that gather with the forward pass's (which would keep the
    gathered copy alive from one to the other)."""

    def run(*inputs):
        return program(*inputs, gather=lambda chunks: gather(chunks, dims_tree, plan))

    def checkpointed(params, *rest):
        # A circular stage slices its chunk out of the gathered stack at each tick:
        # neither is saved (the slice's operand has a gathered stack's shape).
        stacks = {
            tuple(jnp.shape(v))
            for v in jax.tree.leaves(
                jax.eval_shape(lambda p: gather(_rows(p), dims_tree, plan), params)
            )
        }

        keep = _never_gathered(options)

        def policy(prim, *avals, **params):
            if prim.name == "dynamic_slice" and tuple(avals[0].shape) in stacks:
                return False
            return keep(prim, *avals, **params)

        # With unroll=True the whole device program is saved nothing and runs again in
        # the backward pass: jax 0.10's remat DCE fails on a checkpoint with a policy
        # around the Python loop's checkpoints (as for the circular stage's).
        policy = None if options.unroll is True else policy
        return jax.checkpoint(run, prevent_cse=True, policy=policy)(params, *rest)

    return checkpointed


def _rows(params: Any) -> Any:
    """``(V, L, ...)`` leaves as the ``(V*L, ...)`` stack a device runs."""
    return jax.tree.map(lambda v: v.reshape(v.shape[0] * v.shape[1], *v.shape[2:]), params)


def gathered_per_tick(stage: Stacked, dims_tree: Any, plan: Any, options: Options) -> Stacked:
    """A stage whose apply gathers its chunk first, never keeping the gathered copy."""

    def apply(chunk, h, *args):
        params, slices = chunk
        return stage.apply((gather(params, dims_tree, plan), slices), h, *args)

    policy = None if options.unroll is True else _never_gathered(options)
    return Stacked(None, jax.checkpoint(apply, prevent_cse=False, policy=policy), stage.n)


def _never_gathered(options: Options) -> Callable[..., bool]:
    """What the stage's ``remat`` keeps (and the carries), but never a gathered chunk."""
    carries = jax.checkpoint_policies.save_only_these_names(CARRY_NAME)
    if not options.remat:
        return _unless_gathered(jax.checkpoint_policies.everything_saveable)
    if options.policy is None:
        return _unless_gathered(carries)
    both = jax.checkpoint_policies.save_from_both_policies(options.policy, carries)
    return _unless_gathered(both)


def _unless_gathered(keep: Callable[..., bool]) -> Callable[..., bool]:
    """``keep``, except that an all-gather's output (the gathered params) is never saved."""

    def save(prim, *avals, **params):
        if prim.name == "all_gather" or (prim.name == "name" and params["name"] == _GATHERED_NAME):
            return False
        return keep(prim, *avals, **params)

    return save


# --------------------------------------------------------------------------

_WHO = "stackwise.pipeline"  # as _pipeline_program names it (not imported: a cycle)


def _names(entry: Any) -> tuple:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _is_spec(v: Any) -> bool:
    return v is None or isinstance(v, PartitionSpec)

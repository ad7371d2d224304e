"""Pipeline parallelism over the layer axis: GPipe and circular schedules.

The n layers are split into S stages along a mesh axis and the batch into M
microbatches; :func:`jax.shard_map` runs one program per device and
:func:`jax.lax.ppermute` hands each microbatch's activations to the next
stage. Each stage runs its layers with :func:`stackwise.stack` (the core's
scan and remat), so there is no second scan here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from stackwise._adapt import check_depth, tree_leaves
from stackwise._markers import _PerLayer
from stackwise._stack import stack

__all__ = ["pipeline"]

_SCHEDULES = ("gpipe", "circular")


def _int_arg(value: Any, name: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TypeError(
            f"stackwise.pipeline: `{name}` must be a positive Python int, got "
            f"{type(value).__name__} {value!r}. {fix}"
        )
    return value


def _mesh_axis(mesh: Any, axis: str, arg: str) -> int:
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(
            f"stackwise.pipeline: `mesh` must be a `jax.sharding.Mesh`, got "
            f"{type(mesh).__name__}. Build one with e.g. `jax.make_mesh((4, 2), "
            "('stage', 'data'))`."
        )
    if axis not in mesh.shape:
        raise ValueError(
            f"stackwise.pipeline: `{arg}={axis!r}` is not an axis of the mesh, whose "
            f"axes are {dict(mesh.shape)}. Pass `{arg}=` one of {tuple(mesh.shape)}, or "
            f"build the mesh with a {axis!r} axis, e.g. `jax.make_mesh((4, 2), "
            "('stage', 'data'))`."
        )
    return mesh.shape[axis]


def _reshard(tree: Any, mesh: Any, lead: str | None, manual: frozenset) -> Any:
    """Moves each leaf to ``P(lead, ...)``, keeping its other non-manual axes."""

    def one(v):
        spec = tuple(jax.typeof(v).sharding.spec)[1:]
        names = lambda e: e if isinstance(e, tuple) else (e,)  # noqa: E731
        inner = [None if e is None or set(names(e)) & manual else e for e in spec]
        full = PartitionSpec(lead, *inner) if jnp.ndim(v) else PartitionSpec()
        return jax.reshard(v, NamedSharding(mesh, full))

    return jax.tree.map(one, tree)


def _vary(v: jax.Array, axis: str) -> jax.Array:
    try:
        return jax.lax.pcast(v, axis, to="varying")
    except ValueError:  # already varying over `axis`
        return v


def pipeline(
    apply: Callable[..., Any],
    n: int,
    mesh: Mesh,
    *,
    microbatches: int,
    stage_axis: str = "stage",
    data_axis: str | None = None,
    schedule: str = "gpipe",
    repeats: int | None = None,
    remat: bool | Callable[..., bool] = False,
    nested: bool | int = False,
    unroll: int | bool = 1,
) -> Callable[..., Any]:
    """A pipeline-parallel apply for ``n`` stacked layers: stages on a mesh axis.

    Takes the same layer ``apply`` and ``n`` as :func:`stackwise.stack` and
    returns ``y = pipelined(params, x, *args, **kwargs)`` that computes what
    ``stackwise.stack(init, apply, n).apply(params, x, *args, **kwargs)``
    does, with the same stacked ``params`` (layer axis first), but with the
    layers split into ``S = mesh.shape[stage_axis]`` stages: stage s holds
    layers ``s*n/S`` to ``(s+1)*n/S - 1``, the batch is split into
    ``microbatches`` microbatches, and each microbatch's activations move from
    stage to stage with :func:`jax.lax.ppermute` inside :func:`jax.shard_map`.

    Schedules (``T`` ticks, each running ``n/(S*V)`` layers on one microbatch
    per stage):

    * ``"gpipe"``: microbatch m enters stage 0 at tick m; ``T = M + S - 1``,
      of which ``S - 1`` are the fill/drain bubble: (S-1)/(M+S-1) idle.
    * ``"circular"`` (interleaved): each device holds ``V = repeats`` chunks
      of ``n/(S*V)`` layers (chunks s, s+S, s+2S, ...) and every microbatch
      goes round the ring of stages V times; ``T = M*V + S - 1``, so the
      bubble shrinks to (S-1)/(M*V+S-1). Needs ``M >= S``.

    Inside a stage the layers run with ``stackwise.stack(..., remat=remat,
    nested=nested, unroll=unroll)``. With ``data_axis`` the batch is also
    split over that mesh axis (data parallelism); gradients of the params
    are summed over it by JAX.

    >>> import jax, jax.numpy as jnp, numpy as np, stackwise
    >>> from jax.sharding import Mesh
    >>> def init(key):
    ...     return {"w": jax.random.normal(key, (8, 8)) / 8**0.5}
    >>> def apply(params, x):
    ...     return x + jnp.tanh(x @ params["w"])
    >>> layers = stackwise.stack(init, apply, n=4)
    >>> params = layers.init(jax.random.key(0))
    >>> x = jnp.ones((6, 8))
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("stage",))
    >>> pipelined = stackwise.pipeline(apply, 4, mesh, microbatches=3)
    >>> y = jax.jit(pipelined)(params, x)
    >>> bool(jnp.allclose(y, layers.apply(params, x), atol=1e-6))
    True

    Args:
      apply: ``x = apply(layer_params, x, *args, **kwargs)`` for one layer, as
        for :func:`stackwise.stack` (``has_aux``/``with_state`` layers are not
        pipelined).
      n: the number of layers; ``S * repeats`` must divide it.
      mesh: the device mesh; it must have ``stage_axis`` (and ``data_axis``).
        Other mesh axes stay under the compiler's control (e.g. for tensor
        parallel specs on the params).
      microbatches: M, the number of microbatches; ``M`` (times the
        ``data_axis`` size) must divide the batch.
      stage_axis: the mesh axis the stages are laid out on.
      data_axis: a mesh axis to split the batch over as well, or ``None``.
      schedule: ``"gpipe"`` or ``"circular"``.
      repeats: for ``"circular"``: V, the chunks per device (default
        ``n // S``: one layer per chunk, the smallest bubble).
      remat: passed to :func:`stackwise.stack` for each stage.
      nested: passed to :func:`stackwise.stack` for each stage.
      unroll: passed to :func:`stackwise.stack` for each stage.

    Returns:
      ``pipelined(params, x, *args, **kwargs) -> y``. ``x`` is an array or a
      pytree whose leaves all have the batch axis first; ``params`` are the
      usual stacked params (place them with ``stackwise.shard_stacked(params,
      mesh, layer_axis=stage_axis)`` to avoid moving them at each call).
      Other arguments reach every layer unchanged (arrays are replicated to
      every stage; per-example inputs belong in ``x``).

    Raises:
      ValueError: a mesh without ``stage_axis``/``data_axis``, ``n`` not
        divisible by ``S * repeats``, ``M < S`` for ``"circular"``, an
        unknown ``schedule``; at call time, a batch not divisible by
        ``M`` (times the data-axis size) or params without the layer axis.
      TypeError: non-int ``n``/``microbatches``/``repeats``, or a
        per-layer argument (:func:`stackwise.per_layer` and friends).
    """
    if not callable(apply):
        raise TypeError(
            f"stackwise.pipeline: `apply` must be the per-layer apply function, got "
            f"{type(apply).__name__}. Call it as `stackwise.pipeline(apply, n, mesh, "
            "microbatches=M)` with the same `apply` and `n` as `stackwise.stack`."
        )
    n = _int_arg(n, "n", "It is the number of layers, as given to `stackwise.stack`.")
    M = _int_arg(microbatches, "microbatches", "It is the number of microbatches M.")
    S = _mesh_axis(mesh, stage_axis, "stage_axis")
    D = 1
    if data_axis is not None:
        if data_axis == stage_axis:
            raise ValueError(
                f"stackwise.pipeline: `data_axis` and `stage_axis` are both {stage_axis!r}; "
                "the batch and the stages need two different mesh axes."
            )
        D = _mesh_axis(mesh, data_axis, "data_axis")
    if schedule not in _SCHEDULES:
        raise ValueError(
            f"stackwise.pipeline: `schedule` must be one of {_SCHEDULES}, got {schedule!r}."
        )
    if schedule == "gpipe":
        if repeats not in (None, 1):
            raise ValueError(
                f"stackwise.pipeline: `repeats={repeats!r}` needs `schedule='circular'`; "
                "the 'gpipe' schedule runs each stage's layers once per microbatch."
            )
        V = 1
    else:
        V = n // S if repeats is None else _int_arg(repeats, "repeats", "")
        if M < S:
            raise ValueError(
                f"stackwise.pipeline: the 'circular' schedule needs at least as many "
                f"microbatches as stages, got microbatches={M} for {S} stages on mesh "
                f"axis {stage_axis!r}. Use microbatches >= {S}, or schedule='gpipe'."
            )
    if V < 1 or n % (S * V):
        per = f"S={S} stages" if V == 1 else f"S*repeats={S}*{V}={S * V} chunks"
        raise ValueError(
            f"stackwise.pipeline: n={n} layers cannot be split evenly into {per} "
            f"(mesh axis {stage_axis!r} has size {S}). Use a number of layers divisible "
            f"by {S * max(V, 1)}"
            + (", or another `repeats`" if V > 1 else "")
            + ", or a mesh whose stage axis divides n."
        )
    L = n // (S * V)
    stage = stack(None, apply, L, remat=remat, nested=nested, unroll=unroll)
    manual = frozenset({stage_axis} | ({data_axis} if data_axis else set()))
    vary = tuple(sorted(manual))
    explicit = jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())

    def run(params, x, consts, rebuild):
        """One device's program: its ``V*L`` layers, its share of the batch."""
        s = jax.lax.axis_index(stage_axis)
        a, kw = rebuild(consts)
        chunks = jax.tree.map(lambda p: p.reshape(V, L, *p.shape[1:]), params)
        mbs = jax.tree.map(lambda v: v.reshape(M, v.shape[0] // M, *v.shape[1:]), x)

        def pvary(tree):
            """Marks the scan's initial carry as varying over the manual axes."""
            return jax.tree.map(lambda v: functools.reduce(_vary, vary, v), tree)

        take = lambda tree, i: jax.tree.map(  # noqa: E731
            lambda v: jax.lax.dynamic_index_in_dim(v, i, keepdims=False), tree
        )

        def put(tree, i, value, when):
            return jax.tree.map(
                lambda b, v: jax.lax.dynamic_update_index_in_dim(
                    b, jnp.where(when, v, jax.lax.dynamic_index_in_dim(b, i, keepdims=False)),
                    i, 0,
                ),
                tree, value,
            )

        where = lambda c, t, f: jax.tree.map(lambda u, v: jnp.where(c, u, v), t, f)  # noqa: E731
        total = M * V

        def tick(carry, t):
            state, outputs, circ = carry
            k = t - s  # this stage's step: microbatch k % M, round k // M
            kc = jnp.clip(k, 0, total - 1)
            m, r = kc % M, kc // M
            fresh = take(mbs, m)
            if V > 1:
                # What reached stage 0 came from the last stage's previous tick:
                # park it until its microbatch's next round comes up.
                k_in = t - S
                arrived = (s == 0) & (k_in >= 0) & (k_in < total)
                circ = put(circ, jnp.clip(k_in, 0, total - 1) % M, state, arrived)
                fresh = where(r == 0, fresh, take(circ, m))
            out = stage.apply(take(chunks, r), where(s == 0, fresh, state), *a, **kw)
            done = (s == S - 1) & (k >= 0) & (k < total) & (r == V - 1)
            outputs = put(outputs, m, out, done)
            if S > 1:
                ring = [(i, (i + 1) % S) for i in range(S if V > 1 else S - 1)]
                out = jax.lax.ppermute(out, stage_axis, ring)
            return (out, outputs, circ), None

        zeros = jax.tree.map(jnp.zeros_like, mbs)
        init = pvary((take(mbs, 0), zeros, zeros if V > 1 else None))
        (_, outputs, _), _ = jax.lax.scan(tick, init, jnp.arange(total + S - 1))
        # Only the last stage wrote outputs (the rest are zeros): share them.
        outputs = jax.lax.psum(outputs, stage_axis)
        return jax.tree.map(lambda v: v.reshape(v.shape[0] * v.shape[1], *v.shape[2:]), outputs)

    def pipelined(params, x, *args, **kwargs):
        check_depth(
            tree_leaves(params), n, "stackwise.pipeline apply", "params",
            "Stacked params come from `Stacked.init` (or `stackwise.stack_layers`).",
        )
        bad = [
            f"  {jax.tree_util.keystr(p) or 'x'}: shape {jnp.shape(v)}"
            for p, v in jax.tree_util.tree_leaves_with_path(x)
            if jnp.ndim(v) == 0 or jnp.shape(v)[0] % (M * D)
        ]
        if bad:
            split = f"microbatches={M}"
            if D > 1:
                split += f" times the {data_axis!r} axis size {D}"
            raise ValueError(
                f"stackwise.pipeline apply: every leaf of `x` needs a leading batch axis "
                f"divisible by {split} = {M * D}, but these leaves do not:\n"
                + "\n".join(bad)
                + f"\nUse a batch size that is a multiple of {M * D}, or another "
                "`microbatches`."
            )
        leaves, treedef = jax.tree_util.tree_flatten(
            (args, kwargs), is_leaf=lambda v: isinstance(v, _PerLayer)
        )
        if any(isinstance(v, _PerLayer) for v in leaves):
            raise TypeError(
                "stackwise.pipeline apply: per-layer arguments (`stackwise.per_layer`, "
                "`per_layer_keys`, `layer_index`) are not supported in a pipeline; pass "
                "per-layer values as part of the stacked `params` instead."
            )
        is_array = [isinstance(v, (jax.Array, jnp.ndarray)) for v in leaves]
        consts = [v for v, arr in zip(leaves, is_array) if arr]

        def rebuild(arrays):
            it = iter(arrays)
            return jax.tree_util.tree_unflatten(
                treedef, [next(it) if arr else v for v, arr in zip(leaves, is_array)]
            )

        if V > 1:  # device s holds chunks s, s+S, ...: reorder the layer axis.
            params = jax.tree.map(
                lambda p: p.reshape(V, S, L, *p.shape[1:]).swapaxes(0, 1).reshape(p.shape),
                params,
            )
        batch = PartitionSpec(data_axis)
        if explicit:  # Explicit mesh axes: inputs must already carry the in_specs.
            params = _reshard(params, mesh, stage_axis, manual)
            x = _reshard(x, mesh, data_axis, manual)
            consts = _reshard(consts, mesh, None, manual)
        fn = jax.shard_map(
            lambda p, v, c: run(p, v, c, rebuild),
            mesh=mesh,
            in_specs=(PartitionSpec(stage_axis), batch, PartitionSpec()),
            out_specs=batch,
            axis_names=manual,
        )
        return fn(params, x, consts)

    return pipelined

"""Pipeline parallelism over the layer axis: :func:`pipeline`, its checks, and its apply.

The n layers are split into S stages along a mesh axis and the batch into M
microbatches; :func:`jax.shard_map` runs one program per device (a schedule's tick
loop, ``schedule_gpipe.py`` or ``schedule_1f1b.py``) and :func:`jax.lax.ppermute`
hands activations to the next stage. Each stage's layers run with
:func:`stackwise.stack` (the core's scan and remat).

The module reads top-down: :func:`pipeline` checks every argument (:func:`_checked`)
and returns :class:`_Pipelined`, its apply: it sorts the call's arguments
(:func:`_split_args`), lays the params out on the stages (:class:`_Stacks` for one
layer function, ``pattern.Blocks`` for a pattern or layers with state: a plain stack is
a pattern of one layer without state), builds the :class:`program.Stage`
and runs the schedule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from stackwise._core import checks, serving
from stackwise._core.markers import PerExample, PerLayer, split_markers
from stackwise._core.options import check_layers, check_options
from stackwise._core.stack import DEFAULT_REMAT, Stacked, apply_args, stack
from stackwise._pipeline import schedule_1f1b, schedule_gpipe, stage_fsdp
from stackwise._pipeline.pattern import Blocks, Layer
from stackwise._pipeline.program import (
    WHO,
    Plan,
    Stage,
    StageState,
    check_batch,
    check_same_batch,
    device_layout,
    output_spec,
    reshard,
    to_chunks,
)

__all__ = ["pipeline"]

_SCHEDULES = ("gpipe", "circular", "1f1b")


# --------------------------------------------------------------------------
# The public constructor.


def pipeline(
    init: Callable[..., Any] | Sequence[Callable[..., Any]] | None,
    apply: Callable[..., Any] | Sequence[Callable[..., Any]],
    n: int,
    mesh: Mesh | None = None,
    *,
    microbatches: int,
    stage_axis: str = "stage",
    data_axis: str | None = None,
    schedule: str = "gpipe",
    repeats: int | None = None,
    fsdp: str | tuple[str, ...] | None = None,
    fsdp_gather: str = "step",
    remat: bool | Callable[..., Any] = DEFAULT_REMAT,
    nested: bool | int = False,
    unroll: int | bool = 1,
    has_aux: bool = False,
    loss: Callable[..., Any] | None = None,
    with_state: bool = False,
    batched_state: bool | Callable[[str], bool] = True,
) -> Stacked:
    """:func:`stackwise.stack` with the layers run as pipeline stages on a mesh axis.

    Takes what :func:`stackwise.stack` takes and returns the same
    :class:`stackwise.Stacked` ``(init, apply, n)``: ``init`` is the stack's
    (the usual stacked params, layer axis first) and ``apply(params, x,
    *args, **kwargs)`` computes what the stack's apply computes, with the
    layers split into ``S = mesh.shape[stage_axis]`` stages and the batch
    into ``microbatches`` microbatches. Stage s holds layers ``s*n/S`` to
    ``(s+1)*n/S - 1``; each microbatch's activations move from stage to stage
    with :func:`jax.lax.ppermute` inside :func:`jax.shard_map`. The schedules,
    what runs where, the params' layouts, patterns, state and FSDP are
    described in ``docs/distributed.md`` ("Pipeline parallelism").

    >>> import jax, jax.numpy as jnp, numpy as np, stackwise
    >>> from jax.sharding import Mesh
    >>> def init(key):
    ...     return {"w": jax.random.normal(key, (8, 8)) / 8**0.5}
    >>> def apply(params, x):
    ...     return x + jnp.tanh(x @ params["w"])
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("stage",))
    >>> layers = stackwise.stack(init, apply, n=4)
    >>> pipelined = stackwise.pipeline(init, apply, 4, mesh, microbatches=3)
    >>> params = pipelined.init(jax.random.key(0))
    >>> x = jnp.ones((6, 8))
    >>> y = jax.jit(pipelined.apply)(params, x)
    >>> bool(jnp.allclose(y, layers.apply(params, x), atol=1e-5))
    True

    With ``schedule="1f1b"`` the pipeline computes the loss too: ``apply(params,
    x, targets, *args, loss_params=None)`` returns the mean over the microbatches
    of ``loss(y_m, targets_m[, loss_params])``, and each microbatch's backward
    pass starts as soon as its forward pass leaves the last stage:

    >>> mse = lambda y, t: jnp.mean((y - t) ** 2)
    >>> trained = stackwise.pipeline(init, apply, 4, mesh, microbatches=3,
    ...                              schedule="1f1b", loss=mse)
    >>> targets = jnp.zeros((6, 8))
    >>> loss, grads = jax.jit(jax.value_and_grad(trained.apply))(params, x, targets)
    >>> bool(jnp.allclose(loss, mse(layers.apply(params, x), targets), atol=1e-5))
    True

    A pattern of k layers (``init`` and ``apply`` as sequences) takes the stack's
    params, a tuple of k stacked trees; with ``with_state=True``, ``apply(params,
    state, x, ...)`` returns ``(out, new_state)`` as the stack's does (with
    ``"1f1b"``, ``(loss, new_state)``, the state not differentiated):

    >>> def counted(key):
    ...     return init(key), {"calls": jnp.zeros((), jnp.int32)}
    >>> def counting(params, state, x):
    ...     return apply(params, x), {"calls": state["calls"] + 1}
    >>> def stateless(key):
    ...     return init(key), None
    >>> def doubling(params, state, x):
    ...     return 2 * apply(params, x), state
    >>> pattern = stackwise.pipeline([counted, stateless], [counting, doubling], 3, mesh,
    ...                              microbatches=3, with_state=True, batched_state=False)
    >>> params, state = pattern.init(jax.random.key(0))
    >>> y, state = jax.jit(pattern.apply)(params, state, x)
    >>> state[0]["calls"].tolist()  # layers 0 and 2, once per microbatch
    [3, 3]

    Args:
      init: as for :func:`stackwise.stack` (``None``: params come from
        elsewhere; a sequence of k for a pattern). ``Stacked.init`` is the
        stack's, unplaced.
      apply: ``x = apply(layer_params, x, *args, **kwargs)`` for one layer,
        as for :func:`stackwise.stack`; with ``has_aux``, ``(x, aux)``; with
        ``with_state``, ``(out, layer_state) = apply(layer_params,
        layer_state, x, ...)``; a sequence of k for a pattern.
      n: the number of layers.
      mesh: a :class:`jax.sharding.Mesh` with ``stage_axis`` (and
        ``data_axis``, ``fsdp``).
      microbatches: M; it (times the batch axes' size) must divide the batch.
      stage_axis: the mesh axis the stages are laid out on.
      data_axis: a mesh axis to split the batch over as well (the params'
        gradients summed over it once per call), or ``None``.
      schedule: ``"gpipe"``, ``"circular"`` (each stage ``repeats`` chunks,
        the microbatches going round the ring) or ``"1f1b"`` (needs ``loss``).
      repeats: V, the chunks per stage: for ``"circular"`` (default ``n // S``)
        and ``"1f1b"`` (interleaved; default 1). Params in the circular layout
        of ``stackwise.shard_stacked(..., repeats=V)`` are taken as they are.
      fsdp: a mesh axis, or a tuple of them, to split each stage's params over
        as well (FSDP; the batch too), or ``None``.
      fsdp_gather: with ``fsdp``: ``"step"`` (gather each stage's params once
        per call) or ``"tick"`` (gather each tick's chunk at that tick).
      remat, nested, unroll: passed to :func:`stackwise.stack` for each stage.
      has_aux: the layer returns ``(x, aux)``; ``apply`` returns ``(y, aux)``
        with aux stacked along a leading ``n`` axis, each layer's summed over
        microbatches and data shards (bubble ticks excluded).
      loss: for ``"1f1b"`` (and only for it): ``loss(y, targets)``, one float
        scalar for a microbatch's output ``y`` and its rows of ``targets``
        (``loss(y, targets, loss_params)`` when ``apply`` is given ``loss_params=``).
      with_state: the layers carry per-layer state, as for :func:`stackwise.stack`.
      batched_state: which state leaves have a batch axis (after the layer
        axis, of ``x``'s batch), split into microbatches with ``x``: ``True``
        (all: caches), ``False`` (none: statistics, counters, updated by the
        microbatches in order), or a function of a leaf's path
        (``jax.tree_util.keystr``) returning a bool.

    Returns:
      A :class:`stackwise.Stacked`.

    Raises:
      TypeError: non-int ``n``/``microbatches``/``repeats``, a non-callable
        ``apply`` or ``loss``, a ``batched_state`` neither bool nor function; at
        call time, a pattern's params or state not a tuple of k trees, a layer
        that changes its state's shapes, and for ``"1f1b"``, missing ``targets``
        or a ``loss`` that does not return a float scalar.
      ValueError: a mesh without ``stage_axis``/``data_axis``/``fsdp`` axes,
        ``stage_axis`` among the ``fsdp`` axes, an unknown ``fsdp_gather`` (or
        one without ``fsdp``), ``n`` not divisible by ``S * repeats``,
        ``repeats`` with ``"gpipe"``, ``M < S`` or ``S < 2`` for
        ``"circular"``, ``S < 2`` or M not a multiple of S for ``"1f1b"`` with
        ``repeats > 1``, an unknown ``schedule``, ``"1f1b"`` without ``loss``
        or with ``has_aux``, ``loss`` with another schedule; at call time, a
        batch (of ``x``, per-example arguments or ``targets``) not divisible by
        ``M`` (times the batch axes' size), params of neither layout, a leaf
        placed over the ``fsdp`` axes otherwise than ``fsdp`` names them, state
        of the wrong depth, a batched state leaf without ``x``'s batch, or
        unbatched state with the batch split over more than one device.
    """
    plain, applies, pattern, plan, options = _checked(
        init, apply, n, mesh, microbatches=microbatches, stage_axis=stage_axis,
        data_axis=data_axis, schedule=schedule, repeats=repeats, fsdp=fsdp,
        fsdp_gather=fsdp_gather, remat=remat, nested=nested, unroll=unroll, has_aux=has_aux,
        loss=loss, with_state=with_state, batched_state=batched_state,
    )  # fmt: skip
    if pattern or with_state:
        where = Blocks(applies, pattern, with_state, batched_state, plan, mesh, options)
    else:
        where = _Stacks(plan, mesh)
    layers = dict(remat=remat, nested=nested, unroll=unroll)
    run = _Pipelined(where, applies, plan, mesh, options, layers, has_aux, with_state, loss)
    return Stacked(plain.init, run, n)


# --------------------------------------------------------------------------
# Every argument, checked once.


def _checked(
    init, apply, n, mesh, *, microbatches, stage_axis, data_axis, schedule, repeats, fsdp,
    fsdp_gather, remat, nested, unroll, has_aux, loss, with_state, batched_state,
) -> tuple[Stacked, tuple, bool, Plan, Any]:  # fmt: skip
    """``(plain stack, applies, pattern, plan, options)`` of :func:`pipeline`'s arguments,
    or the error that names the argument."""
    sequences = isinstance(init, (list, tuple)) or isinstance(apply, (list, tuple))
    if not sequences and not callable(apply):
        raise TypeError(
            f"{WHO}: `pipeline` takes `(init, apply, n, mesh)`, the arguments of "
            "`stackwise.stack` and a mesh, e.g. `stackwise.pipeline(init, apply, n, mesh, "
            "microbatches=8)`; pass `init=None` when the params come from elsewhere. Got "
            f"apply={apply!r}, mesh={mesh!r}."
        )
    # Checks n (and the pattern, with_state); its init is the pipeline's.
    plain = stack(init, apply, n, with_state=with_state, name=WHO)
    plan = _plan(n, mesh, microbatches, stage_axis, data_axis, schedule, repeats, fsdp, fsdp_gather)
    options = check_options(
        WHO, n, remat=remat, nested=nested, unroll=unroll, reverse=False, has_aux=has_aux
    )
    _check_loss_option(schedule, loss, has_aux)
    _, applies, pattern = check_layers(init, apply, WHO)
    if (pattern or with_state) and not (isinstance(batched_state, bool) or callable(batched_state)):
        raise TypeError(
            f"{WHO}: `batched_state` must be a bool or a function of a state leaf's path "
            "(a `jax.tree_util.keystr` string) returning a bool, got "
            f"{type(batched_state).__name__} {batched_state!r}."
        )
    return plain, applies, pattern, plan, options


def _int_arg(value: Any, name: str, fix: str) -> int:
    try:
        value = checks.integer(value, WHO, name)
    except TypeError:
        value = None
    if value is None or value < 1:
        raise TypeError(
            f"{WHO}: `{name}` must be a positive Python int, got "
            f"{type(value).__name__} {value!r}. {fix}"
        )
    return value


def _mesh_axis(mesh: Any, axis: str, arg: str) -> int:
    if axis not in mesh.shape:
        raise ValueError(
            f"{WHO}: `{arg}={axis!r}` is not an axis of the mesh, whose axes are "
            f"{dict(mesh.shape)}. Pass `{arg}=` one of {tuple(mesh.shape)}, or build "
            f"the mesh with a {axis!r} axis, e.g. `jax.make_mesh((4, 2), ('stage', 'data'))`."
        )
    return mesh.shape[axis]


def _plan(
    n, mesh, microbatches, stage_axis, data_axis, schedule, repeats, fsdp=None, gather="step"
) -> Plan:
    mesh = checks.mesh(mesh, WHO)
    for arg, axis in (("stage_axis", stage_axis), ("data_axis", data_axis)):
        if not (isinstance(axis, str) or (axis is None and arg == "data_axis")):
            raise TypeError(
                f"{WHO}: `{arg}` must be one mesh axis name (a str)"
                + (" or None" if arg == "data_axis" else "")
                + f", got {type(axis).__name__} {axis!r}."
            )
    M = _int_arg(microbatches, "microbatches", "It is the number of microbatches M.")
    S = _mesh_axis(mesh, stage_axis, "stage_axis")
    D = 1
    if data_axis is not None:
        if data_axis == stage_axis:
            raise ValueError(
                f"{WHO}: `data_axis` and `stage_axis` are both {stage_axis!r}; the "
                "batch and the stages need two different mesh axes."
            )
        D = _mesh_axis(mesh, data_axis, "data_axis")
    if schedule not in _SCHEDULES:
        raise ValueError(f"{WHO}: `schedule` must be one of {_SCHEDULES}, got {schedule!r}.")
    if schedule == "gpipe" and repeats not in (None, 1):
        raise ValueError(
            f"{WHO}: `repeats={repeats!r}` needs `schedule='circular'` (or '1f1b', "
            "interleaved); the 'gpipe' schedule runs each stage's layers once per microbatch."
        )
    if schedule == "gpipe" or (schedule == "1f1b" and repeats is None):
        V = 1
    else:
        V = n // S if repeats is None else _int_arg(repeats, "repeats", "")
    if V > 1 or schedule == "circular":
        what = f"the {schedule!r} schedule" + (f" with repeats={V}" if schedule == "1f1b" else "")
        if S < 2:
            raise ValueError(
                f"{WHO}: {what} needs at least 2 stages, but mesh axis {stage_axis!r} has "
                f"size {S}. "
                + ("Use repeats=1." if schedule == "1f1b" else "Use schedule='gpipe'.")
            )
        if schedule == "circular" and M < S:
            raise ValueError(
                f"{WHO}: the 'circular' schedule needs at least as many microbatches as "
                f"stages, got microbatches={M} for {S} stages on mesh axis {stage_axis!r}. "
                f"Use microbatches >= {S}, or schedule='gpipe'."
            )
        if schedule == "1f1b" and M % S:
            fits = " or ".join(str(k) for k in (M - M % S, M - M % S + S) if k)
            raise ValueError(
                f"{WHO}: {what} (interleaved 1F1B) runs the microbatches in groups of S={S} "
                f"(the stages on mesh axis {stage_axis!r}), so `microbatches` must be a "
                f"multiple of {S}, got microbatches={M}. Use microbatches={fits}, or repeats=1."
            )
    if V < 1 or n % (S * V):
        per = f"S={S} stages" if V == 1 else f"S*repeats={S}*{V}={S * V} chunks"
        raise ValueError(
            f"{WHO}: n={n} layers cannot be split evenly into {per} (mesh axis "
            f"{stage_axis!r} has size {S}). Use a number of layers divisible by "
            f"{S * max(V, 1)}"
            + (", or another `repeats`" if V > 1 else "")
            + ", or a mesh whose stage axis divides n."
        )
    explicit = jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())
    fsdp, gather = stage_fsdp.check(mesh, fsdp, gather, stage_axis, WHO)
    D *= stage_fsdp.size(mesh, tuple(a for a in fsdp if a != data_axis))
    return Plan(n, S, V, n // (S * V), M, D, stage_axis, data_axis, explicit, fsdp, gather)


def _check_loss_option(schedule: str, loss: Any, has_aux: bool) -> None:
    """``loss=`` comes with ``schedule='1f1b'`` and only with it."""
    if schedule == "1f1b" and loss is None:
        raise ValueError(
            f"{WHO}: schedule='1f1b' needs `loss=`: a microbatch's backward pass starts as "
            "soon as its forward leaves the last stage, so the pipeline computes the loss "
            "itself. Pass `loss=lambda y, targets: ...` (one float scalar per microbatch); "
            "`apply(params, x, targets, *args)` then returns its mean over microbatches."
        )
    if loss is not None and schedule != "1f1b":
        raise ValueError(
            f"{WHO}: `loss=` is for schedule='1f1b', got schedule={schedule!r}. Pass "
            "schedule='1f1b', or drop `loss=` and apply the loss to the pipeline's output."
        )
    if loss is not None and not callable(loss):
        raise TypeError(
            f"{WHO}: `loss` must be a function `loss(y, targets)` returning a float scalar "
            f"per microbatch, got {type(loss).__name__} {loss!r}."
        )
    if loss is not None and has_aux:
        raise ValueError(
            f"{WHO}: schedule='1f1b' does not take `has_aux=True`: the pipeline returns the "
            "loss only. Add the aux term to the carry (a pytree `x`) and to `loss`, or use "
            "schedule='gpipe' with has_aux=True."
        )


# --------------------------------------------------------------------------
# The apply: the call's arguments sorted and placed, the stage built, the schedule run.


class _Pipelined:
    """``Stacked.apply`` of a pipeline. ``where`` lays the params (and state) out on the
    stages: :class:`_Stacks` for one layer function, ``pattern.Blocks`` for a pattern
    or layers with state; everything else is the same for both."""

    def __init__(self, where, applies, plan, mesh, options, layers, has_aux, with_state, loss):
        self.where, self.applies, self.plan, self.mesh = where, applies, plan, mesh
        self.options, self.layers, self.has_aux = options, layers, has_aux
        self.with_state, self.loss = with_state, loss
        self.signature = "apply(params, " + "state, " * with_state + "x, targets, *args)"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        where, plan = self.where, self.plan
        params, state, x, args = apply_args(args, self.with_state, WHO, call="apply")
        runs = "a pipeline splits the stacked layers over its stages"
        serving.refuse(WHO, runs, params=params, state=state)
        if self.loss is not None:
            targets, loss_params, args, kwargs = schedule_1f1b.targets_of(
                args, kwargs, self.signature
            )
        params, state = where.enter(params, state)
        check_batch(x, plan, "x")
        state_of = where.state_of(state, x)
        call = _split_args(tuple(args), kwargs, plan.n)
        for i, v in enumerate(call.examples):
            check_batch(v, plan, f"stackwise.per_example argument {i}")
            check_same_batch(v, x, f"stackwise.per_example argument {i}")
        stage = self._stage(call, where.dims(params) if plan.fsdp else None, state_of)
        params, state = where.device(params, state)
        inputs = (params, state, where.per_layer(call), x, call.examples, call.consts)
        if plan.explicit:
            inputs = _place(inputs, stage, self.mesh, plan)
        run = self._program(stage, output_spec(x, plan))
        if self.loss is not None:
            return self._loss(stage, run, inputs, targets, loss_params)
        y, aux, new_state = run(*inputs)
        out = (y, where.aux(aux)) if self.has_aux else y
        return (out, where.leave(new_state)) if self.with_state else out

    def _stage(self, call: _Call, dims: Any, state_of: StageState) -> Stage:
        """The stage: a chunk's layers as one :func:`stackwise.stack` (the core's scan and
        remat) of the layer that rebuilds the call's arguments."""
        plan, lead = self.plan, self.where.lead
        layer = Layer(self.applies, self.has_aux, self.with_state, call, plan.manual)
        one = stack(None, layer, plan.L, **self.layers, has_aux=True, name=WHO)
        if plan.fsdp:
            spec = stage_fsdp.in_specs(dims, plan, lead=lead)
        else:
            spec = PartitionSpec(None, plan.stage_axis)
        return Stage(self.where.run(one), spec, lead, dims, state_of)

    def _program(self, stage: Stage, out_spec: PartitionSpec) -> Callable:
        """The GPipe (or circular) program on the mesh: ``(y, aux, new state)``."""
        plan = self.plan
        program = functools.partial(
            schedule_gpipe.device_program, stage, self.options, plan, out_spec
        )
        if plan.fsdp and plan.gather == "step":
            program = stage_fsdp.gathered_once(
                program, stage.dims, plan, self.options, lead=stage.lead
            )
        layers, batch = PartitionSpec(None, plan.stage_axis), PartitionSpec(plan.batch)
        return jax.shard_map(
            program,
            mesh=self.mesh,
            in_specs=(stage.params, stage.state.specs, layers, batch, batch, PartitionSpec()),
            out_specs=(out_spec, PartitionSpec(), stage.state.specs),
            axis_names=frozenset(plan.manual),
        )

    def _loss(self, stage, run, inputs, targets, loss_params) -> Any:
        """The 1F1B schedule's mean loss (and new state); ``run`` is its primal's program."""
        params, state, *rest = inputs

        def forward(inputs, state):  # the primal: GPipe's output and new state
            y, _, new_state = run(inputs[0], state, *inputs[1:])
            return y, new_state

        value, new_state = schedule_1f1b.loss_and_grads(
            stage, self.plan, self.mesh, self.loss, forward, (params, *rest), state, targets,
            loss_params,
        )  # fmt: skip
        return (value, self.where.leave(new_state)) if self.with_state else value


class _Stacks:
    """One layer function without state: the params in the ``(V, n/V, ...)`` layout (chunk
    ``r*S + s`` at ``[r, s*L:(s+1)*L]``), a chunk's rows scanned with its layers. A pattern
    (or state) is laid out by ``pattern.Blocks``, with the same methods."""

    lead = 2  # a param leaf's dimensions before its inner ones

    def __init__(self, plan: Plan, mesh: Any):
        self.plan, self.mesh = plan, mesh

    def enter(self, params: Any, state: Any) -> tuple:
        """The params in the device layout (from either layout, depth checked); no state."""
        return device_layout(params, self.plan), ()

    def state_of(self, state: Any, x: Any) -> StageState:
        return StageState((), self.plan)

    def dims(self, params: Any) -> Any:
        """With FSDP, each leaf's inner dimension split over the FSDP axes."""
        return stage_fsdp.dims(params, self.mesh, self.plan)

    def device(self, params: Any, state: Any) -> tuple:
        return params, state

    def per_layer(self, call: _Call) -> list:
        return [to_chunks(v, self.plan) for v in call.per_layer]

    @staticmethod
    def run(one: Stacked) -> Callable:
        """``Stage.run`` of a chunk's stack ``one``: its params rows scanned with the layers."""

        def run(chunk, h, state, j, examples, consts):
            h, aux = one.apply(chunk, h, j, examples, consts)
            return (h, state), aux

        return run

    def aux(self, aux: Any) -> Any:
        return aux

    def leave(self, state: Any) -> Any:
        return state


def _place(inputs: tuple, stage: Stage, mesh: Any, plan: Plan) -> tuple:
    """With explicit mesh axes, moves each input ``(params, state, per_layer, x, examples,
    consts)`` to the layout ``shard_map`` takes (with ``fsdp``, the params keep their inner
    split over the FSDP axes: nothing is gathered)."""
    params, state, per_layer, x, examples, consts = inputs
    state = jax.tree.map(
        lambda v, spec: reshard(v, mesh, tuple(spec), plan.manual), state, stage.state.specs
    )
    if plan.fsdp:
        params = stage_fsdp.place(params, stage.dims, mesh, plan, lead=stage.lead)
    else:
        params = reshard(params, mesh, (None, plan.stage_axis), plan.manual)
    return (
        params,
        state,
        reshard(per_layer, mesh, (None, plan.stage_axis), plan.manual),
        reshard(x, mesh, (plan.batch,), plan.manual),
        reshard(examples, mesh, (plan.batch,), plan.manual),
        reshard(consts, mesh, (), plan.manual),
    )


# --------------------------------------------------------------------------
# The call's arguments.


class _Slot:
    """Where a per-example or array argument goes back when the arguments are rebuilt."""

    def __init__(self, kind: str, index: int):
        self.kind, self.index = kind, index


class _Call(NamedTuple):
    """The arguments after ``x``, sorted by how the pipeline moves them."""

    per_layer: list  # each per-layer marker's stacked value (leading axis n)
    kinds: list  # its kind: "slices", "keys" or "index"
    examples: list  # per-example values (batch axis first)
    consts: list  # every other array: whole, on every device
    build: Callable  # (per-layer slices, examples, consts) -> (args, kwargs)


def _split_args(args: tuple, kwargs: dict, n: int) -> _Call:
    """Sorts ``(args, kwargs)``: per-layer markers (the core's handling), per-example, arrays."""
    special = lambda v: isinstance(v, (PerLayer, PerExample))  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=special)
    examples, consts, template = [], [], []
    for leaf in leaves:
        if isinstance(leaf, PerExample):
            template.append(_Slot("example", len(examples)))
            examples.append(leaf.value)
        elif isinstance(leaf, (jax.Array, jnp.ndarray)):
            template.append(_Slot("const", len(consts)))
            consts.append(leaf)
        else:
            template.append(leaf)
    kinds = [leaf.kind for leaf in leaves if isinstance(leaf, PerLayer)]
    a, kw = jax.tree_util.tree_unflatten(treedef, template)
    per_layer, rebuild = split_markers(a, kw, n, f"{WHO} apply")

    def build(slices, example_values, const_values):
        values = {"example": example_values, "const": const_values}
        return jax.tree.map(
            lambda v: values[v.kind][v.index] if isinstance(v, _Slot) else v,
            rebuild(slices),
            is_leaf=lambda v: isinstance(v, _Slot),
        )

    return _Call(per_layer, kinds, examples, consts, build)

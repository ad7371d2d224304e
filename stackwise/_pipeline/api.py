"""Pipeline parallelism over the layer axis: GPipe, circular and 1F1B schedules.

The n layers are split into S stages along a mesh axis and the batch into M
microbatches; :func:`jax.shard_map` runs one program per device, a
:func:`jax.lax.scan` over the schedule's ticks runs one microbatch per stage
per tick, and :func:`jax.lax.ppermute` hands activations to the next stage.
Each stage's layers run with :func:`stackwise.stack` (the core's scan and
remat) and per-layer arguments are resolved by the core's marker handling.

The module reads top-down: :func:`pipeline` checks its arguments into a
:class:`_Plan`; :func:`_split_args` sorts the call's arguments; :func:`_place`
moves the inputs to their layout on the mesh; :func:`_device_program` is one
device's program and :func:`_tick` one step of it. The 1F1B schedule, which
needs the loss, is in ``schedule_1f1b.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from stackwise._core import checks
from stackwise._core.markers import _PerExample, _PerLayer, _split_markers
from stackwise._core.options import check_options
from stackwise._core.stack import DEFAULT_REMAT, Stacked, stack
from stackwise._pipeline import schedule_1f1b, stage_fsdp
from stackwise._pipeline.pattern import pattern_pipeline
from stackwise._pipeline.program import (
    _WHO,
    _check_batch,
    _check_same_batch,
    _device_layout,
    _device_program,
    _out_spec,
    _place,
    _Plan,
    _StageState,
    _to_chunks,
)

__all__ = ["pipeline"]

_SCHEDULES = ("gpipe", "circular", "1f1b")


# --------------------------------------------------------------------------
# The schedule, checked once.


def _int_arg(value: Any, name: str, fix: str) -> int:
    try:
        value = checks.integer(value, _WHO, name)
    except TypeError:
        value = None
    if value is None or value < 1:
        raise TypeError(
            f"{_WHO}: `{name}` must be a positive Python int, got "
            f"{type(value).__name__} {value!r}. {fix}"
        )
    return value


def _mesh_axis(mesh: Any, axis: str, arg: str) -> int:
    if axis not in mesh.shape:
        raise ValueError(
            f"{_WHO}: `{arg}={axis!r}` is not an axis of the mesh, whose axes are "
            f"{dict(mesh.shape)}. Pass `{arg}=` one of {tuple(mesh.shape)}, or build "
            f"the mesh with a {axis!r} axis, e.g. `jax.make_mesh((4, 2), ('stage', 'data'))`."
        )
    return mesh.shape[axis]


def _plan(
    n, mesh, microbatches, stage_axis, data_axis, schedule, repeats, fsdp=None, gather="step"
) -> _Plan:
    mesh = checks.mesh(mesh, _WHO)
    for arg, axis in (("stage_axis", stage_axis), ("data_axis", data_axis)):
        if not (isinstance(axis, str) or (axis is None and arg == "data_axis")):
            raise TypeError(
                f"{_WHO}: `{arg}` must be one mesh axis name (a str)"
                + (" or None" if arg == "data_axis" else "")
                + f", got {type(axis).__name__} {axis!r}."
            )
    M = _int_arg(microbatches, "microbatches", "It is the number of microbatches M.")
    S = _mesh_axis(mesh, stage_axis, "stage_axis")
    D = 1
    if data_axis is not None:
        if data_axis == stage_axis:
            raise ValueError(
                f"{_WHO}: `data_axis` and `stage_axis` are both {stage_axis!r}; the "
                "batch and the stages need two different mesh axes."
            )
        D = _mesh_axis(mesh, data_axis, "data_axis")
    if schedule not in _SCHEDULES:
        raise ValueError(f"{_WHO}: `schedule` must be one of {_SCHEDULES}, got {schedule!r}.")
    if schedule == "gpipe" and repeats not in (None, 1):
        raise ValueError(
            f"{_WHO}: `repeats={repeats!r}` needs `schedule='circular'` (or '1f1b', "
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
                f"{_WHO}: {what} needs at least 2 stages, but mesh axis {stage_axis!r} has "
                f"size {S}. "
                + ("Use repeats=1." if schedule == "1f1b" else "Use schedule='gpipe'.")
            )
        if schedule == "circular" and M < S:
            raise ValueError(
                f"{_WHO}: the 'circular' schedule needs at least as many microbatches as "
                f"stages, got microbatches={M} for {S} stages on mesh axis {stage_axis!r}. "
                f"Use microbatches >= {S}, or schedule='gpipe'."
            )
        if schedule == "1f1b" and M % S:
            fits = " or ".join(str(k) for k in (M - M % S, M - M % S + S) if k)
            raise ValueError(
                f"{_WHO}: {what} (interleaved 1F1B) runs the microbatches in groups of S={S} "
                f"(the stages on mesh axis {stage_axis!r}), so `microbatches` must be a "
                f"multiple of {S}, got microbatches={M}. Use microbatches={fits}, or repeats=1."
            )
    if V < 1 or n % (S * V):
        per = f"S={S} stages" if V == 1 else f"S*repeats={S}*{V}={S * V} chunks"
        raise ValueError(
            f"{_WHO}: n={n} layers cannot be split evenly into {per} (mesh axis "
            f"{stage_axis!r} has size {S}). Use a number of layers divisible by "
            f"{S * max(V, 1)}"
            + (", or another `repeats`" if V > 1 else "")
            + ", or a mesh whose stage axis divides n."
        )
    explicit = jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())
    fsdp, gather = stage_fsdp.check(mesh, fsdp, gather, stage_axis, _WHO)
    D *= stage_fsdp.size(mesh, tuple(a for a in fsdp if a != data_axis))
    return _Plan(n, S, V, n // (S * V), M, D, stage_axis, data_axis, explicit, fsdp, gather)


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
    with :func:`jax.lax.ppermute` inside :func:`jax.shard_map`.

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

    With ``schedule="1f1b"`` the pipeline computes the loss too (``apply``
    then takes the targets after ``x`` and returns the mean loss over the
    microbatches), so that each microbatch's backward pass starts as soon as
    its forward pass leaves the last stage:

    >>> mse = lambda y, t: jnp.mean((y - t) ** 2)
    >>> trained = stackwise.pipeline(init, apply, 4, mesh, microbatches=3,
    ...                              schedule="1f1b", loss=mse)
    >>> targets = jnp.zeros((6, 8))
    >>> loss, grads = jax.jit(jax.value_and_grad(trained.apply))(params, x, targets)
    >>> bool(jnp.allclose(loss, mse(layers.apply(params, x), targets), atol=1e-5))
    True

    Schedules (``T`` ticks; in each, every stage runs ``n/(S*V)`` layers on
    one microbatch):

    * ``"gpipe"``: microbatch m enters stage 0 at tick m; ``T = M + S - 1``,
      of which ``S - 1`` are the fill/drain bubble: (S-1)/(M+S-1) idle.
    * ``"circular"`` (interleaved): each stage holds ``V = repeats`` chunks
      of ``n/(S*V)`` layers (chunks s, s+S, s+2S, ...) and every microbatch
      goes round the ring V times; ``T = M*V + S - 1``, a bubble of
      (S-1)/(M*V+S-1). Needs ``M >= S`` and ``S >= 2``. Params in the usual
      layout ``(n, ...)`` are regrouped at each call (a collective when they
      are placed on the stages); params placed once in the circular layout,
      ``stackwise.shard_stacked(params, mesh, layer_axis=stage_axis,
      repeats=V)`` (leaves ``(V, n/V, ...)``), are used as they are, and their
      gradients come back in that layout.
    * ``"1f1b"`` (one forward, one backward; needs ``loss``): ``apply(params,
      x, targets, *args, **kwargs)`` returns the mean over the M (times the
      data-axis size) microbatches of ``loss(y_m, targets_m)``, ``targets`` a
      pytree split into microbatches with ``x`` (or ``None``); with the keyword
      ``apply(..., loss_params=head)``, of ``loss(y_m, targets_m, head)``: the
      params of what follows the stack (an output head), whole on every device,
      their gradient summed over the microbatches. Under
      :func:`jax.grad` (reverse mode only: it is a :func:`jax.custom_vjp`)
      every tick runs, on each stage, the forward of one microbatch and the
      backward of an earlier one: stage s runs the forward of microbatch
      ``t - s`` and the backward of ``t - (2S - 2 - s)`` at tick t, the last
      stage a microbatch's forward, loss and backward in one tick. The
      backward recomputes the stage's forward from its input (the stage's
      ``remat`` applies inside it), kept in a ring of ``min(M, 2S - 1)``
      inputs: activation memory is bounded by S, not M. ``T = M + 2S - 2``
      ticks (all stages in lockstep, idle slots computed and masked): the
      first ``S - 1`` run forwards only (no stage has a backward yet), the
      last ``S - 1`` backwards only, the others one forward and one
      backward each; the time of ``M + S - 1`` forward-and-backward ticks,
      a bubble of (S-1)/(M+S-1), as GPipe's. Without differentiation the
      GPipe forward and the loss run. Not with ``has_aux``. Interleaved,
      with ``repeats=V`` (chunks as for ``"circular"``, the same two params
      layouts; needs ``S >= 2`` and M a multiple of S): microbatches go
      round the ring V times in groups of S (Megatron's order), stage s
      running forward step ``t - s`` and backward step ``t - (V*S - 1) -
      (S - 1 - s)``, step ``g*S*V + r*S + i`` being microbatch ``g*S + i``
      on chunk r (the backward's rounds counting down); the ring holds
      ``min(M*V, 2*V*S - 1)`` chunk inputs; ``T = M*V + V*S + S - 2`` ticks
      of ``n/(S*V)`` layers, ``V*S - 1`` of them forward-only and as many
      backward-only: the time of ``M*V + S - 1`` full ticks, a bubble of
      (S-1)/(M*V+S-1), as the circular schedule's.

    Where things are: the params' layer axis is split over ``stage_axis``;
    with ``data_axis`` the batch is also split over that mesh axis and the
    params' gradients are summed over it once per call, after the tick loop.
    Other mesh axes (e.g. a tensor-parallel ``"model"``) stay as the params'
    shardings have them. The output is split over the batch across the data
    and stage axes (the work after the pipeline is shared by all stages) when
    S divides the batch of each data shard; otherwise it is replicated over
    the stages.

    FSDP inside the stages: with ``fsdp=axes`` each stage's params are also
    split over those mesh axes (data-parallel axes: the batch is split over
    them too, after ``data_axis`` if that is given), each leaf on the inner
    dimension its placement splits over them, else by
    :func:`stackwise.fsdp_specs`' rule (a leaf with no dimension they divide
    stays replicated over them). Inside the stage a leaf is all-gathered over
    the FSDP axes, with ``fsdp_gather="step"`` once per call before the tick
    loop (MaxText's ``pipeline_fsdp_ag_once``), with ``"tick"`` at every
    tick, only the chunk of layers that tick runs (less memory, more
    gathers); its gradient comes back reduce-scattered, in the params'
    layout. The gathered copy is never saved for the backward pass: the
    backward pass gathers again. With a pattern (or ``with_state``) each
    position's stacked params are split so, their blocks keeping the split
    (params placed with ``shard_stacked(params, mesh, fsdp_specs(params, mesh,
    axes), ...)`` are never gathered whole); the state is not split over the
    FSDP axes (a batched leaf's batch is, with ``x``'s). With ``"1f1b"`` the
    schedule is the backward pass: ``"step"`` gathers once before the tick
    loops and reduce-scatters the summed gradients once after them;
    ``"tick"`` gathers the forward's and the backward's chunk at each tick
    (one gather when ``V = 1``) and reduce-scatters that tick's chunk
    gradient.

    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("stage", "data"))
    >>> fsdp = stackwise.pipeline(init, apply, 4, mesh, microbatches=2, fsdp="data")
    >>> bool(jnp.allclose(jax.jit(fsdp.apply)(params, x), layers.apply(params, x), atol=1e-5))
    True

    Arguments of ``apply`` after ``x``: :func:`stackwise.per_layer`,
    :func:`stackwise.per_layer_keys` and :func:`stackwise.layer_index`
    resolve per layer as in :func:`stackwise.stack` (layer i of microbatch j
    gets ``jax.random.fold_in(jax.random.split(key, n)[i], j)``: dropout
    differs per layer and per microbatch, j counting microbatches over the
    whole batch); :func:`stackwise.per_example` arguments are split into
    microbatches with ``x``; every other argument reaches every layer whole.

    Patterns and state, with any schedule. A pattern of k layers
    (``init`` and ``apply`` as sequences, layer i running ``apply[i % k]``)
    pipelines with the stack's params, a tuple of k stacked trees; the stage
    (or chunk) boundaries may cut the pattern anywhere (``n/S`` need not be a
    multiple of k). Each position's layers are regrouped by chunk into
    blocks ``(V, S, C_p, ...)`` (padded where chunks hold different counts of
    a position: a gather at each call; with GPipe, when every stage holds as
    many layers of each position, as when k divides ``n/S``, it is a reshape
    and params placed with ``shard_stacked(..., layer_axis=stage_axis)`` stay
    put), and every layer runs its position's ``apply`` through
    :func:`jax.lax.switch` on a per-layer table. With ``with_state=True``, ``apply(params, state, x,
    ...)`` returns ``(out, new_state)`` as the stack's does, the state in the
    stack's layout; a state leaf with a batch axis (``batched_state``: a KV
    cache) is split into microbatches with ``x``, one without (statistics) is
    updated by the microbatches in order, as a loop over them would:

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

    With ``"1f1b"``, a pattern's ``apply(params, x, targets, ...)`` returns the
    mean loss, its gradients in the params' layout (a tuple of k stacked trees);
    with state, ``apply(params, state, x, targets, ...)`` returns ``(loss,
    new_state)``, the new state the one the GPipe schedule returns (an unbatched
    leaf updated by the microbatches in order: each chunk runs its forwards in
    microbatch order). The state is not differentiated: its cotangent is zero (a
    float state leaf's gradient is zeros), and no gradient flows through it from
    one microbatch to the next either, as if each microbatch read
    ``jax.lax.stop_gradient(state)`` (``jax.grad`` of the GPipe schedule does
    differentiate through an unbatched state that feeds the outputs, such as a
    running statistic used in the forward; a cache's rows, or statistics only
    read, give both the same gradients). Under :func:`jax.grad`, pass
    ``has_aux=True`` to get the new state back. Each ring slot keeps, with the
    stage input, the state that microbatch's forward read (a batched leaf's rows
    of it, an unbatched leaf's whole chunk), for the backward's recomputation:

    >>> trained = stackwise.pipeline([counted, stateless], [counting, doubling], 3, mesh,
    ...                              microbatches=3, with_state=True, batched_state=False,
    ...                              schedule="1f1b", loss=mse)
    >>> params, state = trained.init(jax.random.key(0))
    >>> step = jax.value_and_grad(trained.apply, has_aux=True)
    >>> (loss, state), grads = jax.jit(step)(params, state, x, targets)
    >>> state[0]["calls"].tolist(), len(grads)
    ([3, 3], 2)

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
        ``data_axis``).
      microbatches: M; it (times the ``data_axis`` size) must divide the batch.
      stage_axis: the mesh axis the stages are laid out on.
      data_axis: a mesh axis to split the batch over as well, or ``None``.
      schedule: ``"gpipe"``, ``"circular"`` or ``"1f1b"``.
      repeats: V, the chunks per stage: for ``"circular"`` (default ``n // S``:
        one layer per chunk, the smallest bubble) and ``"1f1b"`` (interleaved;
        default 1).
      fsdp: a mesh axis, or a tuple of them, to split each stage's params over
        as well (FSDP; not ``stage_axis``), or ``None``.
      fsdp_gather: with ``fsdp``: ``"step"`` (gather each stage's params once
        per call) or ``"tick"`` (gather each tick's chunk at that tick).
      remat, nested, unroll: passed to :func:`stackwise.stack` for each stage.
      has_aux: the layer returns ``(x, aux)``; ``apply`` returns ``(y, aux)``
        with aux stacked along a leading ``n`` axis, each layer's summed over
        microbatches and data shards (bubble ticks excluded): for an aux that
        is a sum over examples it equals the unpipelined stack's.
      loss: for ``"1f1b"`` (and only for it): ``loss(y, targets)``, one float
        scalar for a microbatch's output ``y`` and its rows of ``targets``
        (``loss(y, targets, loss_params)`` when ``apply`` is given ``loss_params=``).
      with_state: the layers carry per-layer state, as for
        :func:`stackwise.stack` (with ``"1f1b"``, ``apply`` returns ``(loss,
        new_state)``, the state not differentiated).
      batched_state: which state leaves have a batch axis (after the layer
        axis, of ``x``'s batch), split into microbatches and over
        ``data_axis`` with ``x``: ``True`` (all: caches), ``False`` (none:
        statistics, counters; then no ``data_axis``), or a function of a
        leaf's path (``jax.tree_util.keystr``, e.g. ``"[0]['k']"``) returning
        a bool.

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
        or with ``has_aux``, ``loss`` with another
        schedule; at call time, a batch
        (of ``x``, per-example arguments or ``targets``) not divisible by ``M``
        (times the data-axis size), params of neither layout, a leaf placed
        over the ``fsdp`` axes otherwise than ``fsdp`` names them (with other
        axes, or in another order), state of the wrong depth, a batched state
        leaf without ``x``'s batch, or unbatched state with the batch split
        (over a ``data_axis`` or ``fsdp`` axes of more than one device).
    """
    layer_pattern = isinstance(init, (list, tuple)) or isinstance(apply, (list, tuple))
    if not layer_pattern and not callable(apply):
        raise TypeError(
            f"{_WHO}: `pipeline` takes `(init, apply, n, mesh)`, the arguments of "
            "`stackwise.stack` and a mesh, e.g. `stackwise.pipeline(init, apply, n, mesh, "
            "microbatches=8)`; pass `init=None` when the params come from elsewhere. Got "
            f"apply={apply!r}, mesh={mesh!r}."
        )
    # Checks n (and the pattern, with_state); its init is the pipeline's.
    plain = stack(init, apply, n, with_state=with_state, name=_WHO)
    plan = _plan(n, mesh, microbatches, stage_axis, data_axis, schedule, repeats, fsdp, fsdp_gather)
    options = check_options(
        _WHO, n, remat=remat, nested=nested, unroll=unroll, reverse=False, has_aux=has_aux
    )
    _check_loss_option(schedule, loss, has_aux)
    if layer_pattern or with_state:
        return pattern_pipeline(
            plain, init, apply, plan, mesh, remat=remat, nested=nested, unroll=unroll,
            options=options, has_aux=has_aux, with_state=with_state, batched_state=batched_state,
            loss=loss, split_args=_split_args,
        )  # fmt: skip

    def stage(call: _Call, dims: Any, gathers: bool = True) -> Stacked:
        """One stage's L layers: the core's scan and remat, with the call's arguments
        (gathering its chunk per tick with ``fsdp_gather="tick"``, if ``gathers``)."""
        layer = _Layer(apply, has_aux, call)
        one = stack(
            None, layer, plan.L, remat=remat, nested=nested, unroll=unroll, has_aux=True, name=_WHO
        )
        if plan.fsdp and plan.gather == "tick" and gathers:
            return stage_fsdp.gathered_per_tick(one, dims, plan, options)
        return one

    def pipelined(params, x, *args, **kwargs):
        if loss is not None:
            targets, loss_params, args, kwargs = schedule_1f1b.targets_of(
                args, kwargs, "apply(params, x, targets, *args)"
            )
        params = _device_layout(params, plan)
        dims = stage_fsdp.dims(params, mesh, plan) if plan.fsdp else None
        _check_batch(x, plan, "x")
        call = _split_args(args, kwargs, n)
        for i, v in enumerate(call.examples):
            _check_batch(v, plan, f"stackwise.per_example argument {i}")
            _check_same_batch(v, x, f"stackwise.per_example argument {i}")
        slices = [_to_chunks(v, plan) for v in call.per_layer]
        inputs = _place((params, slices, x, call.examples, call.consts), mesh, plan)
        layer_spec = PartitionSpec(None, plan.stage_axis)
        batch_spec = PartitionSpec(plan.batch)
        out_spec = _out_spec(x, plan)
        param_spec = layer_spec

        def device(*a, gather=None):
            return _device_program(stage(call, dims), options, plan, out_spec, *a, gather=gather)

        program = device
        if plan.fsdp:  # each stage's params split over the FSDP axes too
            param_spec = stage_fsdp.in_specs(dims, plan)
            if plan.explicit:
                inputs = (stage_fsdp.place(params, dims, mesh, plan), *inputs[1:])
            if plan.gather == "step":
                program = stage_fsdp.gathered_once(device, dims, plan, options)

        def forward(inputs):
            run = jax.shard_map(
                program,
                mesh=mesh,
                in_specs=(param_spec, layer_spec, batch_spec, batch_spec, PartitionSpec()),
                out_specs=(out_spec, PartitionSpec()),
                axis_names=frozenset(plan.manual),
            )
            return run(*inputs)

        if loss is None:
            y, aux = forward(inputs)
            return (y, aux) if has_aux else y
        # The 1F1B program gathers (and reduce-scatters) the FSDP params itself.
        one = stage(call, dims, gathers=False)

        def run_chunk(chunk, h, state, j, examples, consts):
            return one.apply(chunk, h, j, examples, consts)[0], state

        on_stage = schedule_1f1b.Stage(run_chunk, param_spec, 2, dims, _StageState((), plan))
        value, _ = schedule_1f1b.loss_and_grads(
            on_stage, plan, mesh, loss, lambda i, state: (forward(i)[0], state), inputs, (),
            targets, loss_params,
        )  # fmt: skip
        return value

    return Stacked(plain.init, pipelined, n)


def _check_loss_option(schedule: str, loss: Any, has_aux: bool) -> None:
    """``loss=`` comes with ``schedule='1f1b'`` and only with it."""
    if schedule == "1f1b" and loss is None:
        raise ValueError(
            f"{_WHO}: schedule='1f1b' needs `loss=`: a microbatch's backward pass starts as "
            "soon as its forward leaves the last stage, so the pipeline computes the loss "
            "itself. Pass `loss=lambda y, targets: ...` (one float scalar per microbatch); "
            "`apply(params, x, targets, *args)` then returns its mean over microbatches."
        )
    if loss is not None and schedule != "1f1b":
        raise ValueError(
            f"{_WHO}: `loss=` is for schedule='1f1b', got schedule={schedule!r}. Pass "
            "schedule='1f1b', or drop `loss=` and apply the loss to the pipeline's output."
        )
    if loss is not None and not callable(loss):
        raise TypeError(
            f"{_WHO}: `loss` must be a function `loss(y, targets)` returning a float scalar "
            f"per microbatch, got {type(loss).__name__} {loss!r}."
        )
    if loss is not None and has_aux:
        raise ValueError(
            f"{_WHO}: schedule='1f1b' does not take `has_aux=True`: the pipeline returns the "
            "loss only. Add the aux term to the carry (a pytree `x`) and to `loss`, or use "
            "schedule='gpipe' with has_aux=True."
        )


# --------------------------------------------------------------------------
# The call's arguments.


class _Layer:
    """The per-layer function a stage's stack runs: the user's layer, its arguments rebuilt."""

    def __init__(self, apply: Callable[..., Any], has_aux: bool, call: _Call):
        self.apply, self.has_aux, self.call = apply, has_aux, call

    def __call__(self, params_and_slices, x, j, examples, consts):
        params, slices = params_and_slices
        # Per-layer keys differ per microbatch too: fold in its index over the batch.
        slices = [
            jax.random.fold_in(v, j) if kind == "keys" else v
            for v, kind in zip(slices, self.call.kinds)
        ]
        args, kwargs = self.call.build(slices, examples, consts)
        out = self.apply(params, x, *args, **kwargs)
        return out if self.has_aux else (out, ())


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
    special = lambda v: isinstance(v, (_PerLayer, _PerExample))  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=special)
    examples, consts, template = [], [], []
    for leaf in leaves:
        if isinstance(leaf, _PerExample):
            template.append(_Slot("example", len(examples)))
            examples.append(leaf.value)
        elif isinstance(leaf, (jax.Array, jnp.ndarray)):
            template.append(_Slot("const", len(consts)))
            consts.append(leaf)
        else:
            template.append(leaf)
    kinds = [leaf.kind for leaf in leaves if isinstance(leaf, _PerLayer)]
    a, kw = jax.tree_util.tree_unflatten(treedef, template)
    per_layer, rebuild = _split_markers(a, kw, n, f"{_WHO} apply")

    def build(slices, example_values, const_values):
        values = {"example": example_values, "const": const_values}
        return jax.tree.map(
            lambda v: values[v.kind][v.index] if isinstance(v, _Slot) else v,
            rebuild(slices),
            is_leaf=lambda v: isinstance(v, _Slot),
        )

    return _Call(per_layer, kinds, examples, consts, build)

"""The 1F1B (one-forward-one-backward) pipeline schedule: a loss and its gradients.

With ``jax.grad`` around a forward pipeline the backward pass starts only after
all M forwards, so every microbatch's activations live until then (GPipe). 1F1B
starts a microbatch's backward as soon as its forward leaves the last stage, so
the loss is part of the schedule: :func:`loss_and_grads` is a
:func:`jax.custom_vjp` function of the pipeline's inputs whose value is the mean
of ``loss(y_m, targets_m[, loss_params])`` over the microbatches. Its forward rule runs the whole
schedule and returns the gradients as the residual (the backward rule only scales
them by the incoming cotangent); without differentiation the primal runs, the
plain GPipe forward and the loss.

The schedule, on stage s of S (all stages in lockstep, one ``lax.scan`` over
``T = M + 2S - 2`` ticks): at tick t the stage runs the forward of microbatch
``t - s`` and the backward of microbatch ``t - (2S - 2 - s)`` (each masked
outside ``[0, M)``). The forward's input is kept in a ring of
``K = min(M, 2S - 1)`` slots (at most ``2(S - 1 - s) + 1`` are in flight on stage
s); the backward is :func:`jax.vjp` of the stage's forward, recomputed from that
input. The last stage runs a microbatch's forward, its loss and its backward in
the same tick; cotangents go back one stage per tick with ``ppermute``. Params'
gradients (and the loss params') are accumulated in the scan's carry, so nothing
the scan keeps grows with M except the gradients of the per-example inputs (x,
per-example arguments, float targets), which are as large as those inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from stackwise._pipeline_program import _WHO, _Plan, _reshard, _split_batch, _take, _vary


def ticks(plan: _Plan) -> int:
    """T = M + 2S - 2: the last microbatch's backward leaves stage 0 at tick M + 2S - 3."""
    return plan.M + 2 * plan.S - 2


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


def with_params(loss: Callable[..., Any], loss_params: Any) -> Callable[..., Any]:
    """``loss`` as a function of ``(y, targets, loss_params)``, called with the user's arity."""
    if loss_params is None:
        return lambda y, t, lp: loss(y, t)
    return loss


def check_loss(loss: Callable[..., Any], y: Any, targets: Any, loss_params: Any, plan: _Plan):
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
            f"{_WHO}: with schedule='1f1b' the pipeline calls `{call}` on each microbatch, "
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
            f"{_WHO}: with schedule='1f1b', `{call}` must return one float scalar "
            f"for a microbatch (the pipeline returns the mean over microbatches), got {got}. "
            "Reduce it inside `loss`, e.g. `lambda y, t: jnp.mean((y - t) ** 2)`."
        )


def loss_and_grads(stage, plan, mesh, loss, forward, inputs, targets, loss_params):
    """The mean microbatch loss, differentiable: its forward rule runs the 1F1B schedule.

    ``inputs`` are the pipeline's placed ``(params, slices, x, examples, consts)``,
    ``loss`` takes ``(y, targets, loss_params)`` (see :func:`with_params`);
    ``forward(inputs)`` is the GPipe program's output ``y`` (the primal, run when
    nothing differentiates).
    """
    diff = (*inputs, targets, loss_params)
    leaves, treedef = jax.tree.flatten(diff)
    avals = [(jnp.shape(v), _inexact(v)) for v in leaves]
    layer, batch = PartitionSpec(None, plan.stage_axis), PartitionSpec(plan.data_axis)
    specs = (layer, layer, batch, batch, PartitionSpec(), batch, PartitionSpec())

    def grads_tree(floats):
        """The float gradients back in ``diff``'s tree, ``None`` at the other leaves."""
        it = iter(floats)
        return jax.tree.unflatten(treedef, [next(it) if f else None for _, f in avals])

    def primal(diff):
        *ins, tg, lp = diff
        y = forward(tuple(ins))
        if plan.explicit:  # y split like the targets, for the vmap below
            y = _reshard(y, mesh, (plan.data_axis,), plan.manual)

        def split(tree):
            return jax.tree.map(lambda v: v.reshape(plan.M * plan.D, -1, *v.shape[1:]), tree)

        return jnp.mean(jax.vmap(loss, in_axes=(0, 0, None))(split(y), split(tg), lp))

    def schedule(diff):
        run = jax.shard_map(
            lambda *a: _device_program(stage, plan, loss, grads_tree, *a),
            mesh=mesh,
            in_specs=specs,
            out_specs=(PartitionSpec(), specs),
            axis_names=frozenset(plan.manual),
        )
        return run(*diff)

    @jax.custom_vjp
    def value(diff):
        return primal(diff)

    def bwd(grads, g):
        it = iter(jax.tree.leaves(grads))
        out = [
            (g * next(it)).astype(jnp.result_type(v)) if f else np.zeros(shape, jax.dtypes.float0)
            for v, (shape, f) in zip(leaves, avals)
        ]
        return (jax.tree.unflatten(treedef, out),)

    value.defvjp(schedule, bwd)
    return value(diff)


def _device_program(stage, plan, loss, grads_tree, *inputs):
    """One device's 1F1B schedule: the summed loss and every float input's gradient."""
    S, M, L = plan.S, plan.M, plan.L
    K = min(M, 2 * S - 1)  # ring slots: stage s has at most 2(S - 1 - s) + 1 in flight
    s = jax.lax.axis_index(plan.stage_axis)
    d = jax.lax.axis_index(plan.data_axis) if plan.data_axis else 0
    last = s == S - 1
    params, slices, x, examples, consts, targets, loss_params = _vary(inputs, plan.manual)
    mbs, examples, targets = (_split_batch(v, M) for v in (x, examples, targets))
    chunks = jax.tree.map(lambda v: v.reshape(L, *v.shape[2:]), (params, slices))
    scale = 1.0 / (M * plan.D)  # the loss is the mean over all M*D microbatches

    def run_stage(m):
        """This stage on microbatch m, a function of what has gradients."""
        return lambda a: stage.apply(a[0], a[1], d * M + m, a[2], a[3])[0]

    def write(bufs, i, values, on):
        """``buf[i] = value`` where ``on``, for each buffer and value."""
        return [
            jax.lax.dynamic_update_index_in_dim(
                b, jnp.where(on, v, jax.lax.dynamic_index_in_dim(b, i, keepdims=False)), i, 0
            )
            for b, v in zip(bufs, values)
        ]

    def tick(carry, t):
        h, g, ring, acc, total = carry
        acc_chunks, acc_x, acc_ex, acc_consts, acc_tg, acc_lp = acc
        # Forward: microbatch t - s enters this stage (stage 0 takes it from x).
        kf = t - s
        on_f = (kf >= 0) & (kf < M)
        mf = jnp.clip(kf, 0, M - 1)
        h_in = jax.tree.map(lambda a, b: jnp.where(s == 0, a, b), _take(mbs, mf), h)
        ring = jax.tree.unflatten(
            jax.tree.structure(ring),
            write(jax.tree.leaves(ring), mf % K, jax.tree.leaves(h_in), on_f),
        )
        y = run_stage(mf)((chunks, h_in, _take(examples, mf), consts))
        # The loss, on the last stage: its value and cotangents for y, targets, loss_params.
        value, pull_loss = _vjp(lambda a: loss(*a), (y, _take(targets, mf), loss_params))
        dy, dt, dlp = _regroup(
            pull_loss([_vary(jnp.asarray(scale, value[0].dtype), plan.manual)]),
            (y, _take(targets, mf), loss_params),
        )
        now = on_f & last
        total = total + jnp.where(now, value[0], 0).astype(total.dtype)
        acc_tg = write(acc_tg, mf, dt, now)
        acc_lp = [jnp.where(now, a + b, a) for a, b in zip(acc_lp, dlp)]
        # Backward: microbatch t - (2S - 2 - s), recomputed from its input in the ring.
        kb = t - (2 * S - 2 - s)
        on_b = (kb >= 0) & (kb < M)
        mb = jnp.clip(kb, 0, M - 1)
        ex_b = _take(examples, mb)
        primals = (chunks, _take(ring, mb % K), ex_b, consts)
        ct = [jnp.where(last, a, b) for a, b in zip(dy, g)]
        _, pull = _vjp(run_stage(mb), primals)
        dchunks, dh, dex, dconsts = _regroup(pull(ct), primals)
        acc = (
            [jnp.where(on_b, a + b, a) for a, b in zip(acc_chunks, dchunks)],
            write(acc_x, mb, dh, on_b & (s == 0)),  # x's gradient: stage 0's input's
            write(acc_ex, mb, dex, on_b),
            [jnp.where(on_b, a + b, a) for a, b in zip(acc_consts, dconsts)],
            acc_tg,
            acc_lp,
        )
        # Activations go one stage on, cotangents one stage back.
        if S > 1:
            y = jax.lax.ppermute(y, plan.stage_axis, [(i, i + 1) for i in range(S - 1)])
            dh = jax.lax.ppermute(dh, plan.stage_axis, [(i, i - 1) for i in range(1, S)])
        return (y, dh, ring, acc, total), None

    zeros = lambda tree: [jnp.zeros_like(v) for v in _floats(tree)]  # noqa: E731
    h0 = _take(mbs, 0)
    out = jax.eval_shape(
        lambda: loss(
            run_stage(0)((chunks, h0, _take(examples, 0), consts)), _take(targets, 0), loss_params
        )
    )
    ring0 = jax.tree.map(lambda v: jnp.zeros((K, *v.shape), v.dtype), h0)
    acc0 = tuple(zeros(v) for v in (chunks, mbs, examples, consts, targets, loss_params))
    carry = (h0, zeros(h0), ring0, acc0, jnp.zeros((), out.dtype))
    carry = _vary(carry, plan.manual)
    (_, _, _, acc, total), _ = jax.lax.scan(tick, carry, jnp.arange(ticks(plan)))
    acc_chunks, acc_x, acc_ex, acc_consts, acc_tg, acc_lp = acc
    data = (plan.data_axis,) if plan.data_axis else ()
    sum_over = lambda vs, axes: [jax.lax.psum(v, axes) if axes else v for v in vs]  # noqa: E731
    unsplit = lambda vs: [v.reshape(-1, *v.shape[2:]) for v in vs]  # noqa: E731
    # Params and slices: (L, ...) back to this device's (1, L, ...), summed over the data
    # shards; per-example gradients summed over the stages (each adds its layers' part).
    stage_axis = plan.stage_axis
    grads = (
        [v[None] for v in sum_over(acc_chunks, data)]
        + unsplit(sum_over(acc_x, stage_axis))
        + unsplit(sum_over(acc_ex, stage_axis))
        + sum_over(acc_consts, plan.manual)
        + unsplit(sum_over(acc_tg, stage_axis))
        + sum_over(acc_lp, plan.manual)
    )
    total = jax.lax.psum(total, plan.manual) * jnp.asarray(scale, total.dtype)
    return total, grads_tree(grads)


def _regroup(flat: list, trees: tuple) -> list[list]:
    """Splits the flat float gradients of ``trees`` into one list per tree."""
    out, i = [], 0
    for tree in trees:
        k = len(_floats(tree))
        out.append(flat[i : i + k])
        i += k
    return out

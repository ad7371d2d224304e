"""Pipelines of layer patterns and of layers with state: the same outputs, gradients and
state as a plain Python loop over the layers, and a pipelined decode gives its tokens.

The cases run once, in a subprocess with 8 simulated CPU devices (this file is its
script, see ``_CASES``); each records its largest difference to the loop, or the
traceback if it raised, and the tests below assert on those records.
"""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import collectives
from _multidevice import result, run_cases, run_module
from _tolerance import assert_close, check, compare, reassociation_bound, worst

import stackwise

D = 8  # feature width

# float32 sums reassociated across microbatches, stages and the data axis: outputs, grads,
# state, aux and caches within PIPELINE_BOUND * eps * (the leaf's largest magnitude) of the
# loop's (tests/_tolerance.py). Up to 12 layers (gemma) of width-D matmuls (a cache's attention:
# 8 keys of width 4), a loss summing the 8 x D outputs (grads the 8 rows): 6 * (2 * 12 * sqrt(8)
# + sqrt(8 * 8)) = 456 eps, 5.4e-5 of the scale. Measured on an AMD EPYC VM (the suite's XLA
# flags, XLA's default fusion emitters, optimisation level 2): at most 49 eps (gemma's grads,
# 12 layers whose gradients grow 10-20 times from the loss's), 9 eps elsewhere. A relative error
# of 1e-3 is 8,389 eps.
PIPELINE_BOUND = reassociation_bound(depth=12, width=D, summed=8 * D)


def _dense_init(key):
    return {"w": jax.random.normal(key, (D, D)) / D**0.5}


def _scale_init(key):
    return {"s": 1.0 + 0.1 * jax.random.normal(key, (D,))}


def _tanh(p, x):
    return x + jnp.tanh(x @ p["w"])


def _scale(p, x):
    return x * p["s"][None, :]


def _sin(p, x):
    return x + 0.5 * jnp.sin(x @ p["w"])


def _loop_params(inits, n, key):
    """The loop's per-layer params: layer i made by ``inits[i % k]`` from the i-th key
    (compiled: one program costs less than the many small ones of eager init)."""

    def make(key):
        keys = jax.random.split(key, n)
        return [inits[i % len(inits)](keys[i]) for i in range(n)]

    return jax.jit(make)(key)


def _named(out, grad_args, grad_params):
    """Outputs (or a loss) and grads, named for ``_tolerance.compare``'s report."""
    return {"out": out, "grad_args": grad_args, "grad_params": grad_params}


def _regroup(per_layer, k):
    """The loop's params as the stack's pattern layout (position p: layers p, p+k, ...)."""
    return tuple(stackwise.stack_layers(per_layer[p::k]) for p in range(k))


def _diff(a, b):  # the largest |difference|, for what must be exact (0.0)
    return max(
        jax.tree.leaves(jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(u - v))), a, b)),
        default=0.0,
    )


def _trimmed(spec) -> tuple:
    """A spec's entries without trailing ``None`` s (the same layout)."""
    spec = list(spec)
    while spec and spec[-1] is None:
        spec.pop()
    return tuple(spec)


def _sin_loss_of(f):
    """A loss of ``f(params, x)``, and the output."""

    def fn(p, v):
        y = f(p, v)
        return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(y)), y

    return fn


def _sin_loss(f):
    """A loss of ``f(params, x)``: its value, output and grads, compiled."""
    return jax.jit(jax.value_and_grad(_sin_loss_of(f), argnums=(0, 1), has_aux=True))


# --------------------------------------------------------------------------
# Patterns.


def _head_mse(y, t, head):
    """A 1F1B loss with ``loss_params``: an output head, then the mean squared error."""
    return jnp.mean((y @ head - t) ** 2)


def _pattern_case(
    inits, applies, n, mesh, data_axis=None, microbatches=2, place=None, one_f_one_b=False,
    **options,
):  # fmt: skip
    """Outputs and grads (params and x) of the pipelined pattern against the loop; with
    ``fsdp=``, also where the params and grads are, and the training step's collectives
    (compiled) and all-gathers (its jaxpr, and the forward pass's). With ``one_f_one_b``,
    the same pipeline with ``schedule="1f1b"``, a head's loss and each stage's layers a
    Python loop (``unroll=True``): its loss and grads (params, x, head) against the loop's,
    its loss against GPipe's output's, its value without differentiation, and where its
    grads are."""
    k = len(applies)
    per_layer = _loop_params(inits, n, jax.random.key(0))
    params = _regroup(per_layer, k)
    placed = params if place is None else place(params)

    def loop(per_layer, x):
        for i, p in enumerate(per_layer):
            x = applies[i % k](p, x)
        return x

    pp = stackwise.pipeline(
        inits, applies, n, mesh, microbatches=microbatches, data_axis=data_axis, **options
    )
    x = jax.random.normal(jax.random.key(1), (8, D))
    step = _sin_loss(pp.apply).lower(placed, x).compile()
    (_, y), (g, gx) = step(placed, x)
    (_, y_ref), (g_ref, gx_ref) = _sin_loss(loop)(per_layer, x)
    out = {
        "max_err": compare(_named(y, gx, g), _named(y_ref, gx_ref, _regroup(g_ref, k))),
        "init_equals_loop": _diff(jax.jit(pp.init)(jax.random.key(0)), params) == 0.0,
    }
    if one_f_one_b:
        f1 = stackwise.pipeline(
            inits, applies, n, mesh, microbatches=microbatches, data_axis=data_axis,
            schedule="1f1b", loss=_head_mse, unroll=True, **options,
        )  # fmt: skip
        t = jax.random.normal(jax.random.key(2), (8, D))
        head = jax.random.normal(jax.random.key(3), (D, D)) / D**0.5
        grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))  # noqa: E731
        loss = lambda p, v, h: f1.apply(p, v, t, loss_params=h)  # noqa: E731
        v1, (g1, gx1, gh1) = grad(loss)(placed, x, head)
        v_ref, (g_ref, gx_ref, gh_ref) = grad(lambda p, v, h: _head_mse(loop(p, v), t, h))(
            per_layer, x, head
        )
        gpipe = np.mean((np.asarray(y) @ np.asarray(head) - np.asarray(t)) ** 2)
        out.update({
            "1f1b_err": compare(_named(v1, (gx1, gh1), g1),
                                _named(v_ref, (gx_ref, gh_ref), _regroup(g_ref, k))),
            "1f1b_gpipe_err": compare(v1, gpipe),
            "1f1b_value_err": compare(jax.jit(loss)(placed, x, head), v_ref),
            "1f1b_grad_specs": jax.tree.map(_spec_of, g1),
        })  # fmt: skip
    if options.get("fsdp"):
        gathers = lambda f: str(jax.make_jaxpr(f)(placed, x)).count("= all_gather[")  # noqa: E731
        backward = jax.grad(_sin_loss_of(pp.apply), has_aux=True)
        out.update(
            param_specs=jax.tree.map(_spec_of, placed),
            grad_specs=jax.tree.map(_spec_of, g),
            program=collectives(step.as_text()),
            jaxpr_gathers=[gathers(pp.apply), gathers(backward)],
        )
    return out


def _spec_of(a) -> str:
    """A placed array's spec without trailing ``None`` s."""
    return str(jax.sharding.PartitionSpec(*_trimmed(a.sharding.spec)))


def _case_phases():
    """k=3, n=8, S=4: two layers a stage, so stages start at phases 0, 2, 1, 0, and position
    2's block is padded on stages 0 and 3. Explicit (stage=4, data=2), no remat, nested
    groups; FSDP over "data" inside the stages, gathered once per step (the batch is split
    over "data", the data and FSDP axis), the params placed split over "data" by
    fsdp_specs (their layer axes, of 3, 3 and 2 layers, are not split over the 4 stages).
    The same with the 1F1B schedule, a head's loss and unroll=True."""
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    place = lambda p: stackwise.shard_stacked(  # noqa: E731
        p, mesh, stackwise.fsdp_specs(p, mesh, "data")
    )
    return _pattern_case(
        [_dense_init, _scale_init, _dense_init],
        [_tanh, _scale, _sin],
        8,
        mesh,
        "data",
        place=place,
        one_f_one_b=True,
        fsdp="data",
        remat=False,
        nested=True,
    )


def _case_gemma():
    """Gemma-3-like 5 : 1 over n=12 and S=2, each stage one whole period: the stack's
    layout is the stages' own, and the params are placed with their layer axis split over
    the stages (explicit axes, remat=True)."""
    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    inits = [_dense_init] * 5 + [_scale_init]
    applies = [_tanh] * 5 + [_scale]
    place = lambda p: stackwise.shard_stacked(p, mesh, layer_axis="stage")  # noqa: E731
    return _pattern_case(inits, applies, 12, mesh, "data", place=place, remat=True)


def _aux_layer(p, x, i, key, mask):
    y = x + jnp.tanh(x @ p["w"]) * jax.random.uniform(key, (x.shape[0], 1)) * mask[:, None]
    return y, {"i": i, "sq": jnp.sum(y**2)}


def _aux_scale(p, x, i, key, mask):
    del key, mask
    return x * p["s"][None, :], jnp.sum(x) + i


def _case_aux_and_arguments():
    """Positions with aux of different structures, the layer index, per-layer keys and a
    per-example mask, against a loop over the 4 microbatches (k=3, n=8, S=4, auto axes, no
    data axis): the circular schedule, one layer a chunk (chunk c runs layer c: stage s
    holds layers s and s + 4, of positions s % 3 and (s + 1) % 3), each stage's chunk run as
    a Python loop (``unroll=True``)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("stage",))
    inits, applies, n, k, m = (
        [_dense_init, _scale_init, _dense_init],
        [_aux_layer, _aux_scale, _aux_layer],
        8,
        3,
        4,
    )
    per_layer = _loop_params(inits, n, jax.random.key(0))
    pp = stackwise.pipeline(
        inits, applies, n, mesh, microbatches=m, has_aux=True, unroll=True, schedule="circular"
    )
    x = jax.random.normal(jax.random.key(1), (8, D))
    key = jax.random.key(3)
    mask = (jnp.arange(8) % 3 != 0).astype(jnp.float32)
    marked = (stackwise.layer_index(), stackwise.per_layer_keys(key), stackwise.per_example(mask))
    y, aux = jax.jit(pp.apply)(_regroup(per_layer, k), x, *marked)

    @jax.jit
    def reference(per_layer, x, mask):
        """The loop over the layers, for each microbatch j in turn."""
        ys, auxes = [], []
        for j, (x_j, mask_j) in enumerate(zip(x.reshape(m, -1, D), mask.reshape(m, -1))):
            layer_aux = []
            for i, p in enumerate(per_layer):
                key_ij = jax.random.fold_in(jax.random.split(key, n)[i], j)
                x_j, a = applies[i % k](p, x_j, jnp.int32(i), key_ij, mask_j)
                layer_aux.append(a)
            ys.append(x_j)
            auxes.append(tuple(stackwise.stack_layers(layer_aux[p::k]) for p in range(k)))
        return jnp.concatenate(ys), jax.tree.map(lambda *a: sum(a), *auxes)

    y_ref, aux_ref = reference(per_layer, x, mask)
    return {
        "max_err": compare(y, y_ref),
        "aux_err": compare(aux, aux_ref),
        "index_sums": [aux[0]["i"].tolist(), aux[2]["i"].tolist()],
    }


# --------------------------------------------------------------------------
# State.


def _stats_init(key):
    return _dense_init(key), {"mean": jnp.zeros(D), "count": jnp.zeros((), jnp.int32)}


def _stats_apply(p, state, x):
    """A BatchNorm-like running mean of the layer's input, and a call counter."""
    mean = 0.9 * state["mean"] + 0.1 * jnp.mean(x, 0)
    return _tanh(p, x - mean[None, :]), {"mean": mean, "count": state["count"] + 1}


def _scale_state_init(key):
    return _scale_init(key), {"peak": jnp.zeros(D)}


def _scale_state_apply(p, state, x):
    return _scale(p, x), {"peak": jnp.maximum(state["peak"], jnp.max(jnp.abs(x), 0))}


def _case_statistics():
    """Unbatched state (statistics, counters) in a pattern, k=3, n=8, S=4, the circular
    schedule with 2 chunks of one layer a stage (the state regrouped into padded blocks and
    back): outputs, state and grads against the stack (one device) run on the 4
    microbatches in order."""
    mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    inits = [_stats_init, _scale_state_init, _stats_init]
    applies = [_stats_apply, _scale_state_apply, _stats_apply]
    n, m = 8, 4
    pp = stackwise.pipeline(
        inits, applies, n, mesh, microbatches=m, with_state=True, batched_state=False,
        remat=True, schedule="circular", repeats=2,
    )  # fmt: skip
    plain = stackwise.stack(inits, applies, n, with_state=True)
    params, state = jax.jit(pp.init)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, D))

    def reference(params, state, x):
        ys = []
        for x_j in x.reshape(m, -1, D):
            y_j, state = plain.apply(params, state, x_j)
            ys.append(y_j)
        return jnp.concatenate(ys), state

    def loss(f):
        def fn(p, v):
            y, new = f(p, state, v)
            return jnp.sum(jnp.sin(y)), (y, new)

        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))

    (_, (y, new)), g = loss(pp.apply)(params, x)
    (_, (y_ref, new_ref)), g_ref = loss(reference)(params, x)
    return {
        "max_err": compare(_named(y, g[1], g[0]), _named(y_ref, g_ref[1], g_ref[0])),
        "state_err": compare(new, new_ref),
        "counts": [new[2]["count"].tolist(), new_ref[2]["count"].tolist()],
    }


def _seen_init(key):
    return _dense_init(key), {"seen": jnp.zeros((8, D))}  # one row per example, as a cache


def _seen_apply(p, state, x):
    seen = state["seen"] + x
    return _tanh(p, x + 0.1 * seen), {"seen": seen}


def _stateless_init(key):
    return _scale_init(key), None


def _stateless_apply(p, state, x):
    return _scale(p, x), state


def _case_fsdp_state():
    """FSDP over "data" gathered at every tick, a pattern of a layer with batched state (a
    cache-like sum of its inputs) and one without state, the circular schedule (2 chunks of
    one layer a stage), auto axes (stage=4, data=2), remat: outputs, the new state and the
    grads (params and x, of a loss that reads the new state too) against the stack on the
    whole batch; the training step's collectives and all-gathers. The same with the
    interleaved 1F1B schedule and a head's loss: its loss, grads (params, x, the head; the
    float state's: zeros) and new state against the stack's and the circular schedule's."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("stage", "data"))
    inits, applies, n = [_seen_init, _stateless_init], [_seen_apply, _stateless_apply], 8
    pp = stackwise.pipeline(
        inits, applies, n, mesh, microbatches=4, with_state=True, fsdp="data",
        fsdp_gather="tick", schedule="circular", repeats=2, remat=True,
    )  # fmt: skip
    plain = stackwise.stack(inits, applies, n, with_state=True)
    params, state = jax.jit(plain.init)(jax.random.key(0))
    state = jax.tree.map(lambda a: a + 0.5, state)
    x = jax.random.normal(jax.random.key(1), (8, D))

    def loss_of(f):
        def fn(p, v):
            y, new = f(p, state, v)
            return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.sin(new[0]["seen"])), (y, new)

        return fn

    loss = lambda f: jax.jit(jax.value_and_grad(loss_of(f), (0, 1), has_aux=True))  # noqa: E731
    step = loss(pp.apply).lower(params, x).compile()
    (_, (y, new)), g = step(params, x)
    (_, (y_ref, new_ref)), g_ref = loss(plain.apply)(params, x)
    gathers = lambda f: str(jax.make_jaxpr(f)(params, x)).count("= all_gather[")  # noqa: E731
    forward = lambda p, v: pp.apply(p, state, v)  # noqa: E731
    f1 = stackwise.pipeline(
        inits, applies, n, mesh, microbatches=4, with_state=True, fsdp="data",
        fsdp_gather="tick", schedule="1f1b", loss=_head_mse, repeats=2, remat=True,
    )  # fmt: skip
    t = jax.random.normal(jax.random.key(2), (8, D))
    head = jax.random.normal(jax.random.key(3), (D, D)) / D**0.5

    def plain_loss(p, v, h, s):
        y, new = plain.apply(p, s, v)
        return _head_mse(y, t, h), new

    loss_1f1b = lambda p, v, h, s: f1.apply(p, s, v, t, loss_params=h)  # noqa: E731
    grad = lambda f: jax.jit(jax.value_and_grad(f, (0, 1, 2, 3), has_aux=True))  # noqa: E731
    (v1, new1), (*g1, g_state) = grad(loss_1f1b)(params, x, head, state)
    (v_ref, new_ref1), (*g_ref1, _) = grad(plain_loss)(params, x, head, state)
    value, new0 = jax.jit(loss_1f1b)(params, x, head, state)  # GPipe's forward, and the loss
    return {
        "max_err": compare(_named(y, g[1], g[0]), _named(y_ref, g_ref[1], g_ref[0])),
        "state_err": compare(new, new_ref),
        "program": collectives(step.as_text()),
        "jaxpr_gathers": [gathers(forward), gathers(jax.grad(loss_of(pp.apply), has_aux=True))],
        "1f1b_err": compare(_named(v1, g1[1:], g1[0]), _named(v_ref, g_ref1[1:], g_ref1[0])),
        "1f1b_state_err": worst(compare(new1, new_ref1), compare(new1, new)),
        "1f1b_value_err": worst(
            compare(value, _head_mse(y, t, head)), compare(new0, new), compare(new0, new1)
        ),
        "1f1b_state_grad": _diff(g_state, jax.tree.map(jnp.zeros_like, state)),
    }


def _case_residuals():
    """What the backward pass of a k=3 pattern keeps (``jax.ad_checkpoint``'s printout of
    the saved residuals, traced only), with no remat (everything saveable) and M = 4: per
    schedule and FSDP gather, the residuals with a row of w's shape (8, 8)."""
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    inits, applies = [_dense_init, _scale_init, _dense_init], [_tanh, _scale, _sin]
    params = jax.jit(stackwise.stack(inits, applies, 8).init)(jax.random.key(0))
    placed = stackwise.shard_stacked(params, mesh, stackwise.fsdp_specs(params, mesh, "data"))
    x = jnp.ones((8, D))
    out = {}
    for schedule, fsdp, gather in (
        ("circular", None, "step"),
        ("circular", "data", "step"),
        ("circular", "data", "tick"),
        ("gpipe", "data", "step"),
    ):
        pp = stackwise.pipeline(
            inits, applies, 8, mesh, microbatches=4, data_axis=None if fsdp else "data",
            fsdp=fsdp, fsdp_gather=gather, schedule=schedule, remat=False,
        )  # fmt: skip
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            jax.ad_checkpoint.print_saved_residuals(pp.apply, placed, x)
        types = [line.split(" ")[0] for line in printed.getvalue().splitlines()]
        out[f"{schedule} {fsdp} {gather}"] = [t for t in types if t.endswith(",8,8]")]
    return out


HEADS, CONTEXT, WINDOW, VOCAB = 2, 8, 3, 16


def _cached(window):
    """Causal attention over a per-layer KV cache (``window``: a sliding window), written
    with ``dynamic_update_slice`` at ``pos``: a prefill of t tokens or one decode step."""

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {
            "qkv": jax.random.normal(k1, (D, 3 * D)) / D**0.5,
            "out": jax.random.normal(k2, (D, D)) / D**0.5,
        }
        return params, {
            "k": jnp.zeros((4, CONTEXT, HEADS, D // HEADS)),
            "v": jnp.zeros((4, CONTEXT, HEADS, D // HEADS)),
        }

    def apply(params, cache, x, pos):
        b, t, _ = x.shape
        q, k, v = (a.reshape(b, t, HEADS, D // HEADS) for a in jnp.split(x @ params["qkv"], 3, -1))
        ck = jax.lax.dynamic_update_slice_in_dim(cache["k"], k, pos, 1)
        cv = jax.lax.dynamic_update_slice_in_dim(cache["v"], v, pos, 1)
        i = pos + jnp.arange(t)[:, None]
        j = jnp.arange(CONTEXT)[None, :]
        seen = (j <= i) if window is None else (j <= i) & (i - j < window)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, ck) / (D // HEADS) ** 0.5
        scores = jnp.where(seen[None, None], scores, -1e30)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), cv).reshape(b, t, D)
        return x + y @ params["out"], {"k": ck, "v": cv}

    return init, apply


def _case_decode():
    """A pipelined decode, local : global attention, n=8 over (stage=4, data=2), a batch of
    4 in 2 microbatches: a prefill of 3 tokens and 4 greedy steps give the loop's tokens
    and cache. Params and cache are placed once on the stages (and the cache's batch on the
    data axis): with L = 2 a multiple of k = 2, the stack's layout is the stages' own. The
    same decode steps, from the same prefill, with FSDP inside the stages (over "data",
    gathered once a step), its params placed split over the stages and "data": 1/8 of them
    on each device."""
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    P = jax.sharding.PartitionSpec
    kinds = [_cached(WINDOW), _cached(None)]
    inits, applies, n, k = [i for i, _ in kinds], [a for _, a in kinds], 8, 2
    pipelined = lambda **fsdp: stackwise.pipeline(  # noqa: E731
        inits, applies, n, mesh, microbatches=2, data_axis="data", with_state=True, **fsdp
    )
    pp = pipelined()
    params, cache = jax.jit(pp.init)(jax.random.key(0))
    placed = stackwise.shard_stacked(params, mesh, layer_axis="stage")
    fsdp_placed = stackwise.shard_stacked(
        params, mesh, stackwise.fsdp_specs(params, mesh, "data"), layer_axis="stage"
    )
    cache_pp = stackwise.shard_stacked(cache, mesh, P("data"), layer_axis="stage")
    embed = jax.random.normal(jax.random.key(1), (VOCAB, D))
    embed_on_mesh = jax.device_put(embed, jax.sharding.NamedSharding(mesh, P()))
    prompt = jax.random.randint(jax.random.key(2), (4, 3), 0, VOCAB)
    loop_layers = _loop_params(inits, n, jax.random.key(0))

    def loop_step(caches, tokens, pos):
        h = embed[tokens]
        new = []
        for i, (p, c) in enumerate(zip([layer[0] for layer in loop_layers], caches)):
            h, c = applies[i % k](p, c, h, pos)
            new.append(c)
        return jnp.argmax(h[:, -1] @ embed.T, -1), new

    def pp_step(pp, params):
        def step(cache, tokens, pos):
            h, cache = pp.apply(params, cache, jax.nn.one_hot(tokens, VOCAB) @ embed_on_mesh, pos)
            return jnp.argmax(h[:, -1] @ embed_on_mesh.T, -1), cache

        return step

    def generate(step, cache, prefilled=None):
        """The prefill's token and cache (given, or computed and kept), then 4 steps."""
        if prefilled is None:
            prefilled = jax.jit(step)(cache, prompt, jnp.int32(0))
        token, cache = prefilled[0], jax.tree.map(jnp.copy, prefilled[1])
        # One decode step, compiled once (its program is read below), the cache donated.
        decode = (
            jax.jit(step, donate_argnums=0).lower(cache, token[:, None], jnp.int32(3)).compile()
        )
        tokens = [token]
        for pos in range(3, 7):
            token, cache = decode(cache, token[:, None], jnp.int32(pos))
            tokens.append(token)
        return jnp.stack(tokens, 1), cache, decode, prefilled

    tokens, cache_out, decode, prefilled = generate(pp_step(pp, placed), cache_pp)
    tokens_ref, caches_ref, *_ = generate(loop_step, [c for _, c in loop_layers])
    # FSDP's decode steps, from the same prefill.
    fsdp = pp_step(pipelined(fsdp="data"), fsdp_placed)
    tokens_fsdp, cache_fsdp, decode_fsdp, _ = generate(fsdp, None, prefilled)
    hlo = decode.as_text()
    return {
        "tokens": tokens.tolist(),
        "tokens_ref": tokens_ref.tolist(),
        "cache_err": compare(cache_out, _regroup(caches_ref, k)),
        "cache_spec": str(P(*_trimmed(cache_out[0]["k"].sharding.spec))),
        "outside_loop": sorted({c[0] for c in collectives(hlo) if c[2] == 0}),
        "tokens_fsdp": tokens_fsdp.tolist(),
        "cache_err_fsdp": compare(cache_fsdp, _regroup(caches_ref, k)),
        "param_specs_fsdp": jax.tree.map(_spec_of, fsdp_placed),
        "param_bytes_fsdp": sum(
            a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(fsdp_placed)
        ),
        "total_bytes": sum(a.nbytes for a in jax.tree.leaves(fsdp_placed)),
        "program_fsdp": collectives(decode_fsdp.as_text()),
    }


_CASES = {
    "phases": _case_phases,
    "fsdp_state": _case_fsdp_state,
    "residuals": _case_residuals,
    "gemma": _case_gemma,
    "aux_and_arguments": _case_aux_and_arguments,
    "statistics": _case_statistics,
    "decode": _case_decode,
}


@pytest.fixture(scope="module")
def multi_device():
    return run_module(__file__)


@pytest.mark.parametrize("name", ["phases", "gemma"])
def test_pattern_pipeline_matches_loop_outputs_and_grads(multi_device, name):
    r = result(multi_device, name)
    check(r["max_err"], PIPELINE_BOUND)
    assert r["init_equals_loop"]  # Stacked.init is the stack's: the loop's params, regrouped


def test_pattern_pipeline_aux_and_per_layer_arguments(multi_device):
    r = result(multi_device, "aux_and_arguments")
    check(r["max_err"], PIPELINE_BOUND)
    check(r["aux_err"], PIPELINE_BOUND)
    # Positions 0 and 2 hold layers 0, 3, 6 and 2, 5; each index summed over 4 microbatches.
    assert r["index_sums"] == [[0, 12, 24], [8, 20]]


def test_state_pipeline_matches_microbatch_loop(multi_device):
    r = result(multi_device, "statistics")
    check(r["max_err"], PIPELINE_BOUND)
    check(r["state_err"], PIPELINE_BOUND)
    assert r["counts"][0] == r["counts"][1] == [4, 4]  # once per microbatch, bubbles left out


def test_1f1b_pattern_at_uneven_phases_matches_loop_and_gpipe(multi_device):
    # k=3 over 4 stages of 2 layers, explicit axes, FSDP gathered once a step, nested, unroll.
    r = result(multi_device, "phases")
    check(r["1f1b_err"], PIPELINE_BOUND)  # loss and grads (params, x, the head): the loop's
    check(r["1f1b_gpipe_err"], PIPELINE_BOUND)  # the loss of GPipe's output
    check(r["1f1b_value_err"], PIPELINE_BOUND)  # without differentiation
    assert r["1f1b_grad_specs"] == r["param_specs"]  # grads in the params' (FSDP) layout


def test_1f1b_interleaved_pattern_with_state_and_fsdp_per_tick(multi_device):
    # repeats=2, a cache-like batched state, FSDP gathered per tick, auto axes, remat.
    r = result(multi_device, "fsdp_state")
    check(r["1f1b_err"], PIPELINE_BOUND)  # loss and grads (params, x, the head): the stack's
    check(r["1f1b_state_err"], PIPELINE_BOUND)  # the new state: the stack's and the circular's
    check(r["1f1b_value_err"], PIPELINE_BOUND)  # without differentiation: GPipe's and the loss
    assert r["1f1b_state_grad"] == 0.0  # the state is not differentiated


def test_pipelined_decode_gives_the_loops_tokens(multi_device):
    r = result(multi_device, "decode")
    assert r["tokens"] == r["tokens_ref"]
    assert len(r["tokens"]) == 4 and len(r["tokens"][0]) == 5
    check(r["cache_err"], PIPELINE_BOUND)
    # The cache stays where it was placed: layers on the stages, its batch on the data axis;
    # a decode step moves no cache or params, only the output (summed over the stages).
    assert r["cache_spec"] == "P('stage', 'data')"
    assert r["outside_loop"] == ["all-reduce"], r["outside_loop"]


# --------------------------------------------------------------------------
# FSDP inside the stages: patterns and state.


def _fsdp_collectives(program, shapes):
    """The all-gathers and reduce-scatters of ``shapes`` (``"f32[1,8,8]"``, ...)."""
    return [
        (op, kind.split("{")[0], depth)
        for op, kind, depth in program
        if op in ("all-gather", "reduce-scatter") and kind.split("{")[0] in shapes
    ]


def _elements(kind: str) -> int:
    """The number of elements of an HLO array type such as ``f32[1,4,8]{2,1,0}``."""
    return int(np.prod([int(d) for d in kind.split("[")[1].split("]")[0].split(",") if d]))


def test_fsdp_pattern_at_uneven_phases_gathers_once_per_step(multi_device):
    r = result(multi_device, "phases")
    check(r["max_err"], PIPELINE_BOUND)
    # Each position's params split over "data" as placed, their gradients reduce-scattered
    # back to that layout.
    expected = [{"w": "P(None, 'data')"}, {"s": "P(None, 'data')"}, {"w": "P(None, 'data')"}]
    assert r["param_specs"] == r["grad_specs"] == expected
    # One row of each position a stage, gathered whole before the tick loop (the backward
    # pass's gather may be merged with it by the CPU compiler), the grads of the three
    # leaves reduce-scattered after it: nothing gathers or scatters params in the loop.
    gathered = _fsdp_collectives(r["program"], ("f32[1,8,8]", "f32[1,8]"))
    leaves = ["f32[1,8,8]", "f32[1,8,8]", "f32[1,8]"]
    found = sorted(c[1] for c in gathered if c[0] == "all-gather")
    assert found in (leaves, sorted(leaves * 2)), r["program"]
    scattered = _fsdp_collectives(r["program"], ("f32[1,4,8]", "f32[1,4]"))
    assert sorted(c[1] for c in scattered if c[0] == "reduce-scatter") == [
        "f32[1,4,8]", "f32[1,4,8]", "f32[1,4]"
    ], r["program"]  # fmt: skip
    assert all(depth == 0 for *_, depth in gathered + scattered), r["program"]
    # No gather assembles a position's whole params (3 layers of w: 192 floats): the
    # regrouping into stage blocks (here in the backward pass) keeps the FSDP split.
    largest = max(_elements(kind) for op, kind, _ in r["program"] if op == "all-gather")
    assert largest <= 4 * 8 * 8 // 2, r["program"]
    # The jaxpr gathers every leaf again for the backward pass: no gathered copy is saved.
    forward, backward = r["jaxpr_gathers"]
    assert forward == 3 and backward == 2 * forward, r["jaxpr_gathers"]


def test_fsdp_state_circular_gathers_per_tick(multi_device):
    r = result(multi_device, "fsdp_state")
    check(r["max_err"], PIPELINE_BOUND)
    check(r["state_err"], PIPELINE_BOUND)
    # Each tick gathers its chunk (one layer: w or s) in the tick loop, forward and backward
    # (again there, not kept), and reduce-scatters its grads.
    gathered = _fsdp_collectives(r["program"], ("f32[1,8,8]", "f32[1,8]"))
    gathered = [c for c in gathered if c[0] == "all-gather"]
    assert sorted(c[1] for c in gathered) == ["f32[1,8,8]"] * 2 + ["f32[1,8]"] * 2, gathered
    scattered = _fsdp_collectives(r["program"], ("f32[1,4,8]", "f32[1,4]"))
    assert sorted(c[1] for c in scattered) == ["f32[1,4,8]", "f32[1,4]"], scattered
    assert all(depth == 1 for *_, depth in gathered + scattered), r["program"]
    forward, backward = r["jaxpr_gathers"]
    assert forward == 2 and backward >= forward + 2, r["jaxpr_gathers"]


def test_no_row_of_params_saved_per_tick(multi_device):
    # Without remat everything is saveable, but not the stage's params per tick: a
    # circular stage's checkpoint kept each layer's row of its block, f32[88,1,8,8] (11
    # ticks x 8 devices), until its policy refused the rows as well as the chunks. With
    # FSDP nothing of w's whole shape is kept at all (no gathered copy); without, the
    # stage's own blocks (2 rows a device), once.
    r = {k: v for k, v in result(multi_device, "residuals").items() if k != "cpu_s"}
    assert r.pop("circular None step") == ["f32[16@(stage,data),8,8]"] * 2
    assert r == {k: [] for k in r} and len(r) == 3, r


def test_fsdp_decode_gives_the_loops_tokens(multi_device):
    r = result(multi_device, "decode")
    assert r["tokens_fsdp"] == r["tokens_ref"]
    check(r["cache_err_fsdp"], PIPELINE_BOUND)
    # Params split over the stages and FSDP: 1/8 on each device.
    split = {"qkv": "P('stage', None, 'data')", "out": "P('stage', 'data')"}
    assert r["param_specs_fsdp"] == [split, split]
    assert r["param_bytes_fsdp"] * 8 == r["total_bytes"], r
    # A decode step gathers each leaf of its stage once, before the tick loop, and moves
    # nothing else but the output (summed over the stages).
    outside = sorted(c[:2] for c in r["program_fsdp"] if c[2] == 0)
    gathers = sorted(kind.split("{")[0] for op, kind in outside if op == "all-gather")
    assert gathers == ["f32[1,8,24]", "f32[1,8,24]", "f32[1,8,8]", "f32[1,8,8]"], outside
    assert {op for op, _ in outside} == {"all-gather", "all-reduce"}, outside
    assert all(c[0] != "all-gather" for c in r["program_fsdp"] if c[2] > 0), r["program_fsdp"]


# --------------------------------------------------------------------------
# One device (this process): one layer with state, the pipeline without a pattern.


def test_one_layer_with_state_on_one_device():
    # A cache with a batch axis and a counter without one (batched_state by path), one
    # stage, auto axes, FSDP over a "data" axis of size 1 (the counter is not split over
    # it): the stack's apply on the 2 microbatches in order, exactly.
    def init(key):
        return _dense_init(key), {"seen": jnp.zeros((4, D)), "calls": jnp.zeros((), jnp.int32)}

    def apply(p, state, x):
        seen = state["seen"] + x
        return _tanh(p, x + 0.1 * seen), {"seen": seen, "calls": state["calls"] + 1}

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("stage", "data"))
    pp = stackwise.pipeline(init, apply, 3, mesh, microbatches=2, with_state=True,
                            batched_state=lambda path: "seen" in path, fsdp="data")  # fmt: skip
    plain = stackwise.stack(init, apply, 3, with_state=True)
    params, state = jax.jit(plain.init)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, D))
    y, new = jax.jit(pp.apply)(params, state, x)
    ys, calls, reference = [], state["calls"], jax.jit(plain.apply)
    for half in (slice(0, 2), slice(2, 4)):
        y_h, s_h = reference(params, {"seen": state["seen"][:, half], "calls": calls}, x[half])
        ys.append(y_h)
        calls = s_h["calls"]
        assert_close(new["seen"][:, half], s_h["seen"], PIPELINE_BOUND)
    assert_close(y, jnp.concatenate(ys), PIPELINE_BOUND)
    assert new["calls"].tolist() == calls.tolist() == [2, 2, 2]


if __name__ == "__main__":
    run_cases(_CASES)

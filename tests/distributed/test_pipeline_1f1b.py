"""The 1F1B pipeline schedule: the same loss and gradients as GPipe and a loop, activation
memory flat in M, and the tick loop the schedule says.

The multi-device checks run once, in a subprocess with 8 simulated CPU devices (this file
is also that subprocess's script, see ``_CASES``), as in ``test_pipeline.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import collectives, loop_trip_counts
from _multidevice import result, run_cases, run_module
from _tolerance import check, compare, reassociation_bound

import stackwise

# Temp memory of the 1F1B step at M=16 against M=4, same microbatch size: flat in M.
FLAT_IN_M = 1.2
# Interleaved 1F1B's temp growth from M=4 to 16 against its ring's 7 more slots.
RING_MARGIN = 1.1
# GPipe's, which keeps every microbatch's activations until the backward pass, grows.
GROWS_IN_M = 1.5

D = 8  # feature width

# float32 sums reassociated across microbatches, stages and the data axis: the loss and grads
# within PIPELINE_BOUND * eps * (the leaf's largest magnitude) of the loop's and GPipe's
# (tests/_tolerance.py). 8 layers of width-D matmuls, a loss over 32 x D outputs (and grads
# summing the 32 rows): 6 * (2 * 8 * sqrt(8) + sqrt(32 * 8)) = 368 eps, 4.4e-5 of the scale. The
# pattern with state: 8 layers of width 128, a loss over 4 x 32 x 128 outputs: 6 * (2 * 8 *
# sqrt(128) + 128) = 1,855 eps, 2.2e-4. Measured on an AMD EPYC VM (the suite's XLA flags, XLA's
# default fusion emitters, optimisation level 2): at most 3.3 eps, and 2.9 with state. A relative
# error of 1e-3 is 8,389 eps.
PIPELINE_BOUND = reassociation_bound(depth=8, width=D, summed=32 * D)
STATE_BOUND = reassociation_bound(depth=8, width=128, summed=4 * 32 * 128)


def _init(key):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (D, D)) / D**0.5, "b": 0.1 * jax.random.normal(k2, (D,))}


def _apply(params, x, scale=1.0):
    return x + scale * jnp.tanh(x @ params["w"] + params["b"][None, :])


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def _compare(v, g, v_ref, g_ref) -> dict:
    """``_tolerance.compare`` of a loss and its grads (params first, then the arguments)."""
    named = lambda v, g: {"loss": v, "grad_params": g[0], "grad_args": g[1:]}  # noqa: E731
    return compare(named(v, g), named(v_ref, g_ref))


# --------------------------------------------------------------------------
# The cases, run in the 8-device subprocess.


def _case_equals_gpipe(remat, repeats=1):
    """(stage=4, data=2), explicit, params placed on the stages: the 1F1B loss and grads
    (params, x, a float const) against GPipe's (circular, with ``repeats``). Without remat,
    M=4, also against a loop, the undifferentiated value and the compiled program; with a
    remat policy and nested remat, M=8: more microbatches than the ring's 2S - 1 = 7 slots,
    so that it wraps. Interleaved (``repeats=2``): the params in the circular layout
    ``(V, n/V, ...)``."""
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    n, m = 8, 8 if remat else 4
    kw = dict(microbatches=m, data_axis="data", remat=remat, nested=bool(remat))
    f1 = stackwise.pipeline(_init, _apply, n, mesh, schedule="1f1b", loss=_mse,
                            repeats=repeats, **kw)
    gp = stackwise.pipeline(_init, _apply, n, mesh, repeats=repeats,
                            schedule="circular" if repeats > 1 else "gpipe", **kw)
    params = jax.jit(f1.init)(jax.random.key(0))
    placed = stackwise.shard_stacked(params, mesh, layer_axis="stage", repeats=repeats)
    x = jax.random.normal(jax.random.key(1), (32, D))
    t = jax.random.normal(jax.random.key(2), (32, D))
    scale = jnp.float32(0.7)

    def loop(p, x, t, scale):
        for q in stackwise.unstack_layers(p):
            x = _apply(q, x, scale)
        return _mse(x, t)

    grad = lambda f, p: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 3))).lower(  # noqa: E731
        p, x, t, scale).compile()
    step = grad(f1.apply, placed)
    v1, g1 = step(placed, x, t, scale)
    v2, g2 = grad(lambda p, x, t, s: _mse(gp.apply(p, x, s), t), placed)(placed, x, t, scale)
    out = {"gpipe_err": _compare(v1, g1, v2, g2)}
    if not remat:
        v3, g3 = grad(loop, params)(params, x, t, scale)
        out["grad_spec"] = str(g1[0]["w"].sharding.spec)
        g1 = (jax.tree.map(lambda a: np.asarray(a).reshape(n, *a.shape[2:]), g1[0])
              if repeats > 1 else g1[0], *g1[1:])  # the loop's layout
        hlo = step.as_text()
        out.update({
            "loop_err": _compare(v1, g1, v3, g3),
            "value_err": compare(jax.jit(f1.apply)(placed, x, t, scale), v3),
            "tick_trips": loop_trip_counts(hlo, "collective-permute"),
            "backward": collectives(hlo),
        })
    return out


def _arguments_apply(p, x, mask, key, i, gain):
    """A layer using a per-example mask, a dropout key, its index and a per-layer gain."""
    h, count = x
    y = h + gain * jnp.tanh(h @ p["w"] + p["b"][None, :]) * mask[:, None]
    keep = jax.random.bernoulli(key, 0.8, y.shape)
    return jnp.where(keep, y, 0.0) + 0.01 * i, count + 1


def _xent(y, labels, head):
    """Cross-entropy of integer labels (targets with no gradient) after an output head."""
    h, count = y
    logp = jax.nn.log_softmax(h @ head)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1)) + 0.0 * jnp.sum(count)


def _case_arguments(repeats=1):
    """Auto mesh (stage=4, data=2), remat, M=4 per data shard: a pytree carry with an int
    leaf, int targets, an output head (loss_params), per-example / per-layer keys / layer
    index / per-layer gains, against a loop over the D*M microbatches; grads of params, x,
    the mask, the gains and the head. Interleaved (``repeats=2``, params in the ``(n, ...)``
    layout): M=8, more forward steps (M*V = 16) than the ring's 2VS - 1 = 15 slots."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("stage", "data"))
    n, m, data = 4 * repeats, 4 * repeats, 2
    pp = stackwise.pipeline(_init, _arguments_apply, n, mesh, microbatches=m, repeats=repeats,
                            data_axis="data", schedule="1f1b", loss=_xent, remat=True)
    params = pp.init(jax.random.key(0))
    rows = 2 * m * data
    x = jax.random.normal(jax.random.key(1), (rows, D))
    counts = jnp.zeros((rows,), jnp.int32)
    labels = jax.random.randint(jax.random.key(3), (rows,), 0, D)
    mask = (jnp.arange(rows) % 3 != 0).astype(jnp.float32)
    key = jax.random.key(5)
    gains = jnp.linspace(0.5, 1.5, n)
    head = jax.random.normal(jax.random.key(4), (D, D))

    def apply(params, x, mask, gains, head):
        return pp.apply(params, (x, counts), labels, stackwise.per_example(mask),
                        stackwise.per_layer_keys(key), stackwise.layer_index(),
                        stackwise.per_layer(gains), loss_params=head)

    def reference(params, x, mask, gains, head):
        def one(x_j, c_j, mask_j, labels_j, j):
            h = (x_j, c_j)
            for i, p in enumerate(stackwise.unstack_layers(params)):
                key_ij = jax.random.fold_in(jax.random.split(key, n)[i], j)
                h = _arguments_apply(p, h, mask_j, key_ij, jnp.int32(i), gains[i])
            return _xent(h, labels_j, head)

        split = lambda v: v.reshape(m * data, -1, *v.shape[1:])  # noqa: E731
        losses = jax.vmap(one)(split(x), split(counts), split(mask), split(labels),
                               jnp.arange(m * data))
        return jnp.mean(losses)

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4)))  # noqa: E731
    v, g = grad(apply)(params, x, mask, gains, head)
    v_ref, g_ref = grad(reference)(params, x, mask, gains, head)
    return {"max_err": _compare(v, g, v_ref, g_ref)}



def _case_memory():
    """Temp memory of the params' gradient at M = 4 and 16 with 32 rows per microbatch;
    interleaved 1F1B (V=2) too, compiled only, its params in the circular layout; and 1F1B
    of a pattern with state (statistics, without a batch axis: ``data_axis=None``), whose
    step at M = 4 also runs, against the stack run on the microbatches in order."""
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    width, n, rows = 128, 8, 32

    def init(key):
        return {"w": jax.random.normal(key, (width, width)) / width**0.5}

    def apply(p, x):
        return x + jnp.tanh(x @ p["w"])

    params = jax.eval_shape(stackwise.stack(init, apply, n).init, jax.random.key(0))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    params = stackwise.shard_stacked(zeros, mesh, layer_axis="stage")
    circular = stackwise.shard_stacked(zeros, mesh, layer_axis="stage", repeats=2)
    out = {"slot_mib": rows * width * 4 / 2**20}  # one stage input in the ring
    for m in (4, 16):
        x = jnp.zeros((2 * m * rows, width))
        kw = dict(microbatches=m, data_axis="data", remat=True)
        f1 = stackwise.pipeline(None, apply, n, mesh, schedule="1f1b", loss=_mse, **kw)
        gp = stackwise.pipeline(None, apply, n, mesh, **kw)
        gpipe_loss = lambda p, x, t, gp=gp: _mse(gp.apply(p, x), t)  # noqa: E731
        for name, f in (("1f1b", f1.apply), ("gpipe", gpipe_loss)):
            compiled = jax.jit(jax.grad(f)).lower(params, x, x).compile()
            out[f"{name}_M{m}"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
        f2 = stackwise.pipeline(None, apply, n, mesh, schedule="1f1b", loss=_mse, repeats=2, **kw)
        compiled = jax.jit(jax.grad(f2.apply)).lower(circular, x, x).compile()
        out[f"interleaved_M{m}"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
    out.update(_pattern_state_memory(mesh, width, n, rows, init, apply))
    return out


def _pattern_state_memory(mesh, width, n, rows, init, apply):
    """1F1B of a pattern with state: temp memory of the params' gradient at M = 4 and 16,
    and the M = 4 step's loss, grads and state against the stack on the microbatches in
    order (the state, a running mean of each layer's input, feeds its output: 1F1B's
    gradient does not flow through it from one microbatch to the next)."""

    def stats_init(key):
        return init(key), {"mean": jnp.zeros(width)}

    def stats(p, state, x):  # a running mean of the layer's input
        mean = 0.9 * state["mean"] + 0.1 * jnp.mean(x, 0)
        return apply(p, x - mean[None, :]), {"mean": mean}

    def stateless(p, state, x):
        return apply(p, x), state

    inits, applies = [stats_init, lambda key: (init(key), None)], [stats, stateless]
    plain = stackwise.stack(inits, applies, n, with_state=True)
    params, state = jax.jit(plain.init)(jax.random.key(0))
    state = jax.tree.map(lambda a: a + 0.1, state)
    placed = stackwise.shard_stacked(params, mesh, layer_axis="stage")
    out, steps = {}, {}
    for m in (4, 16):
        pp = stackwise.pipeline(inits, applies, n, mesh, microbatches=m, with_state=True,
                                batched_state=False, schedule="1f1b", loss=_mse, remat=True)
        loss = lambda p, x, t, pp=pp: pp.apply(p, state, x, t)  # noqa: E731
        x = jnp.zeros((m * rows, width))
        steps[m] = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(
            placed, x, x).compile()
        out[f"pattern_state_M{m}"] = steps[m].memory_analysis().temp_size_in_bytes / 2**20

    def reference(p, x, t):
        """The stack on the 4 microbatches in turn, no gradient through the state."""
        st, losses = state, []
        for x_j, t_j in zip(x.reshape(4, rows, width), t.reshape(4, rows, width)):
            y_j, st = plain.apply(p, jax.lax.stop_gradient(st), x_j)
            losses.append(_mse(y_j, t_j))
        return jnp.mean(jnp.stack(losses)), st

    x = jax.random.normal(jax.random.key(1), (4 * rows, width))
    t = jax.random.normal(jax.random.key(2), (4 * rows, width))
    (loss, new), grads = steps[4](placed, x, t)
    grad = jax.jit(jax.value_and_grad(reference, has_aux=True))
    (loss_ref, new_ref), grads_ref = grad(params, x, t)
    named = lambda v, g, s: {"loss": v, "grad_params": g, "state": s}  # noqa: E731
    out["pattern_state_err"] = compare(named(loss, grads, new), named(loss_ref, grads_ref, new_ref))
    return out


_CASES = {
    "equals_gpipe": lambda: _case_equals_gpipe(False),
    "equals_gpipe_remat": lambda: _case_equals_gpipe(jax.checkpoint_policies.nothing_saveable),
    "interleaved": lambda: _case_equals_gpipe(False, repeats=2),
    "arguments": _case_arguments,
    "interleaved_arguments": lambda: _case_arguments(repeats=2),
    "memory": _case_memory,
}


@pytest.fixture(scope="module")
def multi_device():
    return run_module(__file__)


@pytest.mark.parametrize("name", ["equals_gpipe", "equals_gpipe_remat", "interleaved"])
def test_1f1b_equals_gpipe(multi_device, name):
    # interleaved: against the circular schedule with the same repeats=2.
    check(result(multi_device, name)["gpipe_err"], PIPELINE_BOUND, name)


@pytest.mark.parametrize("name, spec", [("equals_gpipe", "P('stage', None, None)"),
                                        ("interleaved", "P(None, 'stage', None, None)")])
def test_1f1b_equals_the_loop(multi_device, name, spec):
    r = result(multi_device, name)
    check(r["loop_err"], PIPELINE_BOUND, name)
    check(r["value_err"], PIPELINE_BOUND, name)  # without differentiation: GPipe's forward
    assert r["grad_spec"] == spec  # the params' layout (interleaved: the circular one)


@pytest.mark.parametrize("name", ["arguments", "interleaved_arguments"])
def test_1f1b_arguments_match_the_loop(multi_device, name):
    check(result(multi_device, name)["max_err"], PIPELINE_BOUND, name)


@pytest.mark.parametrize("name, loops", [("equals_gpipe", [3, 4, 3]), ("interleaved", [7, 4, 7])])
def test_1f1b_runs_its_ticks_and_reduces_grads_once(multi_device, name, loops):
    # T = M*V + V*S + S - 2 ticks (M + 2S - 2 for V = 1) in three loops: V*S - 1 ticks of
    # forwards only (no stage has a backward yet), M*V + S - V*S of forwards and backwards
    # together, V*S - 1 of backwards only. S=4, M=4: V=1 [3, 4, 3], V=2 [7, 4, 7].
    assert sorted(result(multi_device, name)["tick_trips"]) == sorted(loops)
    reduces = [c for c in result(multi_device, name)["backward"] if c[0] == "all-reduce"]
    assert reduces and all(depth == 0 for _, _, depth in reduces), reduces


def test_1f1b_memory_is_flat_in_microbatches_where_gpipe_grows(multi_device):
    r = result(multi_device, "memory")
    assert r["1f1b_M16"] <= FLAT_IN_M * r["1f1b_M4"], r
    # Interleaved (V=2): the ring holds min(M*V, 2VS - 1) stage inputs, 8 at M = S and 15
    # from M = 8 on: from M = 4 to 16 temp grows by those 7 slots, nothing per microbatch.
    grown = r["interleaved_M16"] - r["interleaved_M4"]
    assert grown <= RING_MARGIN * 7 * r["slot_mib"], r
    assert r["gpipe_M16"] >= GROWS_IN_M * r["gpipe_M4"], r
    # A pattern with state: its ring keeps each input's state too, K slots, not M.
    assert r["pattern_state_M16"] <= FLAT_IN_M * r["pattern_state_M4"], r
    check(r["pattern_state_err"], STATE_BOUND)  # the stack on the microbatches in order


if __name__ == "__main__":
    run_cases(_CASES)

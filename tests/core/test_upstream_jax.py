"""stackwise's ties to JAX internals (`stackwise/_upstream/jax.py`), each checked directly.

A failure here means a JAX release changed something stackwise relies on; the message names
the tie. The code itself probes each tie once, on first use, and where one no longer holds
takes an exact path: the tests with a tie marked broken show that path gives the loop's
results (a layer's state returned whole; remat policies that save nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _trees import assert_trees_close
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import stackwise
from stackwise._core import inplace
from stackwise._upstream import jax as jax_ties

everything = jax.checkpoint_policies.everything_saveable


@pytest.fixture
def probed_afresh():
    """``holds`` forgets what it found, before and after the test."""
    jax_ties.holds.cache_clear()
    yield
    jax_ties.holds.cache_clear()


def broken(monkeypatch, *ties: str) -> None:
    """The code sees ``ties`` (all of them if none is named) as no longer holding."""
    down = set(ties or jax_ties.TIES)
    monkeypatch.setattr(jax_ties, "holds", lambda tie: tie not in down)


# --------------------------------------------------------------------------
# Each tie, probed as the code probes it; a broken one is named, warned once.


@pytest.mark.every_case
@pytest.mark.parametrize("tie", list(jax_ties.TIES))
def test_each_tie_holds_with_the_installed_jax(tie):
    jax_ties.check(tie)  # raises UpstreamChanged naming the tie


def test_a_tie_that_no_longer_holds_is_named_and_warned_once(monkeypatch, probed_afresh):
    def changed():
        raise KeyError("reshard")  # as if the primitive had been renamed

    monkeypatch.setitem(jax_ties.TIES, jax_ties.RESHARD, changed)
    message = r"the tie to jax.reshard's primitive .* no longer holds: its probe raised KeyError"
    with pytest.raises(jax_ties.UpstreamChanged, match=message) as e:
        jax_ties.check(jax_ties.RESHARD)
    assert e.value.tie == jax_ties.RESHARD and jax.__version__ in str(e.value)
    with pytest.warns(RuntimeWarning, match=message):
        assert not jax_ties.holds(jax_ties.RESHARD)
    assert not jax_ties.holds(jax_ties.RESHARD)  # probed once (a second warning would raise)
    keep = jax_ties.unless_resharded(everything, "x")
    assert not keep(jax.lax.sin_p, jax.core.ShapedArray((2,), jnp.float32))
    # A probe that finds the tie changed says how, unwrapped.
    found = lambda: jax_ties._expect(jax_ties.NAME, False, "`name` took no `name` param")  # noqa: E731
    monkeypatch.setitem(jax_ties.TIES, jax_ties.NAME, found)
    with pytest.raises(jax_ties.UpstreamChanged, match=r"no longer holds: `name` took no `name`"):
        jax_ties.check(jax_ties.NAME)


def test_the_probes_hold_inside_a_trace_under_a_mesh_and_without_jit():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))

    def probe_all(x):
        for tie in jax_ties.TIES:
            jax_ties.check(tie)
        return x

    with jax.set_mesh(mesh):
        jax.jit(probe_all)(1.0)
    with jax.disable_jit():
        probe_all(1.0)


# --------------------------------------------------------------------------
# The primitive names, as `jax.make_jaxpr` shows them.


def primitives(closed) -> list[str]:
    """Every primitive of a jaxpr, the bodies of calls and maps included, in order."""
    names = []
    for eqn in closed.jaxpr.eqns if hasattr(closed, "jaxpr") else closed.eqns:
        names.append(eqn.primitive.name)
        for v in eqn.params.values():
            if hasattr(v, "eqns") or hasattr(v, "jaxpr"):
                names += primitives(v)
    return names


def test_the_matched_primitives_are_what_jax_emits():
    x, mesh = jnp.ones((4, 3)), jax.sharding.AbstractMesh((1,), ("i",))
    reshard = jax.make_jaxpr(lambda v: jax.reshard(v, NamedSharding(mesh, P())))(x)
    assert primitives(reshard) == ["reshard"]
    gather = jax.shard_map(
        lambda v: jax.lax.all_gather(v, "i", axis=0, tiled=True),
        mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=False,
    )  # fmt: skip
    assert "all_gather" in primitives(jax.make_jaxpr(gather)(x))
    named = jax.make_jaxpr(lambda v: checkpoint_name(v, "tag"))(x).jaxpr.eqns
    assert [(e.primitive.name, e.params) for e in named] == [("name", {"name": "tag"})]
    takes = [
        lambda v, i: jax.lax.dynamic_slice_in_dim(v, i, 2),
        lambda v, i: jax.lax.dynamic_index_in_dim(v, i, keepdims=False),
        lambda v, i: v[0],
        lambda v, i: v[1:3],
    ]
    index_arithmetic = {"lt", "add", "select_n", "convert_element_type", "jit"}
    for take in takes:
        found = set(primitives(jax.make_jaxpr(take)(x, 1))) - index_arithmetic
        assert found and found <= set(jax_ties.SLICE_PRIMITIVES), found
    write = jax.make_jaxpr(lambda c, u, i: jax.lax.dynamic_update_index_in_dim(c, u, i, 0))
    assert "dynamic_update_slice" in primitives(write(x, x[0], 1))
    assert jax.make_jaxpr(jax.jit(jnp.sin))(x).jaxpr.eqns[0].primitive.name in (
        jax_ties.CALL_PRIMITIVES
    )


# --------------------------------------------------------------------------
# The evaluation loop against `jax.core.eval_jaxpr`.


@jax.custom_vjp
def scaled(x):
    return x * 3.0


scaled.defvjp(lambda x: (x * 3.0, None), lambda _, g: (g * 3.0,))


FUNCTIONS = {
    "calls": None,  # the probe's: a jit in a jit, a closed_call, a multiple-results sort
    "control-flow": lambda c, u, i: (
        jax.lax.scan(lambda h, r: (jnp.tanh(h + r), h), u, c),
        jax.lax.cond(i > 1, jnp.sin, jnp.cos, c),
        jax.lax.fori_loop(0, i, lambda k, h: h * 0.5 + k, u),
    ),
    "custom-rules-remat-consts": lambda c, u, i: (
        jax.nn.relu(c - 5.0),
        scaled(u),
        jax.checkpoint(lambda v: jnp.exp(jnp.sin(v)))(c),
        c + jnp.arange(3.0)[None],  # a constant array: a constvar
    ),
}


@pytest.mark.every_case
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_the_evaluation_loop_computes_what_jax_eval_jaxpr_computes(name):
    args = (jnp.arange(12.0).reshape(4, 3), jnp.array([3.0, 1.0, 2.0]), jnp.int32(2))
    if FUNCTIONS[name] is None:
        closed = jax_ties._probe_jaxpr(args)
    else:
        closed = jax.make_jaxpr(FUNCTIONS[name])(*args)
    want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    for inline in (lambda ins: True, lambda ins: False):  # each call's body here, or bound
        got = jax_ties.eval_jaxpr(closed.jaxpr, closed.consts, list(args), inline, lambda *_: None)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


# --------------------------------------------------------------------------
# In-place state, and its exact path with the loop's tie broken.

B, T, D = 2, 8, 4


def init(key):
    return {"w": jax.random.normal(key, (D, D)) / D}, {"k": jnp.zeros((B, T, D))}


def attend(params, cache, x, pos):
    """Writes x @ w at ``pos`` (inside a `jax.jit`-wrapped helper) and reads the cache."""
    k = jax.lax.dynamic_update_index_in_dim(cache["k"], x @ params["w"], pos, 1)
    return x + jnp.tanh(k.sum(1)), {"k": k}


def decode(layers, params, cache, xs):
    step = jax.jit(layers.apply)
    ys = []
    for pos, x in enumerate(xs):
        y, cache = step(params, cache, x, jnp.int32(pos))
        ys.append(y)
    return ys, cache


def loop(params, cache, xs):
    per_layer, caches = stackwise.unstack_layers(params), stackwise.unstack_layers(cache)
    ys = []
    for pos, x in enumerate(xs):
        for layer, (p, c) in enumerate(zip(per_layer, caches)):
            x, caches[layer] = attend(p, c, x, pos)
        ys.append(x)
    return ys, stackwise.stack_layers(caches)


@pytest.mark.parametrize("tie", [jax_ties.EVAL_LOOP, jax_ties.UPDATE_SLICE])
def test_with_the_loop_tie_broken_state_leaves_the_layer_whole_with_the_same_values(
    monkeypatch, tie
):
    layers = stackwise.stack(init, attend, 3, with_state=True)
    params, cache = layers.init(jax.random.key(0))
    xs = list(jax.random.normal(jax.random.key(1), (3, B, D)))
    p0, c0 = stackwise.unstack_layers(params)[0], stackwise.unstack_layers(cache)[0]
    x = xs[0]
    layer = lambda p, x, pos, c: attend(p, c, x, pos)  # noqa: E731  (the state last)
    kinds = [u.kind for u in inplace.call(layer, (p0, x, 0), c0)[2]]
    assert kinds == ["write"]  # the tie holds: the update leaves the layer, not the cache
    ys, new = decode(layers, params, cache, xs)
    broken(monkeypatch, tie)
    kinds = [u.kind for u in inplace.call(layer, (p0, x, 0), c0)[2]]
    assert kinds == ["new"]
    ys_whole, new_whole = decode(layers, params, cache, xs)
    ys_loop, new_loop = loop(params, cache, xs)
    assert_trees_close((ys_whole, new_whole), (ys_loop, new_loop))
    assert_trees_close((ys, new), (ys_loop, new_loop))


# --------------------------------------------------------------------------
# The remat policies, and their exact path (save nothing) with a name tie broken.


def saved(fn, *args, capsys) -> list[str]:
    """What ``jax.grad`` saves for the backward pass, one line each (JAX's own listing)."""
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
    return capsys.readouterr().out.splitlines()


def sliced(stack, x):
    a = jnp.sin(x)  # an activation, saved by `everything`
    return jnp.sum(jnp.tanh(jax.lax.dynamic_slice_in_dim(stack, 1, 2) * a))


def test_unless_sliced_saves_all_but_the_slice_and_nothing_if_broken(monkeypatch, capsys):
    stack, x = jnp.arange(12.0).reshape(4, 3) / 10, jnp.ones((2, 3))

    def with_policy():
        policy = jax_ties.unless_sliced(everything, {(4, 3)})
        return jax.checkpoint(sliced, policy=policy)

    # What JAX saves with a policy that saves nothing (the arguments; jax 0.10.0 lists a few
    # values of the backward pass's own making too, 0.10.2 none): the fallback's floor.
    def computed(fn):  # the saved values that are not arguments
        return {line for line in saved(fn, stack, x, capsys=capsys) if "argument" not in line}

    floor = computed(jax.checkpoint(sliced, policy=jax.checkpoint_policies.nothing_saveable))
    grads = jax.grad(with_policy(), (0, 1))(stack, x)
    lines = computed(with_policy())
    assert lines > floor, lines  # something computed is saved (`everything`) ...
    assert not any("dynamic_slice" in line for line in lines), lines  # ... but not the slice
    broken(monkeypatch, jax_ties.SLICES)
    assert computed(with_policy()) == floor  # saves nothing
    assert_trees_close(jax.grad(with_policy(), (0, 1))(stack, x), grads)
    assert_trees_close(grads, jax.grad(sliced, (0, 1))(stack, x))


def split(stack, x):
    a = jnp.sin(x)  # an activation of exactly the stack's shape, split along its last axis
    rows = jax.lax.dynamic_slice_in_dim(stack, 1, 2)  # rows of the stack
    return jnp.sum(a[:, 1:] * a[:, :2]) + jnp.sum(jnp.sin(rows) * a[:2, ::-1])


def test_unless_sliced_saves_a_same_shaped_value_sliced_along_another_axis(capsys):
    # A policy sees operands' shapes, not where they came from: the activation's columns
    # are not a stack's rows (another axis), so `everything` saves them; the rows are not.
    stack, x = jnp.arange(12.0).reshape(4, 3) / 10, jnp.ones((4, 3))
    checkpointed = jax.checkpoint(split, policy=jax_ties.unless_sliced(everything, {(4, 3)}))
    lines = saved(checkpointed, stack, x, capsys=capsys)
    # (the two columns' slices: jax 0.10.2 lists them as outputs of `slice`, 0.10.0 of the
    # `reduce_precision` it places after them)
    assert sum(line.startswith("f32[4,2] output of ") for line in lines) == 2, lines
    assert not any("dynamic_slice" in line for line in lines), lines
    assert_trees_close(jax.grad(checkpointed, (0, 1))(stack, x), jax.grad(split, (0, 1))(stack, x))


def test_takes_rows_reads_the_leading_axis_only():
    take = jax_ties.takes_rows
    assert take("dynamic_slice", (4, 3), {"slice_sizes": (2, 3)})
    assert not take("dynamic_slice", (4, 3), {"slice_sizes": (4, 2)})
    whole = {"start_indices": (1, 0), "limit_indices": (3, 3), "strides": None}
    assert take("slice", (4, 3), whole)
    assert not take("slice", (4, 3), {**whole, "strides": (2, 1)})
    assert not take("slice", (4, 3), {**whole, "start_indices": (1, 1)})
    assert take("squeeze", (1, 3), {"dimensions": (0,)})
    assert not take("squeeze", (3, 1), {"dimensions": (1,)})
    assert not take("reshape", (4, 3), {}) and not take("slice", (), whole)


def gathered(v):
    g = jax.lax.all_gather(jnp.cos(v), "i", axis=0, tiled=True)
    return jnp.sum(jnp.sin(g) * jnp.sin(checkpoint_name(v * 2.0, "tag")))


def test_unless_all_gathered_saves_all_but_the_gather_and_nothing_if_broken(monkeypatch, capsys):
    mesh, v = jax.make_mesh((1,), ("i",)), jnp.ones((3,))

    def on_device(body):
        return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)

    def checkpointed():
        return jax.checkpoint(gathered, policy=jax_ties.unless_all_gathered(everything, "tag"))

    def saved_on_device():  # inside the device program, where a pipeline stage's policy acts
        capsys.readouterr()
        jax.make_jaxpr(
            on_device(lambda v: jax.ad_checkpoint.print_saved_residuals(checkpointed(), v) or v)
        )(v)
        return capsys.readouterr().out.splitlines()

    lines = saved_on_device()
    assert any("output of cos" in line for line in lines), lines
    assert not any("all_gather" in line or "output of name" in line for line in lines), lines
    grad = jax.jit(jax.grad(on_device(checkpointed())))(v)
    broken(monkeypatch, jax_ties.ALL_GATHER)
    assert saved_on_device() == ["f32[3] from the argument v"]  # nothing computed is saved
    assert_trees_close(jax.jit(jax.grad(on_device(checkpointed())))(v), grad)
    assert_trees_close(grad, jax.jit(jax.grad(on_device(gathered)))(v))


def fsdp_layer(p, x):
    return jnp.tanh(x @ p["w"])


def test_fsdp_never_saves_the_gathered_params_and_saves_nothing_if_broken(monkeypatch, capsys):
    mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(AxisType.Explicit,))
    init_w = lambda key: {"w": jax.random.normal(key, (D, D)) / D}  # noqa: E731
    x = jnp.ones((B, D))
    with jax.set_mesh(mesh):
        layers = stackwise.stack(init_w, fsdp_layer, 3, fsdp="fsdp", remat=everything)
        params = jax.device_put(layers.init(jax.random.key(0)), P(None, "fsdp", None))
        loss = lambda p: layers.apply(p, x).sum()  # noqa: E731
        lines = saved(loss, params, capsys=capsys)
        gathered = f"f32[3,{D},{D}] output"  # a (D, D) layer's gathered params, per layer
        assert lines and not any(gathered in line for line in lines), lines
        scans = lambda lines: sum("output of scan" in line for line in lines)  # noqa: E731
        assert scans(lines) > 1, lines  # the carries entering the layers, and the policy's
        grads = jax.grad(loss)(params)
        broken(monkeypatch, jax_ties.RESHARD)
        layers = stackwise.stack(init_w, fsdp_layer, 3, fsdp="fsdp", remat=everything)
        lines = saved(lambda p: layers.apply(p, x).sum(), params, capsys=capsys)
        assert scans(lines) == 1, lines  # the carries (the checkpoint's inputs) alone
        grads_nothing = jax.grad(lambda p: layers.apply(p, x).sum())(params)

    def loop_loss(p):
        h = x
        for layer in stackwise.unstack_layers(p):
            h = fsdp_layer(layer, h)
        return h.sum()

    loop_grads = jax.grad(loop_loss)(jax.device_get(params))
    assert_trees_close(grads, loop_grads)
    assert_trees_close(grads_nothing, loop_grads)


def test_source_line_names_the_users_line_and_is_empty_where_jax_gives_none(monkeypatch):
    def block(x):
        return jnp.sin(x)

    eqn = jax.make_jaxpr(block)(1.0).jaxpr.eqns[0]
    line = jax_ties.source_line(eqn)
    assert "test_upstream_jax.py" in line and "block" in line, line
    from jax._src import source_info_util

    # (JAX's private summary gone or changed: the words go, the error they word stays)
    monkeypatch.delattr(source_info_util, "summarize")
    assert jax_ties.source_line(eqn) == ""

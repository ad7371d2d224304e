"""Named shardings inside autostacked blocks, and params placed on a mesh.

A loop whose every layer constrains its activations (``with_sharding_constraint`` on an auto
mesh, ``jax.sharding.reshard`` and ``out_sharding`` on an explicit one, a ``jax.jit`` block
with ``out_shardings``) and whose params are placed with ``NamedSharding``: the scan's body
keeps each constraint once (the lowered program holds it inside the ``while`` body, the
loop's holds it once per layer), the stacked params are placed as the loop's with the layer
axis unsplit in front (``P(None, *spec)``), the grads come back so, ``unstack`` gives the
loop's params and placements back bitwise, and outputs and grads equal the loop's.

The mesh cases run in a subprocess with 8 simulated CPU devices (``_CASES``); the tests
above them run on one device, on a one-device explicit mesh (the sharding in a value's type
is the same there).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from _multidevice import result, run_cases, run_module
from _tolerance import check, compare, reassociation_bound
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import stackwise

N, D, H, BATCH = 4, 8, 16, 8
# float32 sums reassociated (across devices and by the scan): N layers of two matmuls (D and
# H terms), a loss over BATCH x 2 outputs (tests/_tolerance.py).
BOUND = reassociation_bound(depth=N, width=(D, H), summed=BATCH * 2)
PLACED = {"w": P(None, "model"), "b": P(), "v": P("model", None)}


def constrained_loop(mesh, explicit: bool):
    """The mlp loop, each layer's hidden values split over both mesh axes and its output
    over ``data``: constrained (auto mesh) or resharded (explicit mesh)."""

    def constrain(v, spec):
        if explicit:
            return jax.sharding.reshard(v, spec)
        return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, spec))

    def model(params, x):
        for p in params["layers"]:
            h = constrain(jnp.tanh(x @ p["w"] + p["b"]), P("data", "model"))
            if explicit:  # (a contraction over a split axis says where its output goes)
                x = x + jnp.matmul(h, p["v"], out_sharding=P("data", None))
            else:
                x = constrain(x + h @ p["v"], P("data", None))
        return x @ params["head"]

    return model


def jitted_loop(mesh, explicit: bool):
    """Each layer a ``jax.jit`` call with ``out_shardings``: one equation per block."""
    del explicit

    @jax.jit
    def block(p, x):
        return x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]

    block = jax.jit(block, out_shardings=NamedSharding(mesh, P("data", None)))

    def model(params, x):
        for p in params["layers"]:
            x = block(p, x)
        return x @ params["head"]

    return model


def make_params(mesh, specs=None):
    keys = jax.random.split(jax.random.key(0), N + 1)
    params = {
        "layers": [{"w": jax.random.normal(k, (D, H)) / D**0.5, "b": jnp.full((1, H), 0.1),
                    "v": jax.random.normal(k, (H, D)) / H**0.5} for k in keys[:N]],
        "head": jax.random.normal(keys[N], (D, 2)) / D**0.5,
    }
    specs = specs or [PLACED] * N
    shardings = {"layers": [{k: NamedSharding(mesh, s) for k, s in spec.items()}
                            for spec in specs], "head": NamedSharding(mesh, P())}
    return jax.device_put(params, shardings)


def trimmed(sharding) -> str:
    """A NamedSharding's spec (or a spec) without trailing Nones (``P(None, None)`` is
    ``P()``)."""
    spec = list(getattr(sharding, "spec", sharding))
    while spec and spec[-1] is None:
        spec.pop()
    return str(P(*spec))


def primitives(jaxpr) -> list[str]:
    """Every primitive of a jaxpr, its calls' bodies inlined, a scan's body as one list."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            names.append(["scan", *primitives(eqn.params["jaxpr"].jaxpr)])
            continue
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        names += primitives(getattr(inner, "jaxpr", inner)) if inner is not None else []
        names.append(eqn.primitive.name)
    return names


def constraints(hlo: str) -> list[tuple[str, str, int]]:
    """``(shape, spec, loop depth)`` of every sharding constraint of a lowered HLO module
    (``.lower(...).as_text(dialect="hlo")``; depth 1: inside a ``while`` body), once per
    call of the computation that holds it."""
    comps, name, entry = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?([\w.\-]+) \{", line)
        if head:
            name, comps[head.group(2)] = head.group(2), []
            entry = name if head.group(1) else entry
        elif name is not None:
            comps[name].append(line)
    found, todo = [], [(entry, 0)]
    while todo:  # (every call walked: HLO's call graph has no cycles)
        comp, depth = todo.pop()
        for line in comps.get(comp, ()):
            for kind, callee in re.findall(r"(to_apply|body|condition|calls)=([\w.\-]+)", line):
                todo.append((callee, depth + (kind == "body")))
            if 'custom_call_target="Sharding"' in line:
                shape = re.search(r"= (\w+\[[\d,]*\])", line).group(1)
                spec = re.search(r"<@mesh, (\[.*?\])>", line.replace('\\"', '"')).group(1)
                found.append((shape, spec, depth))
    return found


# --------------------------------------------------------------------------
# One device: the sharding in a value's type is part of a block's signature, and the stacked
# params are placed as the loop's.


def one_device_mesh():
    return jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def test_resharded_blocks_are_one_scan_keeping_each_reshard_and_placements():
    mesh = one_device_mesh()
    model = constrained_loop(mesh, explicit=True)
    with jax.set_mesh(mesh):
        params = make_params(mesh)
        x = jax.device_put(jnp.ones((BATCH, D)), P("data"))
        stacked, f = stackwise.autostack(model, params, x, n=N)
        names = primitives(jax.make_jaxpr(f)(stacked, x).jaxpr)
        (body,) = [entry[1:] for entry in names if isinstance(entry, list)]
        assert body.count("reshard") == 1 and "reshard" not in names, names
        assert primitives(jax.make_jaxpr(model)(params, x).jaxpr).count("reshard") == N
        specs = {key: trimmed(leaf.sharding) for key, leaf in stacked["blocks"].items()}
        assert specs == {"['layers'][0]['b']": "P()", "['layers'][0]['v']": "P(None, 'model')",
                         "['layers'][0]['w']": "P(None, None, 'model')"}
        # The loop's params back, placed as they were; also from a stack whose layer axis
        # was split afterwards (the scan refuses that: tests/misuse/test_misuse_autostack.py).
        split = jax.tree.map(lambda a: jax.sharding.reshard(a, P("data", *a.sharding.spec[1:])),
                             stacked["blocks"])
        assert jax.typeof(split["['layers'][0]['w']"]).str_short() == "float32[4@data,8,16@model]"
        for stack in (stacked, {"blocks": split, "rest": stacked["rest"]}):
            back = f.unstack(stack)
            for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
                assert got.sharding.is_equivalent_to(want.sharding, want.ndim)
                assert (got == want).all()
        report = compare(jax.jit(f)(stacked, x), jax.jit(model)(params, x))
    check(report, BOUND, "outputs")


def test_blocks_whose_params_are_split_otherwise_are_other_blocks():
    mesh = one_device_mesh()
    other = {"w": P("model", None), "b": P(), "v": P(None, "model")}
    model = constrained_loop(mesh, explicit=True)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((BATCH, D)), P("data"))
        # one layer split otherwise: the loop is broken there, and the message says how
        with pytest.raises(ValueError) as info:
            stackwise.autostack(model, make_params(mesh, [PLACED, PLACED, other, PLACED]), x)
        # two layers of each placement: two runs, each stacked onto its own
        params = make_params(mesh, [PLACED, PLACED, other, other])
        stacked, f = stackwise.autostack(model, params, x, n=(2, 2))
        assert trimmed(stacked["blocks"]["['layers'][0]['w']"].sharding) == (
            "P(None, None, 'model')")
        assert trimmed(stacked["blocks"]["['layers'][2]['w']"].sharding) == (
            "P(None, 'model')")
        report = compare(jax.jit(f)(stacked, x), jax.jit(model)(params, x))
    check(report, BOUND, "outputs")
    message = str(info.value)
    assert "the loop is broken at block 2" in message and "(`dot_general`" in message, message
    assert ("its inputs are float32[8@data,8], float32[8@model,16] where block 0's are "
            "float32[8@data,8], float32[8,16@model]") in message, message


# --------------------------------------------------------------------------
# 8 devices.


def _case(loop, explicit: bool) -> dict:
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    model = loop(mesh, explicit)
    with jax.set_mesh(mesh):
        params = make_params(mesh)
        x = jax.device_put(jax.random.normal(jax.random.key(1), (BATCH, D)), P("data"))
        stacked, f = stackwise.autostack(model, params, x)

        def loss(g, p):
            return jnp.sum(jnp.sin(g(p, x)))

        out, grads = jax.jit(jax.value_and_grad(lambda p: loss(f, p)))(stacked)
        want = jax.jit(jax.value_and_grad(lambda p: loss(model, p)))(params)
        back = f.unstack(stacked)
        # the layer axis split over `data` afterwards: unstacked as the loop placed it too
        split = jax.device_put(stacked["blocks"], jax.tree.map(
            lambda a: a.sharding.update(spec=P("data", *a.sharding.spec[1:])),
            stacked["blocks"]))
        back_split = f.unstack({"blocks": split, "rest": stacked["rest"]})
        lowered = jax.jit(f).lower(stacked, x).as_text(dialect="hlo")
        looped = jax.jit(model).lower(params, x).as_text(dialect="hlo")
    return {
        "found": [f.found.n, f.found.start],
        "max_err": compare((out, f.unstack(grads)), want),
        "stacked_specs": {k: trimmed(v.sharding) for k, v in stacked["blocks"].items()},
        "grad_specs": {k: trimmed(v.sharding) for k, v in grads["blocks"].items()},
        # the loop's grads of block 0's leaves, the layer axis put in front
        "loop_grad_specs": {f"['layers'][0][{k!r}]": trimmed(P(None, *v.sharding.spec))
                            for k, v in want[1]["layers"][0].items()},
        "back_placed": all(a.sharding.is_equivalent_to(b.sharding, b.ndim) for a, b in
                           zip(jax.tree.leaves(back), jax.tree.leaves(params))),
        "back_bitwise": all(bool((a == b).all()) and a.dtype == b.dtype for a, b in
                            zip(jax.tree.leaves(back), jax.tree.leaves(params))),
        "split_specs": sorted({trimmed(v.sharding)[:8] for v in split.values()}),
        "split_back_placed": all(a.sharding.is_equivalent_to(b.sharding, b.ndim) for a, b in
                                 zip(jax.tree.leaves(back_split), jax.tree.leaves(params))),
        "split_back_bitwise": all(bool((a == b).all()) for a, b in
                                  zip(jax.tree.leaves(back_split), jax.tree.leaves(params))),
        "constraints": constraints(lowered),
        "loop_constraints": constraints(looped),
    }


_CASES = {
    "auto": lambda: _case(constrained_loop, explicit=False),
    "explicit": lambda: _case(constrained_loop, explicit=True),
    "jitted": lambda: _case(jitted_loop, explicit=False),
}


@pytest.fixture(scope="module")
def multi_device():
    return run_module(__file__, timeout=600)


@pytest.mark.parametrize("case", list(_CASES))
def test_on_a_mesh_outputs_and_grads_are_the_loops_params_placed_with_the_layer_axis(
    multi_device, case
):
    r = result(multi_device, case)
    assert r["found"] == [N, 0]
    check(r["max_err"], BOUND, case)
    want = {"['layers'][0]['b']": "P()", "['layers'][0]['v']": "P(None, 'model')",
            "['layers'][0]['w']": "P(None, None, 'model')"}
    assert r["stacked_specs"] == want
    # The grads are placed as the loop's, the layer axis in front (on an explicit mesh, the
    # params' placement; on an auto mesh, where XLA put the loop's).
    assert r["grad_specs"] == r["loop_grad_specs"]
    if case == "explicit":
        assert r["grad_specs"] == want
    assert r["back_placed"] and r["back_bitwise"]
    assert r["split_specs"] == ["P('data'"]  # (the layer axis split, then unstacked)
    assert r["split_back_placed"] and r["split_back_bitwise"]


@pytest.mark.parametrize("case", list(_CASES))
def test_each_blocks_constraint_is_kept_once_inside_the_while_body(multi_device, case):
    r = result(multi_device, case)
    split = "[{\"data\"}, {\"model\"}]" if case != "jitted" else "[{\"data\"}, {}]"
    shape = f"f32[{BATCH},{H}]" if case != "jitted" else f"f32[{BATCH},{D}]"
    inside = [c for c in r["constraints"] if c[:2] == [shape, split]]
    assert inside and all(depth == 1 for _, _, depth in inside), r["constraints"]
    looped = [c for c in r["loop_constraints"] if c[:2] == [shape, split]]
    assert len(looped) >= N and all(depth == 0 for _, _, depth in looped), looped


if __name__ == "__main__":
    run_cases(_CASES)

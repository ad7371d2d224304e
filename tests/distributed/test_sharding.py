"""Stacked params on a mesh: FSDP and tensor parallel give one device's results.

The multi-device checks run once, in a subprocess with 8 simulated CPU
devices; this file is also that subprocess's script (see ``_CASES``). The
compiled HLO is read to show that FSDP weights are all-gathered inside the
scan's while-loop body, one layer at a time, never the whole stack up front,
and ``memory_analysis()`` that the gathered layers are not kept for the
backward pass.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from _hlo import collectives
from _multidevice import result, run_cases, run_module
from _tolerance import check, compare, reassociation_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import stackwise
from stackwise import fsdp_specs, shard_stacked

N, D = 4, 64  # layers, width: every weight dim divides by 8 devices

# float32 sums reassociated across devices: outputs and grads within SHARDED_BOUND * eps * (the
# leaf's largest magnitude) of one device's loop (tests/_tolerance.py). N layers of two matmuls
# (contractions of D and 2 * D terms), grads summing the 16 rows: 6 * (2 * 4 * (sqrt(64) +
# sqrt(128)) + sqrt(16)) = 952 eps, 1.1e-4 of the scale. Measured on an AMD EPYC VM (the suite's
# XLA flags, XLA's default fusion emitters, optimisation level 2): at most 8.6 eps (1.2e-5 on
# grads of scale 12: within 2e-5, the absolute tolerance this replaces, by 1.6 times). A relative
# error of 1e-3 is 8,389 eps.
SHARDED_BOUND = reassociation_bound(depth=N, width=(D, 2 * D), summed=16)


def _init(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (D, 2 * D)) / D**0.5,
        "w2": jax.random.normal(k2, (2 * D, D)) / (2 * D) ** 0.5,
        "b": jnp.full((D,), 0.1),
    }


def _apply(params, x):
    h = jnp.tanh(jnp.einsum("bd,df->bf", x, params["w1"]))
    # Under explicit axes the contraction over a sharded "model" axis needs
    # its output sharding spelled out (the usual explicit-sharding rule).
    y = jnp.einsum("bf,fd->bd", h, params["w2"], out_sharding=jax.typeof(x).sharding)
    return x + y + params["b"][None, :]


def _loss_and_grad(apply):
    def loss(params, x):
        y = apply(params, x)
        return jnp.sum(jnp.sin(y)), y

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _reference(params, x):
    """One device, a Python loop over the per-layer params."""

    def loop(params, x):
        for p in stackwise.unstack_layers(params):
            x = _apply(p, x)
        return x

    one = jax.devices()[0]
    (_, y), g = _loss_and_grad(loop)(jax.device_put(params, one), jax.device_put(x, one))
    return y, g


def _specs(tree) -> dict:
    """Each leaf's sharding spec as text, trailing ``None`` s dropped (same layout)."""

    def one(a):
        spec = list(a.sharding.spec)
        while spec and spec[-1] is None:
            spec.pop()
        return str(P(*spec))

    return jax.tree.map(one, tree)


def _compare(y, g, y_ref, g_ref) -> dict:
    """``_tolerance.compare`` of outputs and grads, named."""
    return compare({"out": y, "grads": g}, {"out": y_ref, "grads": g_ref})


def _gathers(hlo: str) -> dict:
    """All-gathers of a compiled module: ``{"in_loop": [...], "outside": [...]}``."""
    out = {"in_loop": [], "outside": []}
    for op, shape, depth in collectives(hlo):
        if op == "all-gather":
            out["in_loop" if depth else "outside"].append(shape.split("{")[0])
    return out


def _case_fsdp(axis_type):
    """FSDP over 8 devices: params' largest inner axis split over "data"."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    layers = stackwise.stack(_init, _apply, N, remat=True, fsdp="data")
    params = jax.jit(layers.init)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, D))
    placed = shard_stacked(params, mesh, fsdp_specs(params, mesh))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    f = _loss_and_grad(layers.apply)
    if axis_type == AxisType.Auto:  # auto axes: the output layout is ours to ask for
        f = jax.jit(f, out_shardings=(None, jax.tree.map(lambda a: a.sharding, placed)))
    compiled = f.lower(placed, xs).compile()
    (_, y), g = compiled(placed, xs)
    y_ref, g_ref = _reference(params, x)
    return {
        "max_err": _compare(y, g, y_ref, g_ref),
        "param_specs": _specs(placed),
        "grad_specs": _specs(g),
        "forward": _gathers(jax.jit(layers.apply).lower(placed, xs).compile().as_text()),
        "backward": _gathers(compiled.as_text()),
    }


def _case_fsdp_tensor_parallel():
    """FSDP over "data" on top of Megatron-style specs over "model"."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    layers = stackwise.stack(_init, _apply, N, fsdp="data")
    params = jax.jit(layers.init)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, D))
    tp = {"w1": P(None, "model"), "w2": P("model", None), "b": None}
    placed = shard_stacked(params, mesh, fsdp_specs(params, mesh, base=tp))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    (_, y), g = _loss_and_grad(layers.apply)(placed, xs)
    y_ref, g_ref = _reference(params, x)
    return {
        "max_err": _compare(y, g, y_ref, g_ref),
        "param_specs": _specs(placed),
        "grad_specs": _specs(g),
    }


def _case_fsdp_two_axes():
    """FSDP over two mesh axes, ``("data", "fsdp")``, the batch split over both."""
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
    axes = ("data", "fsdp")
    layers = stackwise.stack(_init, _apply, N, fsdp=axes)
    params = jax.jit(layers.init)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, D))
    placed = shard_stacked(params, mesh, fsdp_specs(params, mesh, axes))
    xs = jax.device_put(x, NamedSharding(mesh, P(axes)))
    f = _loss_and_grad(layers.apply)
    (_, y), g = f(placed, xs)
    y_ref, g_ref = _reference(params, x)
    return {
        "max_err": _compare(y, g, y_ref, g_ref),
        "param_specs": _specs(placed),
        "grad_specs": _specs(g),
        "backward": _gathers(f.lower(placed, xs).compile().as_text()),
    }


def _case_fsdp_memory():
    """Per-device memory of jit(grad) for an 8 MiB stack on 8 devices, replicated or
    FSDP, with and without remat (the figures of ``memory_analysis()``)."""
    width, n = 512, 8
    mesh = jax.make_mesh((8,), ("data",))

    def init(key):
        return {"w": jax.random.normal(key, (width, width)) / width**0.5}

    def apply(p, x):
        return x + jnp.tanh(x @ p["w"])

    out = {"layer_mib": width * width * 4 / 2**20}
    for remat in (False, True):
        for fsdp in (None, "data"):
            layers = stackwise.stack(init, apply, n, remat=remat, fsdp=fsdp)
            shapes = jax.eval_shape(layers.init, jax.random.key(0))
            specs = fsdp_specs(shapes, mesh) if fsdp else None
            params = shard_stacked(jax.tree.map(lambda s: jnp.zeros(s.shape), shapes), mesh, specs)
            x = jax.device_put(jnp.zeros((64, width)), NamedSharding(mesh, P("data")))
            grad = jax.jit(jax.grad(lambda p, v, f=layers.apply: jnp.sum(f(p, v))))
            m = grad.lower(params, x).compile().memory_analysis()
            out[f"{'fsdp' if fsdp else 'replicated'}_remat_{remat}"] = {
                "params": m.argument_size_in_bytes / 2**20,
                "grads": m.output_size_in_bytes / 2**20,
                "temp": m.temp_size_in_bytes / 2**20,
            }
    return out


def _case_layer_axis_and_errors():
    """The layer axis over a stage axis; whole models; shard_stacked's error messages."""
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    params = jax.jit(stackwise.stack(_init, _apply, 8).init)(jax.random.key(0))
    placed = shard_stacked(params, mesh, fsdp_specs(params, mesh), layer_axis="stage")
    circular = shard_stacked(params, mesh, {"w1": P(None, "data"), "w2": None, "b": None},
                             layer_axis="stage", repeats=2)
    # A whole model: the embedding has no layer axis, so nothing is added to its spec.
    model = {"embed": jnp.zeros((12, D)), "blocks": params}
    whole = shard_stacked(model, mesh, {"embed": P(None, "data"), "blocks": None},
                          layer_axis="stage", stacked={"embed": False, "blocks": True})
    # Specs that already name the layer axis (as nn.get_partition_spec gives them).
    full = shard_stacked(params, mesh, {"w1": P("stage", None, "data"), "w2": P("stage"),
                                        "b": P("stage")}, stacked=False)
    errors = {}
    for name, (tree, specs, layer_axis) in {
        "layers_indivisible": (jax.tree.map(lambda a: a[:6], params), None, "stage"),
        "inner_indivisible": ({"b": params["b"][:, :6]}, {"b": P(("stage", "data"))}, None),
        "spec_too_long": (params, {"w1": P(None, None, "data"), "w2": None, "b": None}, "stage"),
        "unknown_axis": (params, P("model"), "stage"),
        "mismatch": (params, {"w": P("data")}, "stage"),
        "axis_twice": (params, P("stage"), "stage"),
    }.items():
        try:
            shard_stacked(tree, mesh, specs, layer_axis=layer_axis)
            errors[name] = "no error"
        except ValueError as e:
            errors[name] = str(e)
    for name, kwargs in {
        "repeats_indivisible": {"layer_axis": "stage", "repeats": 3},
        "repeats_without_layer_axis": {"repeats": 2},
    }.items():
        try:
            shard_stacked(params, mesh, **kwargs)
            errors[name] = "no error"
        except ValueError as e:
            errors[name] = str(e)
    return {
        "shard_shapes": sorted({tuple(s.data.shape) for s in placed["w1"].addressable_shards}),
        "spec": _specs(placed)["w1"],
        "circular": [list(circular["w1"].shape), _specs(circular)["w1"],
                     sorted({tuple(s.data.shape) for s in circular["w1"].addressable_shards})],
        "whole": _specs(whole),
        "full": _specs(full)["w1"],
        "errors": errors,
    }


def _case_explicit_carry():
    """Explicit mesh axes put x's sharding in its type: a layer that returns x sharded
    otherwise cannot be scanned (refused, naming the leaf and the reshard), while a Python
    loop (``unroll=True``) passes it on as a loop does, and the fix runs."""
    mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:2])

    def apply(w, x):  # its output split over "model" along the features
        return jnp.tanh(x @ w)

    def resharded(w, x):  # the fix the error gives
        return jax.sharding.reshard(apply(w, x), P())

    with jax.set_mesh(mesh):
        w = jax.device_put(jax.random.normal(jax.random.key(0), (3, 8, 8)) / 3,
                           NamedSharding(mesh, P(None, None, "model")))
        x = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P()))
        try:
            stackwise.stack(None, apply, 3).apply(w, x)
            refused = "no error"
        except TypeError as e:
            refused = str(e)
        loop = x
        for i in range(3):
            loop = apply(w[i], loop)
        unrolled = stackwise.stack(None, apply, 3, unroll=True).apply(w, x)
        fixed = stackwise.stack(None, resharded, 3).apply(w, x)
        return {"refused": refused,
                "unrolled": float(jnp.abs(unrolled - loop).max()),
                "unrolled_spec": str(jax.typeof(unrolled).sharding.spec),
                "fixed": float(jnp.abs(fixed - loop).max()),
                "fixed_spec": str(jax.typeof(fixed).sharding.spec)}


_CASES = {
    "explicit_carry": _case_explicit_carry,
    "fsdp_explicit": lambda: _case_fsdp(AxisType.Explicit),
    "fsdp_auto": lambda: _case_fsdp(AxisType.Auto),
    "fsdp_tensor_parallel": _case_fsdp_tensor_parallel,
    "fsdp_two_axes": _case_fsdp_two_axes,
    "fsdp_memory": _case_fsdp_memory,
    "layer_axis_and_errors": _case_layer_axis_and_errors,
}


@pytest.fixture(scope="module")
def multi_device():
    return run_module(__file__)


def _result(multi_device, name):
    return result(multi_device, name)


@pytest.mark.parametrize(
    "name", ["fsdp_explicit", "fsdp_auto", "fsdp_tensor_parallel", "fsdp_two_axes"]
)
def test_sharded_matches_one_device_and_grads_stay_sharded(multi_device, name):
    r = _result(multi_device, name)
    check(r["max_err"], SHARDED_BOUND, name)
    assert r["grad_specs"] == r["param_specs"]
    assert "'data'" in r["param_specs"]["w1"]  # really sharded


def test_fsdp_over_two_mesh_axes(multi_device):
    r = _result(multi_device, "fsdp_two_axes")
    assert r["param_specs"]["w1"] == "P(None, None, ('data', 'fsdp'))"
    # Each layer's full weights are gathered in the loop, over both axes at once.
    assert f"f32[{D},{2 * D}]" in r["backward"]["in_loop"]
    assert r["backward"]["outside"] == []


@pytest.mark.parametrize("remat", [False, True])
def test_fsdp_never_keeps_the_gathered_layers(multi_device, remat):
    # Defect 4: `gather_params` with remat=False kept all n gathered layers for the
    # backward pass (temp 39.1 MiB for a 32 MiB stack on 8 devices; replicated: 7.1).
    # `stack(..., fsdp=)` gathers each layer again in the backward pass instead: at most
    # the layer being gathered forward and backward is held, whatever remat.
    r = _result(multi_device, "fsdp_memory")
    fsdp, replicated = r[f"fsdp_remat_{remat}"], r[f"replicated_remat_{remat}"]
    assert fsdp["temp"] < replicated["temp"] + 2 * r["layer_mib"], (fsdp, replicated)
    # Per device: params and grads are 1/8 of the replicated ones ...
    assert fsdp["params"] <= replicated["params"] / 8 + 0.1
    assert fsdp["grads"] <= replicated["grads"] / 8 + 0.1
    # ... and everything together is within 1.25x of (replicated params + grads) / 8 plus
    # the replicated program's temp (its activations).
    total = fsdp["params"] + fsdp["grads"] + fsdp["temp"]
    bound = (replicated["params"] + replicated["grads"]) / 8 + replicated["temp"]
    assert total <= 1.25 * bound, (total, bound)


def test_fsdp_specs_with_tensor_parallel(multi_device):
    specs = _result(multi_device, "fsdp_tensor_parallel")["param_specs"]
    assert specs == {
        "w1": "P(None, 'data', 'model')",
        "w2": "P(None, 'model', 'data')",
        "b": "P(None, 'data')",
    }


@pytest.mark.parametrize("program", ["forward", "backward"])
def test_weights_gathered_per_layer_inside_the_loop(multi_device, program):
    gathers = _result(multi_device, "fsdp_explicit")[program]
    # With explicit axes and `fsdp="data"`: one layer's full weights are
    # gathered in the while body ...
    assert f"f32[{D},{2 * D}]" in gathers["in_loop"]
    assert f"f32[{2 * D},{D}]" in gathers["in_loop"]
    # ... and nothing is gathered before or after the loop (no whole stack).
    assert gathers["outside"] == []


@pytest.mark.parametrize("program", ["forward", "backward"])
def test_auto_axes_gather_inside_the_loop_only(multi_device, program):
    # On auto axes XLA picks what to gather (here it may gather activations
    # instead of weights), but only ever inside the loop, never the stack.
    gathers = _result(multi_device, "fsdp_auto")[program]
    assert gathers["in_loop"]
    assert gathers["outside"] == []
    assert not any(g.startswith(f"f32[{N},") for g in gathers["in_loop"])


def test_layer_axis_over_stages(multi_device):
    r = _result(multi_device, "layer_axis_and_errors")
    assert r["spec"] == "P('stage', None, 'data')"  # w1: 64 x 128, FSDP takes the 128
    assert r["shard_shapes"] == [[2, D, D]]  # 8 layers / 4 stages; 2D / 2 data shards
    # The circular layout: (V, n/V, ...), stage s holding layers s, s+4 (chunks s, s+S).
    assert r["circular"] == [[2, 4, D, 2 * D], "P(None, 'stage', None, 'data')",
                             [[2, 1, D, D]]]


def test_a_layer_resharding_its_carry_under_explicit_axes(multi_device):
    r = _result(multi_device, "explicit_carry")
    assert "stackwise.stack: a layer changed the sharding of carry leaf `x` from " in r["refused"]
    assert "P(None, None) to P(None, 'model')" in r["refused"]
    assert "`jax.sharding.reshard(x, P(None, None))`" in r["refused"]
    assert r["unrolled"] == 0.0 and r["unrolled_spec"] == "P(None, 'model')"  # a loop's
    assert r["fixed"] == 0.0 and r["fixed_spec"] == "P(None, None)"


def test_whole_models_and_full_specs(multi_device):
    r = _result(multi_device, "layer_axis_and_errors")
    assert r["whole"]["embed"] == "P(None, 'data')"  # no layer axis added
    assert r["whole"]["blocks"]["w1"] == "P('stage',)"
    assert r["full"] == "P('stage', None, 'data')"


@pytest.mark.parametrize(
    "case, message",
    [
        ("layers_indivisible", r"the layer axis \(length 6\) cannot be split over mesh axis "
         r"'stage' of size 4"),
        ("inner_indivisible", r"leaf \['b'\] has shape \(8, 6\); axis 1 \(length 6\) cannot "
         r"be split over mesh axis \('stage', 'data'\) of size 8"),
        ("spec_too_long", r"leaf \['w1'\] has shape \(8, 64, 128\) .* names 4 axes.*leave out "
         r"the layer axis.*pass `stacked=False`"),
        ("unknown_axis", r"`spec axis='model'` is not an axis of the mesh"),
        ("mismatch", r"`specs` must mirror the params"),
        ("axis_twice", r"leaf \['b'\]'s spec .* uses mesh axis 'stage' twice"),
        ("repeats_indivisible", r"leaf \['b'\] has 8 layers, which `repeats=3` does not divide"),
        ("repeats_without_layer_axis", r"name it with `layer_axis=`"),
    ],
)
def test_shard_stacked_errors(multi_device, case, message):
    assert re.search(message, _result(multi_device, "layer_axis_and_errors")["errors"][case],
                     re.S)


# --------------------------------------------------------------------------
# fsdp_specs is pure shape logic: an abstract mesh, any shapes.


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 48), min_size=0, max_size=3), min_size=1, max_size=4),
    size=st.sampled_from([1, 2, 3, 4, 8]),
)
def test_fsdp_specs_shards_the_largest_divisible_axis(shapes, size):
    mesh = AbstractMesh((size,), ("data",))
    params = {f"p{i}": jax.ShapeDtypeStruct((5, *s), jnp.float32) for i, s in enumerate(shapes)}
    specs = fsdp_specs(params, mesh)
    for key, leaf in params.items():
        inner = leaf.shape[1:]
        spec = tuple(specs[key]) + (None,) * (len(inner) - len(specs[key]))
        divisible = [d for d, n in enumerate(inner) if n % size == 0]
        if divisible:
            best = max(inner[d] for d in divisible)
            assert spec.count("data") == 1
            assert inner[spec.index("data")] == best
        else:
            assert "data" not in spec


def test_fsdp_specs_errors():
    with pytest.raises(ValueError, match=r"`axis='fsdp'` is not an axis of the mesh"):
        fsdp_specs({"w": jnp.zeros((2, 4))}, AbstractMesh((2,), ("data",)), "fsdp")


def test_fsdp_specs_several_axes_and_whole_models():
    mesh = AbstractMesh((2, 4), ("data", "fsdp"))
    params = {"w": jnp.zeros((3, 16, 8)), "b": jnp.zeros((3, 3))}
    assert fsdp_specs(params, mesh, ("data", "fsdp")) == {"b": P(), "w": P(("data", "fsdp"))}
    # A whole model: only stacked leaves are touched; the embedding (whose axis 0 is
    # not a layer axis) keeps its base spec, whether `stacked` is a tree or a function.
    model = {"embed": jnp.zeros((64, 16)), "blocks": params}
    base = {"embed": P(None, "fsdp"), "blocks": None}
    for stacked in ({"embed": False, "blocks": True}, lambda path: "blocks" in path):
        specs = fsdp_specs(model, mesh, "data", base=base, stacked=stacked)
        assert specs == {"embed": P(None, "fsdp"), "blocks": {"b": P(), "w": P("data")}}


def test_stacked_errors():
    params = {"w": jnp.zeros((3, 16, 8))}
    mesh = AbstractMesh((2,), ("data",))
    with pytest.raises(ValueError, match=r"`stacked` must be True, False, a tree prefix"):
        fsdp_specs(params, mesh, stacked={"v": True})
    with pytest.raises(TypeError, match=r"`stacked` must give a bool per leaf"):
        fsdp_specs(params, mesh, stacked=lambda path: "yes")


def test_fsdp_is_a_no_op_off_mesh():
    layers = stackwise.stack(_init, _apply, 2, fsdp="data")
    params = {"w1": jnp.ones((2, D, 2 * D)), "w2": jnp.ones((2, 2 * D, D)), "b": jnp.ones((2, D))}
    x = jnp.linspace(0, 1, 2 * D).reshape(2, D)
    plain = stackwise.stack(_init, _apply, 2)
    assert jnp.array_equal(jax.jit(layers.apply)(params, x), jax.jit(plain.apply)(params, x))


if __name__ == "__main__":
    run_cases(_CASES)

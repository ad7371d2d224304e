"""qwix static-range quantization (SRQ) on linen and NNX Stacks, against a Python loop of the
same blocks calibrated and quantized by qwix directly.

The QAT model's calibration statistics are created inside the scanned block, so a Stack
holds them stacked (``count`` of shape ``(n,)``); qwix's own ``quantize_params`` cannot take
them. The bridges (``stackwise.flax/nnx.quantize_params(..., quant_stats)``) give qwix each
layer's slice: each layer's static scales are bitwise those qwix computes for the loop's
block from the same statistics, the statistics are the loop's, and so are the outputs."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _nnx import Loop as NnxLoop
from _tolerance import assert_close, reassociation_bound
from _trees import assert_trees_bitwise
from _versions import (
    CALIBRATION_AS_LOOP,
    CALIBRATION_AS_LOOP_WHY,
    EXACT_SCALES,
    EXACT_SCALES_WHY,
    SCALE_ULP,
    SRQ_IN_SCAN,
    SRQ_IN_SCAN_WHY,
    assert_same_quantization,
)
from flax import nnx, traverse_util

import stackwise
import stackwise.flax
import stackwise.nnx

qwix = pytest.importorskip("qwix")

N, D, H = 3, 8, 16
KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (4, D))
CALIBRATION = [X, 2 * X]
BOUND = reassociation_bound(depth=N, width=(D, H), summed=4 * D)


def _rule(calibration="absmax"):
    return qwix.QtRule(
        module_path=".*", weight_qtype="int8", act_qtype="int8", act_static_scale=True,
        act_calibration_method=calibration,
    )


def _per_layer(tree, i):
    return jax.tree.map(lambda a: a[i], tree)


# ------------------------------------------------------------------ linen


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(D, name="down")(jnp.tanh(nn.Dense(H, name="up")(x)))


class LinenStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        return stackwise.flax.Stack(LinenBlock, n=N, name="layers")(x)


class LinenLoop(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(N):
            x = LinenBlock(name=f"layers_{i}")(x)
        return x


def _linen_loop_layout(tree):
    return {f"layers_{i}": _per_layer(tree["layers"], i) for i in range(N)}


def _linen_calibrated(model, rule, floats):
    qat = qwix.quantize_model(model, qwix.QtProvider([rule]))
    stats = qat.init(KEY, X)["quant_stats"]
    step = jax.jit(lambda s, x: qat.apply(
        {"params": floats, "quant_stats": s}, x, mutable=["quant_stats"])[1]["quant_stats"])
    for batch in CALIBRATION:
        stats = step(stats, batch)
    return stats


def _linen_srq(model, rule):
    srq = qwix.quantize_model(model, qwix.PtqProvider([rule]))
    return srq, jax.eval_shape(srq.init, KEY, X)["params"]


@pytest.mark.skipif(not CALIBRATION_AS_LOOP, reason=CALIBRATION_AS_LOOP_WHY)
@pytest.mark.parametrize("calibration", ["absmax", "minmax"])  # minmax: with a zero point
def test_linen_srq_equals_the_loop(calibration):
    rule = _rule(calibration)
    floats = LinenStack().init(KEY, X)["params"]
    loop_floats = _linen_loop_layout(floats)
    stats = _linen_calibrated(LinenStack(), rule, floats)
    count = stats["layers"]["up"]["dot_general0_lhs"]["count"]
    assert count.shape == (N,) and set(count.tolist()) == {len(CALIBRATION)}  # per layer
    loop_stats = _linen_calibrated(LinenLoop(), rule, loop_floats)
    assert_close(_linen_loop_layout(stats), loop_stats, BOUND, what="statistics")

    srq, abstract = _linen_srq(LinenStack(), rule)
    with pytest.raises(ValueError, match="ambiguous"):  # qwix's own: one count for all layers
        qwix.quantize_params(floats, abstract, stats)
    ours = stackwise.flax.quantize_params(floats, abstract, stats)
    scale = ours["layers"]["up"]["dot_general0_lhs_scale"].array
    assert scale.shape[0] == N and len(set(scale.ravel().tolist())) == N  # one per layer
    assert ("dot_general0_lhs_zero_point" in ours["layers"]["up"]) == (calibration == "minmax")

    # The loop's blocks calibrated by the same statistics, quantized by qwix itself.
    loop_srq, loop_abstract = _linen_srq(LinenLoop(), rule)
    loop_params = qwix.quantize_params(loop_floats, loop_abstract, _linen_loop_layout(stats))
    assert_trees_bitwise(_linen_loop_layout(ours), loop_params)
    y = srq.apply({"params": ours}, X)
    assert_close(y, loop_srq.apply({"params": loop_params}, X), BOUND, what="outputs")


def test_linen_srq_outside_the_stack_is_qwix_s():
    """An activation quantized outside any Stack has one statistic (count a scalar): its
    scale is qwix's own; the Stack's are per layer."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(D, name="embed")(x)
            return stackwise.flax.Stack(LinenBlock, n=N, name="layers")(x)

    rule = _rule()
    floats = Model().init(KEY, X)["params"]
    stats = _linen_calibrated(Model(), rule, floats)
    assert stats["embed"]["dot_general0_lhs"]["count"].shape == ()
    _, abstract = _linen_srq(Model(), rule)
    ours = stackwise.flax.quantize_params(floats, abstract, stats)
    theirs = qwix.quantize_params(
        {"embed": floats["embed"]}, {"embed": abstract["embed"]}, {"embed": stats["embed"]}
    )
    assert_trees_bitwise(ours["embed"], theirs["embed"])
    assert ours["layers"]["up"]["dot_general0_lhs_scale"].array.shape == (N, 1, 1)


# ------------------------------------------------------------------ NNX

# qwix 0.1.8's QAT (providers/qt.py) sets `quant_stat.value`, which flax 0.12 deprecates (the
# warning is attributed to flax, so the module filter in pyproject does not catch it).
_QAT_VALUE = pytest.mark.filterwarnings(
    "ignore:'.value' setter is now deprecated:DeprecationWarning"
)


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, H, rngs=rngs)
        self.down = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class NnxModel(nnx.Module):
    def __init__(self):
        self.layers = stackwise.nnx.Stack(NnxBlock, n=N, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.layers(x)


def _nnx_calibrated(model, rule):
    qat = qwix.quantize_model(model, qwix.QtProvider([rule]), X)
    for batch in CALIBRATION:
        qat(batch)
    return nnx.to_pure_dict(nnx.state(qat, qwix.QuantStat))


def _nnx_loop_layout(tree):
    return {"blocks": {i: _per_layer(tree["layers"]["layers"], i) for i in range(N)}}


@_QAT_VALUE
@pytest.mark.skipif(not (EXACT_SCALES and SRQ_IN_SCAN),
                    reason=f"{EXACT_SCALES_WHY}; and {SRQ_IN_SCAN_WHY}")
def test_nnx_srq_equals_the_loop():
    rule = _rule()
    floats = nnx.to_pure_dict(nnx.state(NnxModel(), nnx.Param))
    stats = _nnx_calibrated(NnxModel(), rule)
    count = stats["layers"]["layers"]["up"]["dot_general0_lhs"]["count"]
    assert count.shape == (N,) and set(count.tolist()) == {len(CALIBRATION)}  # per layer
    loop_stats = _nnx_calibrated(NnxLoop(NnxModel().layers.to_layers()), rule)
    assert_close(_nnx_loop_layout(stats), loop_stats, BOUND, what="statistics")

    srq = qwix.quantize_model(NnxModel(), qwix.PtqProvider([rule]), X)
    ours = stackwise.nnx.quantize_params(floats, nnx.eval_shape(lambda: srq), stats)
    scale = ours["layers"]["layers"]["up"]["dot_general0_lhs_scale"]["array"]
    assert scale.shape[0] == N and len(set(scale.ravel().tolist())) == N  # one per layer
    nnx.update(srq, ours)

    loop = NnxLoop(NnxModel().layers.to_layers())
    loop_srq = qwix.quantize_model(loop, qwix.PtqProvider([rule]), X)
    loop_floats = nnx.to_pure_dict(nnx.state(loop, nnx.Param))
    nnx.update(loop_srq, qwix.quantize_params(loop_floats, loop_srq, _nnx_loop_layout(stats)))
    for i, block in enumerate(loop_srq.blocks):
        assert_trees_bitwise(nnx.state(srq.layers[i], nnx.Param), nnx.state(block, nnx.Param))
    assert_close(srq(X), loop_srq(X), BOUND, what="outputs")


@_QAT_VALUE
def test_nnx_srq_equals_qwix_converting_the_qat_stack():
    """qwix's other way in NNX, a PTQ model made from the QAT model itself (each layer's
    statistics read and deleted inside the scan), gives the bridge's params: the weights
    bitwise, the static scales within 1 ulp, 2 off the CPU (there computed in the compiled scan,
    where XLA may round the mean's division differently; the bridge computes them as qwix does
    for a loop, bitwise, see above)."""
    rule = _rule()
    qat = qwix.quantize_model(NnxModel(), qwix.QtProvider([rule]), X)
    for batch in CALIBRATION:
        qat(batch)
    stats = nnx.to_pure_dict(nnx.state(qat, qwix.QuantStat))
    floats = nnx.to_pure_dict(nnx.state(NnxModel(), nnx.Param))
    converted = qwix.quantize_model(qat, qwix.PtqProvider([rule]), X)
    ours = stackwise.nnx.quantize_params(floats, nnx.eval_shape(lambda: converted), stats)
    theirs = nnx.to_pure_dict(nnx.state(converted, nnx.Param))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    flat, flat_theirs = traverse_util.flatten_dict(ours), traverse_util.flatten_dict(theirs)
    scales = [k for k in flat if str(k[-2]).endswith("_lhs_scale")]
    assert len(scales) == 2  # up's and down's inputs
    for k in scales:
        np.testing.assert_array_max_ulp(flat.pop(k), flat_theirs.pop(k), maxulp=SCALE_ULP)
    assert_same_quantization(flat, flat_theirs)  # the weights: bitwise on jax >= 0.10.2


def test_the_bridges_without_statistics_are_unchanged():
    """No `quant_stats` (weight-only PTQ): nothing but the weights, as before."""
    rule = qwix.QtRule(module_path=".*", weight_qtype="int8")
    floats = LinenStack().init(KEY, X)["params"]
    _, abstract = _linen_srq(LinenStack(), rule)
    flat = traverse_util.flatten_dict(stackwise.flax.quantize_params(floats, abstract, {}))
    assert flat.keys() == traverse_util.flatten_dict(floats).keys()

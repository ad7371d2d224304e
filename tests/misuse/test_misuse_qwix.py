"""The misuse catalogue of qwix on Stacks (`stackwise.flax/nnx.quantize_params` and the
Stacks given qwix params): the call, the error it must raise, and words its message must
hold (the leaf, and the fix)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from _misuse import assert_refused, case
from flax import nnx

import stackwise.flax
import stackwise.nnx

qwix = pytest.importorskip("qwix")

KEY = jax.random.key(0)
X = jnp.ones((2, 4))


def _ptq():
    return qwix.PtqProvider([qwix.QtRule(module_path=".*", weight_qtype="int8")])


def _linen(n=3):
    return stackwise.flax.Stack(nn.Dense(4), n=n)


def _linen_abstract():
    return jax.eval_shape(qwix.quantize_model(_linen(), _ptq()).init, KEY, X)["params"]


def _linen_qwix_params_given_to_a_stack():
    floats = _linen().init(KEY, X)["params"]
    wrong = qwix.quantize_params(floats, _linen_abstract())  # scales across the layer axis
    qwix.quantize_model(_linen(), _ptq()).apply({"params": wrong}, X)


def _linen_bridge_other_depth():
    floats = _linen(n=2).init(KEY, X)["params"]
    stackwise.flax.quantize_params(floats, _linen_abstract())


def _linen_bridge_unknown_param():
    floats = _linen().init(KEY, X)["params"]
    stackwise.flax.quantize_params({**floats, "head": jnp.ones((4, 4))}, _linen_abstract())


def _linen_lora_on_float_variables():
    variables = _linen().init(KEY, X)  # no LoRA params: the transformation came later
    lora = qwix.LoraProvider(module_path=".*", rank=2, alpha=2.0)
    qwix.quantize_model(_linen(), lora).apply(variables, X)


def _nnx(n=3):
    return stackwise.nnx.Stack(lambda rngs: nnx.Linear(4, 4, rngs=rngs), n=n, rngs=nnx.Rngs(0))


def _nnx_abstract():
    return nnx.eval_shape(lambda: qwix.quantize_model(_nnx(), _ptq(), X))


def _nnx_qwix_params_given_to_a_stack():
    model = qwix.quantize_model(_nnx(), _ptq(), X)
    wrong = qwix.quantize_params(nnx.to_pure_dict(nnx.state(_nnx(), nnx.Param)), model)
    nnx.update(model, wrong)
    model(X)


def _nnx_bridge_other_depth():
    floats = nnx.to_pure_dict(nnx.state(_nnx(n=2), nnx.Param))
    stackwise.nnx.quantize_params(floats, _nnx_abstract())


def _nnx_bridge_unknown_param():
    floats = nnx.to_pure_dict(nnx.state(_nnx(), nnx.Param))
    stackwise.nnx.quantize_params({**floats, "head": jnp.ones((4, 4))}, _nnx_abstract())


def _nnx_layers_apart_with_qwix_rngs():
    stack = _nnx()
    stack.layers.qwix_rngs = nnx.Rngs(1)  # as qwix.apply_lora_to_model sets it
    stack.to_layers()


def _srq_rule(static=True):
    return qwix.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                       act_static_scale=static)


def _linen_stats(n=3, calibrate=True):
    qat = qwix.quantize_model(_linen(n), qwix.QtProvider([_srq_rule()]))
    variables = qat.init(KEY, X)  # count 0 in every layer until calibrated
    if not calibrate:
        return variables["quant_stats"]
    return qat.apply(variables, X, mutable=["quant_stats"])[1]["quant_stats"]


def _linen_srq_bridge(stats, static=True):
    srq = qwix.quantize_model(_linen(), qwix.PtqProvider([_srq_rule(static)]))
    abstract = jax.eval_shape(srq.init, KEY, X)["params"]
    stackwise.flax.quantize_params(_linen().init(KEY, X)["params"], abstract, stats)


def _linen_srq_uncalibrated():
    _linen_srq_bridge(_linen_stats(calibrate=False))


def _linen_srq_without_static_scales():
    _linen_srq_bridge(_linen_stats(), static=False)


def _linen_srq_other_depth():
    _linen_srq_bridge(_linen_stats(n=2))


def _linen_srq_not_statistics():
    _linen_srq_bridge({"dot_general0_lhs": {"absmax": jnp.ones((3, 1, 1))}})


def _nnx_srq_uncalibrated():
    qat = qwix.quantize_model(_nnx(), qwix.QtProvider([_srq_rule()]), X)  # not run since
    stats = nnx.to_pure_dict(nnx.state(qat, qwix.QuantStat))
    abstract = nnx.eval_shape(
        lambda: qwix.quantize_model(_nnx(), qwix.PtqProvider([_srq_rule()]), X)
    )
    stackwise.nnx.quantize_params(nnx.to_pure_dict(nnx.state(_nnx(), nnx.Param)), abstract, stats)


CASES = [
    case(
        "linen: qwix.quantize_params' stacked params given to a Stack",
        _linen_qwix_params_given_to_a_stack,
        ValueError,
        "kernel'].array.scale",
        "(1, 4, 1)",
        "stackwise.flax.quantize_params",
    ),
    case(
        "linen bridge: float params of another depth",
        _linen_bridge_other_depth,
        ValueError,
        "`bias` of shape (2, 4)",
        "same layers and depth n",
    ),
    case(
        "linen bridge: a param the quantized model lacks",
        _linen_bridge_unknown_param,
        ValueError,
        "`head`",
        "allow_extra_params=True",
    ),
    case(
        "linen: a param added inside the layer with 'params' immutable",
        _linen_lora_on_float_variables,
        ValueError,
        "kernel_lora_a",
        "mutable=['params']",
    ),
    case(
        "nnx: qwix.quantize_params' stacked params given to a Stack",
        _nnx_qwix_params_given_to_a_stack,
        ValueError,
        "kernel.array.scale",
        "stackwise.nnx.quantize_params",
    ),
    case(
        "nnx bridge: float params of another depth",
        _nnx_bridge_other_depth,
        ValueError,
        "`layers.bias` of shape (2, 4)",
        "same layers and depth n",
    ),
    case(
        "nnx bridge: a param the quantized model lacks",
        _nnx_bridge_unknown_param,
        ValueError,
        "`head`",
        "allow_extra_params=True",
    ),
    case(
        "nnx: to_layers with an nnx.Rngs set from outside",
        _nnx_layers_apart_with_qwix_rngs,
        ValueError,
        "qwix_rngs",
        "set_attributes(qwix_rngs=None)",
    ),
    case(
        "linen bridge: SRQ statistics never calibrated",
        _linen_srq_uncalibrated,
        ValueError,
        "`dot_general0_lhs`",
        "layer(s) 0, 1, 2",
        "count 0",
        "mutable=['quant_stats']",
    ),
    case(
        "linen bridge: SRQ statistics for a model without static scales",
        _linen_srq_without_static_scales,
        ValueError,
        "`dot_general0_lhs_scale`",
        "act_static_scale=True",
    ),
    case(
        "linen bridge: SRQ statistics of another depth",
        _linen_srq_other_depth,
        ValueError,
        "`dot_general0_lhs` of shapes (2,), (2, 1, 1)",
        "same layers and depth n",
    ),
    case(
        "linen bridge: quant_stats that are not qwix's statistics",
        _linen_srq_not_statistics,
        ValueError,
        "`dot_general0_lhs` has ['absmax']",
        "variables['quant_stats']",
    ),
    case(
        "nnx bridge: SRQ statistics never calibrated",
        _nnx_srq_uncalibrated,
        ValueError,
        "`layers.dot_general0_lhs`",
        "count 0",
        "call the model",
    ),
]


@pytest.mark.parametrize("call, error, words", CASES)
def test_refused(call, error, words):
    assert_refused(call, error, words)

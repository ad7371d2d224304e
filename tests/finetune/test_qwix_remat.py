"""`remat=False` on a linen or NNX Stack running qwix-quantized weights (QLoRA int8, nf4).

The backward pass of an unrematted scan keeps each layer's dequantized weight (qwix's dot
converts the codes to floats before the matmul); on XLA:CPU the compiled gradient's temp memory
shows it (XLA:TPU fuses the conversion into the dots and holds none). The Stack warns then, once
per call, giving the bytes counted from qwix's ``QArray`` s, and not with the default remat or
float weights."""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from _programs import on_cpu
from flax import nnx, traverse_util

import stackwise
import stackwise.flax
import stackwise.nnx

qwix = pytest.importorskip("qwix")

N, D, R = 4, 256, 2
X = jnp.ones((2, D))
KEY = jax.random.key(0)
DEQUANTIZED = N * (D * D) * 4  # every layer's kernel once dequantized, float32 bytes


def _provider(qtype):
    return qwix.LoraProvider(module_path=".*", rank=R, alpha=2.0, weight_qtype=qtype)


def _linen(qtype, remat, d=D):
    """The LoRA loss of a QLoRA linen Stack and its (LoRA, frozen) params."""
    x = jnp.ones((2, d))
    stack = stackwise.flax.Stack(nn.Dense(d), n=N, remat=remat)
    model = qwix.quantize_model(stack, _provider(qtype))
    flat = traverse_util.flatten_dict(model.init(KEY, x)["params"])
    if qtype is not None:  # the base quantized per layer, as qwix's QLoRA init gives it
        floats = stack.init(KEY, x)["params"]
        abstract = jax.eval_shape(model.init, KEY, x)["params"]
        base = stackwise.flax.quantize_params(floats, abstract)
        flat |= traverse_util.flatten_dict(base)
    lora = {k: v for k, v in flat.items() if "lora" in k[-1]}
    frozen = {k: v for k, v in flat.items() if "lora" not in k[-1]}

    def loss(lora, frozen):
        params = traverse_util.unflatten_dict(lora | frozen)
        return jnp.sum(jnp.sin(model.apply({"params": params}, x)))

    return loss, (lora, frozen), x


def _nnx(qtype, remat, d=D):
    """The LoRA loss of a QLoRA NNX Stack and its (LoRA, rest) states."""
    x = jnp.ones((2, d))
    model = stackwise.nnx.Stack(
        lambda rngs: nnx.Linear(d, d, rngs=rngs), n=N, rngs=nnx.Rngs(0), remat=remat
    )
    with warnings.catch_warnings():  # qwix's first call runs the float weights: no warning
        model = qwix.apply_lora_to_model(model, _provider(qtype), x, rngs=nnx.Rngs(1))
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(lora, rest):
        return jnp.sum(jnp.sin(nnx.merge(graphdef, lora, rest)(x)))

    return loss, (lora, rest), x


FRAMEWORKS = {"linen": _linen, "nnx": _nnx}


def _temp(build, qtype, remat):
    loss, params, _ = build(qtype, remat)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        compiled = jax.jit(jax.grad(loss)).lower(*params).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _remat_warnings(build, qtype, remat, d=8):
    loss, params, _ = build(qtype, remat, d)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.grad(loss)(*params)
    return [str(w.message) for w in caught if "remat=False" in str(w.message)]


@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("qtype", ["int8", "nf4"])
def test_remat_false_with_a_qwix_base_warns_with_the_bytes(framework, qtype):
    build = FRAMEWORKS[framework]
    (message,) = _remat_warnings(build, qtype, False)  # once per Stack call
    held = int(re.search(r"\((\d+) bytes\)", message).group(1))
    assert held == N * 8 * 8 * 4  # each layer's (8, 8) kernel in float32, not its codes
    assert "dequantized weights" in message and "default remat" in message
    assert _remat_warnings(build, qtype, stackwise.DEFAULT_REMAT) == []


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_remat_false_with_float_weights_does_not_warn(framework):
    assert _remat_warnings(FRAMEWORKS[framework], None, False) == []  # plain LoRA


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("qtype", ["int8", "nf4"])
def test_remat_false_holds_every_dequantized_layer(framework, qtype):
    """What the warning is about: without remat the gradient's temp memory grows by about
    every layer's dequantized kernel (qwix's dot materialises it), where the default remat
    holds about one layer's."""
    build = FRAMEWORKS[framework]
    rematted = _temp(build, qtype, stackwise.DEFAULT_REMAT)
    assert rematted < 2 * DEQUANTIZED // N + DEQUANTIZED // 4  # about one layer's, not all
    # What remat=False holds is XLA:CPU's fact: compiled for a v5e (jax 0.10.2), XLA:TPU
    # reports 0 temp bytes for both programs, int8 and nf4 alike: no dequantized kernel held,
    # the dequantization fused into the dots (benchmarks/results/tpu_tier.md).
    if on_cpu():
        assert _temp(build, qtype, False) - rematted >= DEQUANTIZED // 2

"""Host offload of a Stack's carries: ``remat=save_and_offload_only_these_names`` on
``stackwise.CARRY_NAME``, the name the stack gives the carry entering each layer.

The gradients equal the loop's and those of the same policy saving the carries on the
device; the traced program puts each layer's carry in the host's memory space inside the
scan and hands the backward pass the n carries stacked there. On a CPU host and device
memory are one, so the memory it saves shows on an accelerator only: on a TPU (``.ci/tpu``)
the compiler's plan keeps the carries' bytes in host memory, not the device's
(``benchmarks/offload_memory.py`` has the figures, compiled for a v5e).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _programs import put_on_host
from _tolerance import reassociation_bound
from _trees import assert_trees_close

import stackwise

N, D, BATCH = 6, 8, 16

OFFLOAD = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=[stackwise.CARRY_NAME],
    offload_src="device", offload_dst="pinned_host")
SAVE = jax.checkpoint_policies.save_only_these_names(stackwise.CARRY_NAME)


def init(key, d=D):
    return {"w": jax.random.normal(key, (d, d)) / d**0.5}


def apply(p, x):
    return x + jnp.tanh(x @ p["w"])


def grads(remat, params, x, n=N):
    layers = stackwise.stack(init, apply, n, remat=remat)
    return jax.jit(jax.grad(lambda p, x: (layers.apply(p, x) ** 2).sum(), (0, 1)))(params, x)


def loop_grads(params, x):
    def loss(params, x):
        for p in stackwise.unstack_layers(params):
            x = apply(p, x)
        return (x**2).sum()

    return jax.jit(jax.grad(loss, (0, 1)))(params, x)


@pytest.fixture(scope="module")
def inputs():
    params = stackwise.stack(init, apply, N).init(jax.random.key(0))
    return params, jax.random.normal(jax.random.key(1), (BATCH, D))


def test_offloaded_carries_give_the_loops_gradients(inputs):
    got = grads(OFFLOAD, *inputs)
    assert_trees_close(got, loop_grads(*inputs), reassociation_bound(depth=N, width=D,
                                                                     summed=BATCH))
    assert_trees_close(got, grads(SAVE, *inputs), reassociation_bound(depth=N, width=D,
                                                                      summed=BATCH))


def test_each_layers_carry_goes_to_host_memory(inputs):
    def traced(remat):
        layers = stackwise.stack(init, apply, N, remat=remat)
        loss = jax.grad(lambda p, x: (layers.apply(p, x) ** 2).sum(), (0, 1))
        return put_on_host(jax.make_jaxpr(loss)(*inputs).jaxpr)

    moved = traced(OFFLOAD)
    assert ("device_put", (BATCH, D)) in moved  # a layer's carry, inside the scan
    assert ("scan", (N, BATCH, D)) in moved  # the n carries, stacked in host memory
    assert {shape for _, shape in moved} == {(BATCH, D), (N, BATCH, D)}  # nothing else
    assert traced(SAVE) == []  # saved on the device: nothing moves


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="host and device memory are one "
                    "on the CPU; .ci/tpu runs this on the chip")
def test_on_a_tpu_the_carries_leave_the_device_memory():
    """Compiled for a v5e (benchmarks/offload_memory.py, no chip needed), at these sizes: the
    saved carries take 384 MiB of device temp at 'highest' (192 MiB at the default precision,
    where XLA keeps them in bfloat16 for the backward's bfloat16 matmuls); offloaded, the host
    holds the 384 MiB of float32 carries and the device about one layer's (16.5-16.8 MiB)."""
    n, d, batch = 24, 1024, 4096
    params = {"w": jax.ShapeDtypeStruct((n, d, d), jnp.float32)}
    x = jax.ShapeDtypeStruct((batch, d), jnp.float32)
    memory = {}
    for name, remat in {"save": SAVE, "offload": OFFLOAD}.items():
        layers = stackwise.stack(init, apply, n, remat=remat)
        step = jax.jit(jax.grad(lambda p, x, layers=layers: layers.apply(p, x).sum()))
        memory[name] = step.lower(params, x).compile().memory_analysis()
    carries, one_layer = n * batch * d * 4, batch * d * 4
    assert memory["save"].host_temp_size_in_bytes == 0
    assert memory["save"].temp_size_in_bytes >= carries / 2  # on the device, bfloat16 at least
    assert memory["offload"].host_temp_size_in_bytes == carries
    assert memory["offload"].temp_size_in_bytes <= 2 * one_layer  # about one layer's in flight

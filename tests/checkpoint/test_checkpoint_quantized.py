"""Quantizing while loading (``load_checkpoint(..., quantize=)``): the same bits as
``stackwise.quant.quantize`` of the float load, from safetensors (torch's transposed layout,
a cast, a tensor stored stacked), orbax and a dict, for each kind, per channel and in blocks,
with a pattern; and the float model never whole in memory, measured as the peak resident
memory of a process that loads 128 MiB of float weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise

N, E, F = 4, 16, 8  # layers, model width, hidden width


def _checkpoint(folder=None, dtype=np.float32):
    """Torch-layout tensors (``(out, in)``) per layer, norms, an embedding and a stacked
    tensor, as a dict (``folder`` None) or saved as one safetensors file there."""
    rng = np.random.default_rng(0)
    arrays = {f"model.layers.{i}.mlp.up_proj.weight": rng.normal(size=(F, E)).astype(dtype)
              for i in range(N)}
    arrays |= {f"model.layers.{i}.mlp.down_proj.weight":
               (rng.normal(size=(E, F)) * (i + 1)).astype(dtype) for i in range(N)}
    arrays |= {f"model.layers.{i}.input_layernorm.weight": rng.normal(size=E).astype(dtype)
               for i in range(N)}
    arrays["model.embed_tokens.weight"] = rng.normal(size=(32, E)).astype(dtype)
    arrays["stacked.gate"] = rng.normal(size=(N, E, F)).astype(dtype)
    if folder is None:
        return arrays
    from safetensors.numpy import save_file

    save_file(arrays, os.path.join(folder, "model.safetensors"))
    return folder


def _target(dtype=jnp.float32):
    return {"blocks": {"up": jax.ShapeDtypeStruct((N, E, F), dtype),
                       "down": jax.ShapeDtypeStruct((N, F, E), dtype),
                       "gate": jax.ShapeDtypeStruct((N, E, F), dtype),
                       "norm": jax.ShapeDtypeStruct((N, E), dtype)},
            "embed": jax.ShapeDtypeStruct((32, E), dtype)}


def _names(cast=None):
    t = lambda name: stackwise.Tensor(name, transpose=(1, 0), dtype=cast)  # noqa: E731
    return {"blocks": {"up": t("model.layers.{}.mlp.up_proj.weight"),
                       "down": t("model.layers.{}.mlp.down_proj.weight"),
                       "gate": stackwise.Tensor("stacked.gate", dtype=cast),
                       "norm": stackwise.Tensor("model.layers.{}.input_layernorm.weight",
                                                dtype=cast)},
            "embed": stackwise.Tensor("model.embed_tokens.weight", dtype=cast)}


def assert_bitwise(got, want):
    is_q = stackwise.quant.Quantized.__instancecheck__
    assert jax.tree.structure(got, is_leaf=is_q) == jax.tree.structure(want, is_leaf=is_q)
    for g, w in zip(jax.tree.leaves(got, is_leaf=is_q), jax.tree.leaves(want, is_leaf=is_q)):
        if isinstance(w, stackwise.quant.Quantized):
            assert (g.kind, g.dtype, g.rows) == (w.kind, w.dtype, w.rows)
            g, w = (g.codes, g.scale), (w.codes, w.scale)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", stackwise.quant.KINDS)
@pytest.mark.parametrize("block", [None, 4])
def test_quantizing_while_loading_is_quantizing_the_load(kind, block, tmp_path):
    pytest.importorskip("safetensors")
    source = _checkpoint(str(tmp_path))
    scheme = stackwise.quant.Scheme(kind, block_size=block)
    got = stackwise.load_checkpoint(source, _target(), _names(), quantize=scheme)
    floats = stackwise.load_checkpoint(source, _target(), _names())
    assert_bitwise(got, stackwise.quant.quantize(floats, kind, block_size=block))
    # The default targets: the three weights 2-D per layer; norms and embedding as loaded.
    kinds = {k: type(v).__name__ for k, v in got["blocks"].items()}
    assert kinds == {"up": "Quantized", "down": "Quantized", "gate": "Quantized",
                     "norm": "ArrayImpl"}
    assert got["blocks"]["down"].scale.shape == (N, F // (block or F), E)


@pytest.mark.parametrize("source", ["dict", "orbax"])
def test_other_readers_and_chosen_targets(source, tmp_path):
    arrays = _checkpoint()
    if source == "orbax":
        pytest.importorskip("orbax.checkpoint")
        floats = stackwise.load_checkpoint(arrays, _target(), _names())
        stackwise.save_orbax(floats, _names(), tmp_path / "ckpt")
        arrays = str(tmp_path / "ckpt")
    pick = ["['blocks']['down']", "['blocks']['gate']"]
    for targets in (pick, lambda path, shape: path in pick):
        scheme = stackwise.quant.Scheme("nf4", targets, 2)
        got = stackwise.load_checkpoint(arrays, _target(), _names(), quantize=scheme)
        floats = stackwise.load_checkpoint(arrays, _target(), _names())
        assert_bitwise(got, stackwise.quant.quantize(floats, "nf4", pick, block_size=2))
        assert not isinstance(got["blocks"]["up"], stackwise.quant.Quantized)


def test_a_cast_and_a_pattern(tmp_path):
    """bfloat16 weights cast from float32 as they load, then quantized; a pattern of two
    positions, each position's rows its own layers."""
    arrays = _checkpoint()
    target = {"blocks": {"up": jax.ShapeDtypeStruct((N, E, F), jnp.bfloat16)}}
    names = {"blocks": {"up": _names(jnp.bfloat16)["blocks"]["up"]}}
    got = stackwise.load_checkpoint(arrays, target, names, quantize="int4")
    want = stackwise.quant.quantize(stackwise.load_checkpoint(arrays, target, names), "int4")
    assert_bitwise(got, want)
    assert got["blocks"]["up"].dtype == "bfloat16"
    position = lambda p: stackwise.Tensor(  # noqa: E731
        "model.layers.{}.mlp.down_proj.weight", transpose=(1, 0), position=p)
    target = [{"w": jax.ShapeDtypeStruct((N // 2, F, E), jnp.float32)}] * 2
    names = [{"w": position(0)}, {"w": position(1)}]
    got = stackwise.load_checkpoint(arrays, target, names, pattern=2, quantize="int8")
    floats = stackwise.load_checkpoint(arrays, target, names, pattern=2)
    assert_bitwise(got, stackwise.quant.quantize(floats, "int8"))
    # Position 1's row 1 is layer 3, quantized alone.
    alone = stackwise.quant.quantize(
        {"w": arrays["model.layers.3.mlp.down_proj.weight"].T[None]}, "int8")["w"]
    np.testing.assert_array_equal(got[1]["w"].codes[1], alone.codes[0])
    np.testing.assert_array_equal(got[1]["w"].scale[1], alone.scale[0])


def test_a_non_finite_weight_is_refused_as_quantize_refuses_it():
    """A NaN in layer 2 of `down`: quantizing it as it loads is refused as quantizing the float
    load is (the same leaf, layer and words); loading it as floats, the way the message gives,
    quantizes the rest bitwise as `quantize` does and keeps the NaN where it was."""
    arrays = _checkpoint()
    arrays["model.layers.2.mlp.down_proj.weight"][5, 1] = np.nan
    arrays["model.layers.1.input_layernorm.weight"][0] = np.inf  # not a target: as loaded
    floats = stackwise.load_checkpoint(arrays, _target(), _names())
    with pytest.raises(ValueError) as after:
        stackwise.quant.quantize(floats, "nf4")
    with pytest.raises(ValueError) as loading:
        stackwise.load_checkpoint(arrays, _target(), _names(), quantize="nf4")
    said = [str(e.value).split(": ", 1)[1].split("; ")[0] for e in (after, loading)]
    assert said[0] == said[1] == "target leaf ['blocks']['down'] holds NaN or inf (layers [2])"
    pick = ["['blocks']['up']", "['blocks']['gate']"]
    got = stackwise.load_checkpoint(arrays, _target(), _names(),
                                    quantize=stackwise.quant.Scheme("nf4", pick))
    assert_bitwise(got, stackwise.quant.quantize(floats, "nf4", pick))
    assert np.isnan(got["blocks"]["down"][2, 1, 5]) and np.isinf(got["blocks"]["norm"][1, 0])


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(kind=st.sampled_from(stackwise.quant.KINDS), n=st.integers(1, 4),
       blocks=st.integers(1, 3), block=st.sampled_from([1, 3, 4]), out=st.integers(1, 6),
       dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**16))
def test_while_loading_is_after_loading_over_shapes(kind, n, blocks, block, out, dtype, seed):
    rows = blocks * block
    rng = np.random.default_rng(seed)
    arrays = {f"l.{i}.w": (rng.normal(size=(out, rows)) * rng.uniform(0.1, 10)).astype(dtype)
              for i in range(n)}
    target = {"w": jax.ShapeDtypeStruct((n, rows, out), dtype)}
    names = {"w": stackwise.Tensor("l.{}.w", transpose=(1, 0))}
    got = stackwise.load_checkpoint(arrays, target, names,
                                    quantize=stackwise.quant.Scheme(kind, block_size=block))
    floats = stackwise.load_checkpoint(arrays, target, names)
    assert_bitwise(got, stackwise.quant.quantize(floats, kind, block_size=block))


def test_the_loaded_base_runs_in_a_qlora_stack():
    arrays = _checkpoint()
    target = {"up": jax.ShapeDtypeStruct((N, E, F), jnp.float32),
              "down": jax.ShapeDtypeStruct((N, F, E), jnp.float32)}
    names = {k: v for k, v in _names()["blocks"].items() if k in target}
    base = stackwise.load_checkpoint(arrays, target, names,
                                     quantize=stackwise.quant.Scheme("nf4", block_size=4))
    layer = lambda p, x: x + jnp.tanh(x @ p["up"]) @ p["down"]  # noqa: E731
    x = jnp.ones((2, E))
    y = stackwise.lora.stack(layer, N).apply(base, x)
    floats = stackwise.quant.dequantize(base)
    ref = x
    for i in range(N):
        ref = layer(jax.tree.map(lambda v, i=i: v[i], floats), ref)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# Memory: the peak resident set of a process that loads 128 MiB of float32 weights.

_LAYERS, _WIDTH = 32, 1024  # 32 layers of 1024 x 1024 float32: 4 MiB each, 128 MiB in all

_MEASURE = r"""
import json, sys
import jax, jax.numpy as jnp
import stackwise

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

folder, small, kind, mode, n, d = sys.argv[1:7]
names = {"w": stackwise.Tensor("layers.{}.w", transpose=(1, 0))}
abstract = lambda n: {"w": jax.ShapeDtypeStruct((int(n), int(d), int(d)), jnp.float32)}
# Both ways once on a one-layer checkpoint first: what is measured is loading, not compiling.
floats = stackwise.load_checkpoint(small, abstract(1), names)
jax.block_until_ready(stackwise.quant.quantize(floats, kind))
del floats
jax.block_until_ready(stackwise.load_checkpoint(small, abstract(1), names, quantize=kind))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set (VmHWM) starts again from the current one
base = kib("VmRSS:")
if mode == "while":
    out = stackwise.load_checkpoint(folder, abstract(n), names, quantize=kind)
else:
    out = stackwise.quant.quantize(stackwise.load_checkpoint(folder, abstract(n), names), kind)
jax.block_until_ready(out)
final = sum(v.nbytes for v in jax.tree.leaves(out))
print(json.dumps({"peak": (kib("VmHWM:") - base) * 1024, "final": final}))
"""


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident set")
    rng = np.random.default_rng(0)
    folders = []
    for n in (_LAYERS, 1):
        folder = tmp_path_factory.mktemp(f"layers{n}")
        save_file({f"layers.{i}.w": rng.normal(size=(_WIDTH, _WIDTH)).astype(np.float32)
                   for i in range(n)}, str(folder / "model.safetensors"))
        folders.append(str(folder))
    return folders


def _peak(weights, kind, mode) -> dict:
    # glibc's malloc keeps freed blocks of a size it has seen freed (its mmap threshold
    # grows); a fixed threshold returns every large block when freed, so that the resident
    # set counts live memory, not the allocator's cache.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *weights, kind, mode,
                           str(_LAYERS), str(_WIDTH)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_the_float_model_never_sits_whole_in_memory(weights, kind):
    """Quantizing while loading peaks at the quantized weights plus a few layers' floats; the
    float load quantized after peaks above the whole float model. On the machine of this
    change (peak / final, MiB): int8 46.4 / 32.1 while loading, 175.6 / 32.1 after; nf4
    29.4 / 16.1 and 189.0 / 16.1 (a layer is 4 MiB, the float model 128 MiB)."""
    floats = _LAYERS * _WIDTH * _WIDTH * 4
    streamed = _peak(weights, kind, "while")
    assert streamed["final"] < floats / 3
    assert streamed["peak"] - streamed["final"] < floats / 4, (streamed, floats)
    whole = _peak(weights, kind, "after")
    assert whole["final"] == streamed["final"]
    assert whole["peak"] > floats, (whole, floats)  # the measurement sees the float model

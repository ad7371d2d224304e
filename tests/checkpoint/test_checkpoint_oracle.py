"""The checkpoint oracle: random trees, names and transforms, saved and loaded back.

Hypothesis draws a checkpoint in its stored form first (each layer's tensor, random bits of
a random dtype and shape; zero-padded or plain layer numbers; a pattern or none), and the
leaves it becomes through NumPy's own transpose and reshape (what ``Tensor`` says). Then:
``save_safetensors`` (and, in the slow tier, ``save_orbax``) of the leaves writes exactly
the stored tensors, bitwise, and nothing else; ``load_checkpoint`` reads the leaves back,
bitwise. A drawn mistake (a transpose that is not a permutation, two leaves under one name,
a stored shape of another size, a PRNG key) is a TypeError or ValueError naming the leaf,
and nothing is written at all: no folder, no claim, no staging. Briefly in the fast tier,
longer in the slow one. Its finds are named tests in test_checkpoint_save.py (per-layer
scalars, signalling NaNs)."""

from __future__ import annotations

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tiers import examples
from _trees import assert_trees_bitwise
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stackwise
from stackwise import Tensor

pytest.importorskip("safetensors")

DTYPES = ["float32", "bfloat16", "float16", "int32", "uint8", "int8", "int16"]  # (x64 off)
MISTAKES = ["transpose", "duplicate", "stored_shape", "key"]


@st.composite
def leaf_specs(draw, per_layer: bool):
    """(stored per-layer shape, dtype, transpose, reshape) of one leaf."""
    stored = tuple(draw(st.lists(st.integers(1, 3), max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["none", "transpose", "reshape"]))
    perm = tuple(draw(st.permutations(range(len(stored))))) if kind != "none" else None
    reshape = None
    if kind == "reshape":
        size = int(np.prod(stored))
        reshape = draw(st.sampled_from([(size,), (-1,), (1, -1), (size, 1), (-1, 1)]))
    return stored, dtype, perm, reshape


@st.composite
def cases(draw):
    k = draw(st.sampled_from([None, 1, 2, 3]))
    rows = draw(st.integers(1, 3))
    layer = draw(st.sampled_from(["{}", "{:02d}", "{:03d}"]))
    stacked = [draw(leaf_specs(True)) for _ in range(draw(st.integers(1, 2)))]
    whole = [draw(leaf_specs(False)) for _ in range(draw(st.integers(1, 2)))]
    mistake = draw(st.sampled_from([None] * 4 + MISTAKES))
    max_file_bytes = draw(st.sampled_from([1, 64, 1 << 20]))
    seed = draw(st.integers(0, 2**31 - 1))
    return k, rows, layer, stacked, whole, mistake, max_file_bytes, seed


def _tensor(rng, shape, dtype):
    """Random bits of ``dtype`` (NaNs and all: a round trip must keep every bit)."""
    dtype = np.dtype(getattr(jnp, dtype))
    raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def _leaf_of(stored, perm, reshape):
    """NumPy's reading of the Tensor: the stored tensor transposed, then reshaped."""
    x = stored.transpose(perm) if perm is not None else stored
    return x.reshape(reshape) if reshape is not None else x


def _build(case):
    """The stored tensors by name, and the params, names and pattern that save them."""
    k, rows, layer, stacked, whole, mistake, max_file_bytes, seed = case
    rng = np.random.default_rng(seed)
    positions = k or 1
    stored, blocks, block_names = {}, [{} for _ in range(positions)], [{} for _ in
                                                                      range(positions)]
    for i, (shape, dtype, perm, reshape) in enumerate(stacked):
        for p in range(positions):
            template = f"b.{layer}.leaf{i}"
            layers = [p + j * positions for j in range(rows)]
            for ell in layers:
                stored[template.format(ell)] = _tensor(rng, shape, dtype)
            blocks[p][f"leaf{i}"] = jnp.asarray(np.stack(
                [_leaf_of(stored[template.format(ell)], perm, reshape) for ell in layers]))
            block_names[p][f"leaf{i}"] = Tensor(
                template, transpose=perm, reshape=reshape,
                stored_shape=shape if reshape is not None else None,
                position=p if k is not None else None)
    other, other_names = {}, {}
    for i, (shape, dtype, perm, reshape) in enumerate(whole):
        stored[f"o.{i}"] = _tensor(rng, shape, dtype)
        other[f"o{i}"] = jnp.asarray(_leaf_of(stored[f"o.{i}"], perm, reshape))
        other_names[f"o{i}"] = Tensor(f"o.{i}", transpose=perm, reshape=reshape,
                                      stored_shape=shape if reshape is not None else None)
    params = {"blocks": tuple(blocks) if k is not None else blocks[0], "other": other}
    names = {"blocks": tuple(block_names) if k is not None else block_names[0],
             "other": other_names}
    return stored, params, names


def _add_mistake(mistake, params, names):
    """The mistake drawn, made in ``other``; the leaf paths the error must name."""
    o0, spec = params["other"]["o0"], names["other"]["o0"]
    if mistake == "transpose":  # one axis too many
        names["other"]["o0"] = Tensor("o.0", transpose=tuple(range(o0.ndim + 1))[::-1])
        return ["['other']['o0']", "transpose="]
    if mistake == "duplicate":
        params["other"]["dup"], names["other"]["dup"] = o0, spec
        return ["['other']['o0']", "['other']['dup']", "'o.0'"]
    if mistake == "stored_shape":  # twice the elements
        names["other"]["o0"] = Tensor("o.0", reshape=(-1,), stored_shape=(o0.size, 2))
        return ["['other']['o0']", "stored_shape"]
    params["other"]["key"], names["other"]["key"] = jax.random.key(0), "key"
    return ["['other']['key']", "PRNG key", "jax.random.key_data"]


def _save(saver, params, names, out, k, max_bytes):
    if saver == "orbax":
        return stackwise.save_orbax(params, names, out, pattern=k, max_group_bytes=max_bytes)
    written = stackwise.save_safetensors(params, names, out, pattern=k,
                                         max_file_bytes=max_bytes)
    assert sorted(os.listdir(out)) == sorted(os.path.basename(p) for p in written)
    return out


def _check(case, saver="safetensors"):
    k, mistake, max_bytes = case[0], case[5], case[6]
    stored, params, names = _build(case)
    root = tempfile.mkdtemp()
    out = os.path.join(root, "out")
    if mistake is not None:
        parts = _add_mistake(mistake, params, names)
        with pytest.raises((TypeError, ValueError)) as info:
            _save(saver, params, names, out, k, max_bytes)
        for part in parts:
            assert part in str(info.value), (part, str(info.value))
        assert os.listdir(root) == []  # nothing written at all
        return
    ckpt = stackwise.open_checkpoint(_save(saver, params, names, out, k, max_bytes))
    assert os.listdir(root) == ["out"]
    assert sorted(ckpt.tensors) == sorted(stored)
    for name, want in stored.items():
        got = ckpt.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name
    target = jax.eval_shape(lambda: params)
    assert_trees_bitwise(stackwise.load_checkpoint(out, target, names, pattern=k), params)


@settings(max_examples=examples(12, 4), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_save_then_load_is_bitwise_or_a_named_error(case):
    _check(case)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_save_then_load_is_bitwise_or_a_named_error_longer(case):
    _check(case)


@pytest.mark.slow  # orbax's saves, ~0.3 s each
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_save_orbax_then_load_is_bitwise_or_a_named_error(case):
    pytest.importorskip("orbax.checkpoint")
    _check(case, "orbax")

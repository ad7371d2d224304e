"""Where load_checkpoint puts each leaf, and how it fills one device's leaf: one Sharding given
for every leaf is every leaf's; a tree of them mirrors the target (one for a subtree is every
leaf's below it; None is the leaf's own sharding, else the first device); and a leaf's layers
are filled in pieces by two threads, bitwise the plain loop's stack of the stored tensors,
transposed and cast, whatever the shapes, permutation and piece size (hypothesis), and on
one CPU device the filled host array is the device's buffer, not a copy. The
sharded layouts (FSDP, tensor parallel, the layer axis over stages) are in
test_checkpoint_sharded.py, on 8 devices."""

from __future__ import annotations

import os
import tempfile

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import stackwise
from stackwise._checkpoint import load

pytest.importorskip("safetensors")

CKPT = {f"l.{i}.w": np.arange(8, dtype=np.float32).reshape(4, 2) + i for i in range(3)}
CKPT |= {f"l.{i}.b": np.full(2, i, np.float32) for i in range(3)}
CKPT["embed"] = np.arange(10, dtype=np.float32).reshape(5, 2)
TARGET = {"blocks": {"w": jax.ShapeDtypeStruct((3, 2, 4), jnp.float32),
                     "b": jax.ShapeDtypeStruct((3, 2), jnp.float32)},
          "embed": jax.ShapeDtypeStruct((5, 2), jnp.float32)}
NAMES = {"blocks": {"w": stackwise.Tensor("l.{}.w", transpose=(1, 0)), "b": "l.{}.b"},
         "embed": "embed"}
WANT = {"blocks": {"w": np.stack([CKPT[f"l.{i}.w"].T for i in range(3)]),
                   "b": np.stack([CKPT[f"l.{i}.b"] for i in range(3)])},
        "embed": CKPT["embed"]}


def _check(params, shardings):
    for path, a in jax.tree_util.tree_leaves_with_path(params):
        want = WANT
        for k in path:
            want = want[k.key]
        assert np.array_equal(np.asarray(a), want), jax.tree_util.keystr(path)
        assert a.sharding == shardings[jax.tree_util.keystr(path)], jax.tree_util.keystr(path)


def test_one_sharding_is_every_leafs():
    replicated = NamedSharding(jax.make_mesh((1,), ("data",)), P())
    params = stackwise.load_checkpoint(CKPT, TARGET, NAMES, shardings=replicated)
    _check(params, dict.fromkeys(["['blocks']['w']", "['blocks']['b']", "['embed']"],
                                 replicated))


def test_a_tree_of_shardings_mirrors_the_target():
    mesh = jax.make_mesh((1,), ("data",))
    split, first = NamedSharding(mesh, P(None, "data")), SingleDeviceSharding(jax.devices()[0])
    # One for a subtree is every leaf's below it; None keeps the leaf's own, else the first
    # device.
    own = NamedSharding(mesh, P("data"))
    target = {**TARGET, "embed": jax.ShapeDtypeStruct((5, 2), jnp.float32, sharding=own)}
    params = stackwise.load_checkpoint(CKPT, target, NAMES,
                                       shardings={"blocks": split, "embed": None})
    _check(params, {"['blocks']['w']": split, "['blocks']['b']": split, "['embed']": own})
    params = stackwise.load_checkpoint(
        CKPT, TARGET, NAMES, shardings={"blocks": {"w": split, "b": None}, "embed": None})
    _check(params, {"['blocks']['w']": split, "['blocks']['b']": first, "['embed']": first})


@st.composite
def _layers(draw):
    """A per-layer tensor's stored shape, a permutation of its axes, a depth, a dtype to cast
    to (or none), and the size of the pieces its layers are filled in."""
    rank = draw(st.integers(1, 3))
    stored = tuple(draw(st.lists(st.integers(1, 9), min_size=rank, max_size=rank)))
    perm = tuple(draw(st.permutations(range(rank)))) if rank > 1 and draw(st.booleans()) else None
    depth = draw(st.integers(1, 4))
    cast = draw(st.sampled_from([None, np.float16]))
    piece = draw(st.sampled_from([1, 4, 12, 64, 1 << 20]))
    layers = [draw(hnp.arrays(np.float32, stored, elements=st.floats(-4, 4, width=32)))
              for _ in range(depth)]
    return stored, perm, cast, piece, layers


@settings(max_examples=25, deadline=None)
@given(case=_layers())
def test_pieces_fill_one_device_as_the_loop_stacks(case, monkeypatch_module):
    """Every layer split into pieces of ``piece`` bytes along the stored tensor's first axis,
    filled by two threads (also tensors far under ``_PARALLEL_BYTES``): bitwise the loop's
    ``np.stack`` of each stored tensor, transposed and cast."""
    from safetensors.numpy import save_file

    stored, perm, cast, piece, layers = case
    monkeypatch_module.setattr(load, "_PIECE_BYTES", piece)
    monkeypatch_module.setattr(load, "_PARALLEL_BYTES", 0)
    monkeypatch_module.setattr(load, "_THREADS", 2)
    monkeypatch_module.setattr(os, "cpu_count", lambda: 2)
    with tempfile.TemporaryDirectory() as folder:
        save_file({f"l.{i}.w": a for i, a in enumerate(layers)},
                  os.path.join(folder, "model.safetensors"))
        want = np.stack([(a.transpose(perm) if perm else a).astype(cast or np.float32)
                         for a in layers])
        target = {"w": jax.ShapeDtypeStruct(want.shape, want.dtype)}
        names = {"w": stackwise.Tensor("l.{}.w", transpose=perm, dtype=cast)}
        got = stackwise.load_checkpoint(folder, target, names)["w"]
    assert got.dtype == want.dtype and np.array_equal(np.asarray(got), want)


def test_pieces_split_one_shards_layer_for_both_threads():
    """One shard (one device) of a 10-row layer in 4-row pieces: three pieces, the rows of
    the stored tensor in runs, every other one to each thread; a layer under a piece, and a
    scalar layer, whole."""
    outs = [np.empty((2, 3, 10), np.float32)]
    rows, indices = [range(2)], [(slice(0, 2), slice(None), slice(None))]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(load, "_PIECE_BYTES", 3 * 4 * 4)
        pieces = load._pieces(outs, rows, indices, 1, 1, 2)
        assert [p[1] for p in pieces] == [(slice(None), slice(0, 3)), (slice(None), slice(3, 6)),
                                          (slice(None), slice(6, 10))]
        assert all(np.shares_memory(p[0], outs[0][1]) for p in pieces)
        m.setattr(load, "_PIECE_BYTES", 1 << 20)  # one piece would leave a thread idle: two
        assert len(load._pieces(outs, rows, indices, 1, 1, 2)) == 2
        assert len(load._pieces(outs, rows, indices, 1, None, 2)) == 1  # not split
        scalars = [np.empty((2,), np.float32)]
        assert len(load._pieces(scalars, rows, [(slice(0, 2),)], 0, 0, 2)) == 1


def test_one_device_takes_the_filled_host_array_without_a_copy(tmp_path, monkeypatch):
    """The default placement (no shardings): the leaf's host array, filled in pieces by two
    threads, is the device's buffer as it is (the host holds the model once)."""
    from safetensors.numpy import save_file

    save_file({f"l.{i}.w": np.full((64, 32), i, np.float32) for i in range(3)},
              tmp_path / "model.safetensors")
    made, host = [], load._host
    monkeypatch.setattr(load, "_host", lambda shape, dtype: made.append(host(shape, dtype))
                        or made[-1])
    monkeypatch.setattr(load, "_PIECE_BYTES", 1024)
    monkeypatch.setattr(load, "_PARALLEL_BYTES", 0)
    w = stackwise.load_checkpoint(tmp_path, {"w": jax.ShapeDtypeStruct((3, 32, 64), jnp.float32)},
                                  {"w": stackwise.Tensor("l.{}.w", transpose=(1, 0))})["w"]
    assert np.array_equal(np.asarray(w), np.stack([np.full((32, 64), i) for i in range(3)]))
    assert w.addressable_shards[0].data.unsafe_buffer_pointer() == made[0].ctypes.data


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m

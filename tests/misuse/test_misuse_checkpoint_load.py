"""The misuse catalogue of ``load_checkpoint``'s placements: ``shardings`` is read against the
target as strictly as ``names``. A PartitionSpec or a Mesh alone, a value that is no Sharding,
a misspelt key (named with the closest the target has), an entry under a leaf, a tree that
misses a leaf: each refused before a byte is read, naming what came, what is accepted (one
Sharding for every leaf, or a tree like the target's of Shardings or None) and the fix
(``NamedSharding(mesh, spec)``, ``stackwise.stacked_shardings``). None is silently ignored,
which on a pod would put the whole model on one chip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _misuse import assert_refused, case
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stackwise

MESH = jax.make_mesh((1,), ("data",))
CKPT = {f"model.layers.{i}.w": np.full((4, 2), i, np.float32) for i in range(3)}
CKPT["embed"] = np.ones((5, 2), np.float32)
TARGET = {"blocks": {"w": jax.ShapeDtypeStruct((3, 2, 4), jnp.float32)},
          "embed": jax.ShapeDtypeStruct((5, 2), jnp.float32)}
NAMES = {"blocks": {"w": stackwise.Tensor("model.layers.{}.w", transpose=(1, 0))},
         "embed": "embed"}
SPLIT = NamedSharding(MESH, P(None, "data"))


def _load(shardings):
    return lambda: stackwise.load_checkpoint(CKPT, TARGET, NAMES, shardings=shardings)


ACCEPTED = ["one Sharding for every leaf", "a tree like the target's", "stacked_shardings"]

CASES = [
    case("a PartitionSpec alone", _load(P(None, "data")), TypeError,
         "`shardings` is the PartitionSpec P(None, 'data')", "not over which devices",
         "NamedSharding(mesh, P(None, 'data')) for every leaf", "a tree like the target's",
         "stacked_shardings"),
    case("a Mesh alone", _load(MESH), TypeError,
         "`shardings` is a Mesh {'data': 1}", "not how to split each leaf",
         "NamedSharding(mesh, P())", "a tree like the target's", "stacked_shardings"),
    case("a str alone", _load("data"), TypeError,
         "`shardings` is str 'data'", "not a jax.sharding.Sharding", *ACCEPTED[1:],
         "NamedSharding(mesh, spec)"),
    case("a misspelt key at the top", _load({"blcks": {"w": SPLIT}, "embed": None}), ValueError,
         "`shardings` has an entry at blcks", "no key 'blcks' under the top",
         "did you mean 'blocks'?", "Fix the key"),
    case("a misspelt key inside", _load({"blocks": {"ww": SPLIT}, "embed": None}), ValueError,
         "`shardings` has an entry at blocks/ww", "no key 'ww' under blocks",
         "did you mean 'w'?"),
    case("a key far from any", _load({"blocks": {"w": SPLIT}, "embed": None, "zzz": None}),
         ValueError, "entry at zzz", "it has ['blocks', 'embed']"),
    case("an entry under a leaf", _load({"blocks": {"w": {"kernel": SPLIT}}, "embed": None}),
         ValueError, "entry at blocks/w/kernel", "a leaf at blocks/w, not a subtree"),
    case("a tree that misses a leaf", _load({"blocks": {"w": SPLIT}}), ValueError,
         "no entry for the target's leaf ['embed']", "one device unasked", "Sharding or None",
         "a tree like the target's"),
    case("a PartitionSpec as a leaf's sharding", _load({"blocks": {"w": P(None, "data")},
                                                       "embed": None}), TypeError,
         "leaf ['blocks']['w']", "is a PartitionSpec, not a jax.sharding.Sharding",
         "NamedSharding(mesh, P(None, 'data')) gives it its mesh"),
    case("a Mesh for a subtree", _load({"blocks": MESH, "embed": None}), TypeError,
         "leaf ['blocks']['w']", "Mesh, not a jax.sharding.Sharding", "NamedSharding(mesh, spec)"),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", CASES)
def test_misuse(call, error, words):
    assert_refused(call, error, words)


def test_a_refused_placement_reads_nothing():
    """Refused before a byte is read: the checks run on the names, shapes and placements."""
    reads = []
    ckpt = stackwise.open_checkpoint(CKPT)
    counted = stackwise.Checkpoint(ckpt.kind, ckpt.where, ckpt.tensors, {},
                                   lambda n, i: reads.append(n) or ckpt.view(n, i))
    with pytest.raises(ValueError, match="no entry for the target's leaf"):
        stackwise.load_checkpoint(counted, TARGET, NAMES, shardings={"blocks": {"w": SPLIT}})
    assert reads == []

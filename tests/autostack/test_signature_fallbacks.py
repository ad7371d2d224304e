"""autostack's fallbacks, each reached: the signatures of values that have no key of their own
(`stackwise/_autostack/signature.py`: two equal ones still match, two different ones never do,
and nothing raises while a loop is compared), and the words for a structure that cannot be
rebuilt from placeholders (`api._structure_difference`)."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp

from stackwise._autostack import signature
from stackwise._autostack.signature import Signatures


def _atom(sharding):
    return SimpleNamespace(aval=SimpleNamespace(shape=(2, 3), dtype="float32", weak_type=False,
                                                sharding=sharding))


def test_an_unhashable_sharding_is_keyed_by_its_repr():
    a, b, c = _atom(["data", None]), _atom(["data", None]), _atom(["model", None])
    assert signature._aval(a) == signature._aval(b) == ((2, 3), "float32", False,
                                                         "['data', None]")
    assert signature._aval(a) != signature._aval(c)
    hash(signature._aval(a))  # (a key of the interning dict)


def test_a_deleted_array_is_keyed_by_identity_not_by_its_bytes():
    x, y = jnp.ones(3), jnp.ones(3)
    assert signature._fingerprint(x) == signature._fingerprint(y)  # equal bytes: alike
    x.delete()  # (donated, say: its bytes cannot be read)
    assert signature._fingerprint(x) == ("object", id(x))
    assert signature._fingerprint(x) != signature._fingerprint(y)


def test_an_unhashable_param_is_keyed_by_its_repr():
    signatures = Signatures()
    assert signatures._norm({1, 2}) == ("repr", "{1, 2}") == signatures._norm({2, 1})
    assert signatures._norm({1, 3}) != signatures._norm({1, 2})
    assert signatures._norm((1, [2, 3])) == (1, (2, 3))  # (containers: element by element)


def test_a_closure_whose_cell_is_not_yet_filled_is_keyed_with_none_there():
    def outer():
        def block():
            return later

        before = Signatures().function(block)  # `later` not yet assigned: an empty cell
        later = 1
        return before, Signatures().function(block)

    before, after = outer()
    assert before[0] == after[0] == "function"
    assert before[-1] == (("later", ("NoneType", None)),)
    assert after[-1] == (("later", ("int", 1)),)


def test_a_structure_that_cannot_be_rebuilt_from_placeholders_is_named_whole():
    import jax

    from stackwise._autostack import api

    @jax.tree_util.register_pytree_node_class
    class Strict:  # (a node whose unflatten checks its leaves: ints are refused)
        def __init__(self, w):
            if not hasattr(w, "shape"):
                raise TypeError("Strict holds arrays only")
            self.w = w

        def tree_flatten(self):
            return (self.w,), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    got = jax.tree.structure({"a": Strict(jnp.ones(2))})
    want = jax.tree.structure({"a": Strict(jnp.ones(2)), "b": 0})
    said = api._structure_difference(got, want)
    assert said == f"it has the structure {got}, but `fn` was traced with {want}"
    # (a structure that rebuilds: the leaves one lacks, by path)
    plain = api._structure_difference(jax.tree.structure({"a": 0}),
                                      jax.tree.structure({"a": 0, "b": 0}))
    assert "lacks 1 leaves" in plain and "['b']" in plain

"""autostack's signatures of values that have no key of their own
(`stackwise/_autostack/signature.py`): each fallback keys such a value so that two equal ones
still match and two different ones never do, and never raises while a loop is compared."""

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

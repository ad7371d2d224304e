"""The misuse catalogue of LoRA dropout (PEFT's ``lora_dropout``): ``stackwise.lora.init(...,
dropout=)``, ``attach(..., key=)``, ``combine(..., key=)``, and the adapters with a rate
trained without a key. One row per bad call, the error it must raise and the words its
message must hold (the argument or leaf, what was expected and what came, the fix)."""

from __future__ import annotations

from unittest import mock

import haiku as hk
import jax
import jax.numpy as jnp
import pytest
from _misuse import assert_refused, case

import stackwise
import stackwise.haiku
from stackwise._upstream import jax as jax_ties

KEY = jax.random.key(0)
BASE = {"w": jnp.ones((3, 4, 4))}
DROP = stackwise.lora.init(KEY, BASE, rank=2, dropout=0.1)
X = jnp.ones((2, 4))
attach = stackwise.lora.attach


def _init(**kw):
    return lambda: stackwise.lora.init(KEY, BASE, rank=2, **kw)


def _grad(apply, params_of, x=X, **options):
    """The adapters' gradient through ``stackwise.lora.stack(apply, 3)``."""
    layers = stackwise.lora.stack(apply, 3, **options)
    return lambda: jax.grad(lambda ad: jnp.sum(layers.apply(params_of(ad), x)))(DROP)


def _keyed(apply, **options):
    return _grad(apply, lambda ad: attach(BASE, ad, key=KEY), **options)


def _combined_without_a_key():
    trainable, frozen = stackwise.lora.split(attach(BASE, DROP, key=KEY))
    layers = stackwise.lora.stack(lambda p, x: x @ p["w"], 3)
    jax.grad(lambda t: jnp.sum(layers.apply(stackwise.lora.combine(t, frozen), X)))(trainable)


def _haiku_without_a_key():
    forward = hk.transform(lambda x: stackwise.haiku.Stack(lambda x: hk.Linear(4)(x), n=3)(x))
    params = forward.init(KEY, X)
    adapters = stackwise.lora.init(KEY, params, rank=2, dropout=0.2)
    trainable, frozen = stackwise.lora.split(attach(params, adapters, per_leaf=True))
    jax.grad(lambda t: jnp.sum(forward.apply(stackwise.lora.combine(t, frozen), None, X)))(
        trainable)


def _batch_without_a_key():
    batch = stackwise.lora.stack_adapters([DROP, DROP])
    layers = stackwise.lora.stack(lambda p, x: x @ p["w"], 3)
    jax.grad(lambda b: jnp.sum(layers.apply(attach(BASE, b), jnp.ones((2, 2, 4)))))(batch)


def _rows_without_a_key():
    batch = stackwise.lora.stack_adapters([DROP, DROP])
    layers = stackwise.lora.stack(lambda p, x: x @ p["w"], 3)
    jax.grad(lambda b: jnp.sum(layers.apply(attach(BASE, b, rows=[0, -1]), X)))(batch)


def _two_rates():
    other = stackwise.lora.init(KEY, BASE, rank=2, dropout=0.2)
    stackwise.lora.stack_adapters([DROP, other])


def _save_two_rates(tmp_path):
    two = {"u": BASE["w"], "v": BASE["w"]}
    adapters = {"u": stackwise.lora.init(KEY, two, rank=2, dropout=0.1)["u"],
                "v": stackwise.lora.init(KEY, two, rank=2, dropout=0.2)["v"]}
    stackwise.lora.save_peft(tmp_path / "a", adapters, {"['u']": "mlp.up_proj",
                                                        "['v']": "mlp.down_proj"})


def _jax_changed():
    with mock.patch.object(jax_ties, "holds", lambda tie: False):
        stackwise.lora.stack(lambda p, x: x @ p["w"], 3).apply(attach(BASE, DROP, key=KEY), X)


CASES = [
    case("init: a dropout of 1", _init(dropout=1.0), ValueError, "`dropout` is 1.0", "[0, 1)",
         "would never train"),
    case("init: a negative dropout", _init(dropout=-0.1), ValueError, "`dropout` is -0.1",
         "[0, 1)"),
    case("init: a NaN dropout", _init(dropout=float("nan")), ValueError, "`dropout` is nan"),
    case("init: a dropout as a string", _init(dropout="0.1"), TypeError,
         "`dropout` must be a number in [0, 1)", "str '0.1'"),
    case("init: a dropout as a bool", _init(dropout=True), TypeError,
         "`dropout` must be a number", "bool True"),
    case("attach: an int seed as the key", lambda: attach(BASE, DROP, key=0), TypeError,
         "`key` must be one PRNG key", "jax.random.key(seed)"),
    case("attach: a batch of keys", lambda: attach(BASE, DROP, key=jax.random.split(KEY, 3)),
         TypeError, "`key` must be one PRNG key", "a batch of keys of shape (3,)"),
    case("attach: a key with rows", lambda: attach(
        BASE, stackwise.lora.stack_adapters([DROP, DROP]), rows=[0, 1], key=KEY), ValueError,
         "`key`", "`rows`", "['w'] has dropout 0.1", "attach(base, adapters, key=key)"),
    case("combine: an int seed as the key", lambda: stackwise.lora.combine(
        *stackwise.lora.split(attach(BASE, DROP)), key=1), TypeError,
         "stackwise.lora.combine", "`key` must be one PRNG key"),
    case("training without a key", _grad(lambda p, x: x @ p["w"], lambda ad: attach(BASE, ad)),
         ValueError, "['w'] has dropout 0.1", "without a dropout key",
         "attach(base, adapters, key=step_key)", "dropout=0.0"),
    case("training through combine without a key", _combined_without_a_key, ValueError,
         "['w'] has dropout 0.1", "combine(trainable, frozen, key=step_key)"),
    case("training a Haiku Stack without a key", _haiku_without_a_key, ValueError,
         "stackwise.haiku.Stack", "adapter at ['linear']['w'] has dropout 0.2",
         "without a dropout key"),
    case("training a batch of adapters without a key", _batch_without_a_key, ValueError,
         "['w'] has dropout 0.1", "without a dropout key"),
    case("training multi-LoRA rows without a key", _rows_without_a_key, ValueError,
         "['w'] has dropout 0.1", "without a dropout key"),
    case("a weight that drops used elementwise",
         _keyed(lambda p, x: x * p["w"].sum(0)[None]), ValueError, "['w']",
         "only in matrix products", "`reduce_sum`", "dropout=0.0"),
    case("a weight that drops returned",
         _keyed(lambda p, x: (x, p["w"]), has_aux=True), ValueError, "['w']", "returns it"),
    case("a weight that drops times itself", _keyed(lambda p, x: x @ (p["w"] @ p["w"])),
         ValueError, "['w']", "multiplies it by itself"),
    case("a weight that drops inside a custom derivative",
         _keyed(lambda p, x: x @ jax.nn.relu(p["w"])), ValueError, "['w']",
         "`custom_jvp_call`"),
    case("a batch of adapters with two rates", _two_rates, ValueError, "structure or alpha",
         "dropout"),
    case("jax changed under the dropout's jaxpr evaluation", _jax_changed, RuntimeError,
         "LoRA dropout evaluates the layer's jaxpr", "`dropout` 0"),
]


@pytest.mark.every_case
@pytest.mark.parametrize(("call", "error", "words"), CASES)
def test_misuse(call, error, words):
    assert_refused(call, error, words)


def test_save_peft_with_adapters_of_two_rates(tmp_path):
    assert_refused(lambda: _save_two_rates(tmp_path), ValueError,
                   ("dropout rates [0.1, 0.2]", "one `lora_dropout`", "lora_dropout=p"))

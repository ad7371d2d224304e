"""The contract every adapter meets (adapters/README.md), one test per property.

Each framework has a small harness below that builds the same two blocks (a
residual dense layer and a gate) and a KV-cache attention layer in its own
idiom, a Stack of them, and the reference: a Python loop of separately built
blocks given per-layer slices of the stack's params. Every property is then one
test parametrised over the frameworks and the same option matrix.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import jax
import jax.numpy as jnp
import pytest
from _programs import (
    assert_aliases_exactly,
    assert_no_copy_per_layer,
    barrier_operand_types,
    nbytes,
    on_cpu,
    put_on_host,
)
from _trees import assert_trees_close

import stackwise
from stackwise._kit import OPTION_NAMES
from stackwise.bench import program_fingerprint

D, B, T = 4, 2, 1024  # width, batch, cache length (long: see the decode test)
X = jnp.linspace(-1.0, 1.0, B * D).reshape(B, D)
KEY = jax.random.key(0)


# --------------------------------------------------------------------------
# Harnesses: one per framework, the same interface.


def counting(block, calls):
    """A subclass of the module class ``block`` that records each call (each trace)."""

    class Counted(block):
        def __call__(self, x):
            calls.append(1)
            return super().__call__(x)

    return Counted


class Haiku:
    name = "haiku"

    def __init__(self):
        import haiku as hk

        import stackwise.haiku

        self.hk, self.sw = hk, stackwise.haiku

        class Dense(hk.Module):
            def __call__(self, x, scale=1.0):
                return x + scale * jnp.tanh(hk.Linear(D)(x))

        class Gate(hk.Module):
            def __call__(self, x, scale=1.0):
                s = hk.get_parameter("s", (1, D), init=hk.initializers.RandomNormal())
                return x * jax.nn.sigmoid(s * scale)

        class Attend(hk.Module):
            def __call__(self, x, pos):
                k = hk.get_state("k", (B, T, D), init=jnp.zeros)
                v = hk.get_state("v", (B, T, D), init=jnp.zeros)
                y, k, v = attend(hk.Linear(3 * D, name="qkv")(x), k, v, pos)
                hk.set_state("k", k)
                hk.set_state("v", v)
                return x + hk.Linear(D, name="out")(y)

        self.kinds = {"dense": Dense, "gate": Gate}
        self.attend = Attend

    def stack(self, kinds, n, **options):
        hk, sw = self.hk, self.sw
        blocks = [self.kinds[c] for c in kinds]
        block = blocks if len(blocks) > 1 else blocks[0]
        f = hk.transform(lambda x, *a: sw.Stack(block, n, **options)(x, *a))
        params = f.init(KEY, X)
        return params, lambda params, x, *a: f.apply(params, None, x, *a)

    def loop(self, kinds, n, params):
        """Layer i's block built alone, applied with layer i's slice of the params."""
        hk, k = self.hk, len(kinds)
        names = _haiku_position_names(kinds)
        steps = []
        for i in range(n):
            p, j = i % k, i // k
            prefix = f"stack/{names[p]}"
            base = self.kinds[kinds[p]].__name__.lower()
            layer = {
                base + key[len(prefix) :]: jax.tree.map(lambda a, j=j: a[j], v)
                for key, v in params.items()
                if key == prefix or key.startswith(prefix + "/")
            }
            block = hk.transform(lambda x, *a, c=kinds[p]: self.kinds[c]()(x, *a))
            steps.append(functools.partial(block.apply, layer, None))
        return steps

    def layer_index(self):
        return self.sw.layer_index()

    def tool(self, n):
        """``hk.layer_stack`` of the dense block: params and a pure apply."""
        hk, Dense = self.hk, self.kinds["dense"]
        f = hk.transform(lambda x: hk.layer_stack(n)(lambda x: Dense()(x))(x))
        return f.init(KEY, X), lambda p, x: f.apply(p, None, x)

    def counted(self, calls, n):
        hk, sw = self.hk, self.sw
        Counted = counting(self.kinds["dense"], calls)
        f = hk.transform(lambda x: sw.Stack(Counted, n)(x))
        params = f.init(KEY, X)
        calls.clear()  # count the traces of the jitted gradient only, as for the others
        return lambda: jax.jit(jax.grad(lambda p: jnp.sum(f.apply(p, None, X)))).lower(params)

    def decode(self, n, pattern=1, **options):
        hk, sw = self.hk, self.sw
        block = [self.attend] * pattern if pattern > 1 else self.attend
        f = hk.transform_with_state(lambda x, pos: sw.Stack(block, n, **options)(x, pos))
        params, cache = f.init(KEY, X[:, None], jnp.int32(0))
        cache = jax.tree.map(jnp.zeros_like, cache)

        def step(params, cache, x, pos):
            return f.apply(params, cache, None, x, pos)

        one = hk.transform_with_state(lambda x, pos: self.attend()(x, pos))
        names = _haiku_position_names(["attend"] * pattern)

        def layer(tree, i):
            prefix, j = f"stack/{names[i % pattern]}", i // pattern
            return {
                "attend" + k[len(prefix) :]: jax.tree.map(lambda a: a[j], v)
                for k, v in tree.items()
                if k == prefix or k.startswith(prefix + "/")
            }

        layers = [
            (functools.partial(one.apply, layer(params, i)), layer(cache, i)) for i in range(n)
        ]

        def loop_step(caches, x, pos, reverse=False):
            new = list(caches)
            for i in reversed(range(n)) if reverse else range(n):
                x, new[i] = layers[i][0](caches[i], None, x, pos)
            return x, new

        return params, cache, step, [c for _, c in layers], loop_step


def _haiku_position_names(kinds):
    """How Haiku names k modules built in order: ``dense``, ``gate``, ``dense_1``."""
    seen, names = {}, []
    for c in kinds:
        base = c
        names.append(base if base not in seen else f"{base}_{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return names


class Linen:
    name = "flax"

    def __init__(self):
        import flax.linen as nn

        import stackwise.flax

        self.nn, self.sw = nn, stackwise.flax

        class Dense(nn.Module):
            @nn.compact
            def __call__(self, x, scale=1.0):
                return x + scale * jnp.tanh(nn.Dense(D)(x))

        class Gate(nn.Module):
            @nn.compact
            def __call__(self, x, scale=1.0):
                s = self.param("s", nn.initializers.normal(1.0), (1, D))
                return x * jax.nn.sigmoid(s * scale)

        class Attend(nn.Module):
            @nn.compact
            def __call__(self, x, pos):
                k = self.variable("cache", "k", jnp.zeros, (B, T, D))
                v = self.variable("cache", "v", jnp.zeros, (B, T, D))
                y, k.value, v.value = attend(nn.Dense(3 * D)(x), k.value, v.value, pos)
                return x + nn.Dense(D)(y)

        self.kinds = {"dense": Dense, "gate": Gate}
        self.attend = Attend

    def stack(self, kinds, n, **options):
        blocks = [self.kinds[c] for c in kinds]
        model = self.sw.Stack(blocks if len(blocks) > 1 else blocks[0], n, **options)
        params = model.init(KEY, X)["params"]
        return params, lambda params, x, *a: model.apply({"params": params}, x, *a)

    def loop(self, kinds, n, params):
        k = len(kinds)
        names = [f"{cls}_{j}" for cls, j in _linen_names([self.kinds[c] for c in kinds])]
        steps = []
        for i in range(n):
            p, j = i % k, i // k
            tree = params[names[p]] if k > 1 else params
            layer = jax.tree.map(lambda a, j=j: a[j], tree)
            block = self.kinds[kinds[p]]()
            steps.append(
                lambda x, *a, block=block, layer=layer: block.apply({"params": layer}, x, *a)
            )
        return steps

    def layer_index(self):
        return self.sw.layer_index()

    def tool(self, n):
        """``nn.scan`` of the dense block: params and a pure apply."""
        nn, Dense = self.nn, self.kinds["dense"]

        class Scanned(Dense):
            def __call__(self, x):
                return super().__call__(x), None

        scan = nn.scan(Scanned, variable_axes={True: 0}, split_rngs={"params": True}, length=n)()
        params = scan.init(KEY, X)["params"]
        return params, lambda p, x: scan.apply({"params": p}, x)[0]

    def counted(self, calls, n):
        Counted = counting(self.kinds["dense"], calls)
        model = self.sw.Stack(Counted, n)
        params = model.init(KEY, X)
        calls.clear()
        return lambda: jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, X)))).lower(params)

    def decode(self, n, pattern=1, **options):
        block = [self.attend] * pattern if pattern > 1 else self.attend
        model = self.sw.Stack(block, n, **options)
        variables = model.init(KEY, X[:, None], jnp.int32(0))
        params, cache = variables["params"], jax.tree.map(jnp.zeros_like, variables["cache"])

        def step(params, cache, x, pos):
            y, new = model.apply({"params": params, "cache": cache}, x, pos, mutable="cache")
            return y, new["cache"]

        one = self.attend()

        def layer(tree, i):
            sub = tree[f"Attend_{i % pattern}"] if pattern > 1 else tree
            return jax.tree.map(lambda a: a[i // pattern], sub)

        layers = [(layer(params, i), layer(cache, i)) for i in range(n)]

        def loop_step(caches, x, pos, reverse=False):
            new = list(caches)
            for i in reversed(range(n)) if reverse else range(n):
                variables = {"params": layers[i][0], "cache": caches[i]}
                x, upd = one.apply(variables, x, pos, mutable="cache")
                new[i] = upd["cache"]
            return x, new

        return params, cache, step, [c for _, c in layers], loop_step


def _linen_names(classes):
    seen = {}
    for cls in classes:
        j = seen.get(cls.__name__, 0)
        seen[cls.__name__] = j + 1
        yield cls.__name__, j


class NNX:
    name = "nnx"

    def __init__(self):
        from flax import nnx

        import stackwise.nnx

        self.nnx, self.sw = nnx, stackwise.nnx

        class Dense(nnx.Module):
            def __init__(self, rngs):
                self.linear = nnx.Linear(D, D, rngs=rngs)

            def __call__(self, x, scale=1.0):
                return x + scale * jnp.tanh(self.linear(x))

        class Gate(nnx.Module):
            def __init__(self, rngs):
                self.s = nnx.Param(jax.random.normal(rngs.params(), (1, D)))

            def __call__(self, x, scale=1.0):
                return x * jax.nn.sigmoid(self.s[...] * scale)

        class Attend(nnx.Module):
            def __init__(self, rngs):
                self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
                self.out = nnx.Linear(D, D, rngs=rngs)
                self.k = nnx.Cache(jnp.zeros((B, T, D)))
                self.v = nnx.Cache(jnp.zeros((B, T, D)))

            def __call__(self, x, pos):
                y, self.k[...], self.v[...] = attend(self.qkv(x), self.k[...], self.v[...], pos)
                return x + self.out(y)

        self.kinds = {"dense": Dense, "gate": Gate}
        self.attend = Attend

    def stack(self, kinds, n, **options):
        nnx = self.nnx
        makers = [self.kinds[c] for c in kinds]
        model = self.sw.Stack(
            makers if len(makers) > 1 else makers[0], n, rngs=nnx.Rngs(0), **options
        )
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def apply(params, x, *a):
            return nnx.merge(graphdef, params, rest, copy=True)(x, *a)

        self._model = model
        return params, apply

    def loop(self, kinds, n, params):
        nnx, k = self.nnx, len(kinds)
        blocks = list(self._model.layers) if k > 1 else [self._model.layers]
        steps = []
        for i in range(n):
            p, j = i % k, i // k
            graphdef, _, rest = nnx.split(blocks[p], nnx.Param, ...)
            tree = params["layers"][p] if k > 1 else params["layers"]
            layer = jax.tree.map(lambda a, j=j: a[j], (tree, rest))
            steps.append(
                lambda x, *a, g=graphdef, layer=layer: nnx.merge(g, *layer, copy=True)(x, *a)
            )
        return steps

    def layer_index(self):
        return self.sw.layer_index()

    def tool(self, n):
        """``nnx.vmap`` to create and ``nnx.scan`` to apply, as in the Flax docs."""
        nnx, Dense = self.nnx, self.kinds["dense"]

        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Dense(rngs)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def scan(x, block):
            return block(x)

        graphdef, params, rest = nnx.split(create(nnx.Rngs(0)), nnx.Param, ...)
        return params, lambda p, x: scan(x, nnx.merge(graphdef, p, rest, copy=True))

    def counted(self, calls, n):
        nnx, Counted = self.nnx, counting(self.kinds["dense"], calls)
        model = self.sw.Stack(Counted, n, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        calls.clear()

        def loss(p):
            return jnp.sum(nnx.merge(graphdef, p, rest, copy=True)(X))

        return lambda: jax.jit(jax.grad(loss)).lower(params)

    def decode(self, n, pattern=1, **options):
        nnx = self.nnx
        block = [self.attend] * pattern if pattern > 1 else self.attend
        model = self.sw.Stack(block, n, rngs=nnx.Rngs(0), **options)
        graphdef, params, cache = nnx.split(model, nnx.Param, ...)

        def step(params, cache, x, pos):
            m = nnx.merge(graphdef, params, cache, copy=True)
            y = m(x, pos)
            return y, nnx.state(m, nnx.Cache)

        blocks = model.to_layers()
        layers = [nnx.split(b, nnx.Param, ...) for b in blocks]

        def loop_step(caches, x, pos, reverse=False):
            new = list(caches)
            for i in reversed(range(n)) if reverse else range(n):
                g, p, _ = layers[i]
                m = nnx.merge(g, p, caches[i], copy=True)
                x = m(x, pos)
                new[i] = nnx.state(m, nnx.Cache)
            return x, new

        return params, cache, step, [c for _, _, c in layers], loop_step


class Equinox:
    name = "equinox"

    def __init__(self):
        import equinox as eqx

        import stackwise.equinox

        self.eqx, self.sw = eqx, stackwise.equinox

        def rows(linear, x):
            """An eqx.nn.Linear (which acts on one vector) on every row of ``x``."""
            for _ in range(x.ndim - 1):
                linear = jax.vmap(linear)
            return linear(x)

        class Dense(eqx.Module):
            linear: eqx.nn.Linear

            def __init__(self, key):
                self.linear = eqx.nn.Linear(D, D, key=key)

            def __call__(self, x, scale=1.0):
                return x + scale * jnp.tanh(rows(self.linear, x))

        class Gate(eqx.Module):
            s: jax.Array

            def __init__(self, key):
                self.s = jax.random.normal(key, (1, D))

            def __call__(self, x, scale=1.0):
                return x * jax.nn.sigmoid(self.s * scale)

        class Attend(eqx.Module):
            qkv: eqx.nn.Linear
            out: eqx.nn.Linear
            k: eqx.nn.StateIndex
            v: eqx.nn.StateIndex

            def __init__(self, key):
                k1, k2 = jax.random.split(key)
                self.qkv = eqx.nn.Linear(D, 3 * D, key=k1)
                self.out = eqx.nn.Linear(D, D, key=k2)
                self.k = eqx.nn.StateIndex(jnp.zeros((B, T, D)))
                self.v = eqx.nn.StateIndex(jnp.zeros((B, T, D)))

            def __call__(self, x, state, pos):
                qkv = rows(self.qkv, x)
                y, k, v = attend(qkv, state.get(self.k), state.get(self.v), pos)
                return x + rows(self.out, y), state.set(self.k, k).set(self.v, v)

        self.kinds = {"dense": Dense, "gate": Gate}
        self.attend = Attend

    def _split(self, stack):
        """A Stack as ``(params, apply)``: its layers' arrays, and a pure apply of them."""
        eqx = self.eqx
        params, static = eqx.partition(stack.layers, eqx.is_array)

        def apply(params, x, *a):
            layers = eqx.combine(params, static)
            return eqx.tree_at(lambda s: s.layers, stack, layers)(x, *a)

        return params, apply

    def stack(self, kinds, n, **options):
        blocks = [self.kinds[c] for c in kinds]
        block = blocks if len(blocks) > 1 else blocks[0]
        return self._split(self.sw.Stack(block, n, key=KEY, **options))

    def loop(self, kinds, n, params):
        """Layer i's block built alone, holding layer i's slice of the arrays."""
        eqx, k = self.eqx, len(kinds)
        steps = []
        for i in range(n):
            p, j = i % k, i // k
            stacked = params[p] if k > 1 else params
            layer = jax.tree.map(lambda a, j=j: a[j], stacked)
            _, static = eqx.partition(self.kinds[kinds[p]](KEY), eqx.is_array)
            steps.append(eqx.combine(layer, static))
        return steps

    def layer_index(self):
        return self.sw.layer_index()

    def tool(self, n):
        """What Equinox users write: ``eqx.filter_vmap`` to create, ``lax.scan`` to apply."""
        eqx, Dense = self.eqx, self.kinds["dense"]
        layers = eqx.filter_vmap(Dense)(jax.random.split(KEY, n))
        params, static = eqx.partition(layers, eqx.is_array)

        def apply(params, x):
            def body(x, layer):
                return eqx.combine(layer, static)(x), None

            return jax.lax.scan(body, x, params)[0]

        return params, apply

    def counted(self, calls, n):
        Counted = counting(self.kinds["dense"], calls)
        params, apply = self._split(self.sw.Stack(Counted, n, key=KEY))
        calls.clear()
        return lambda: jax.jit(jax.grad(lambda p: jnp.sum(apply(p, X)))).lower(params)

    def decode(self, n, pattern=1, **options):
        """The cache in an ``eqx.nn.State``, as Equinox keeps state: ``x, state =
        stack(x, state, pos)``; the loop's blocks and States from ``stack.to_layers``."""
        eqx = self.eqx
        block = [self.attend] * pattern if pattern > 1 else self.attend
        stack, cache = eqx.nn.make_with_state(self.sw.Stack)(block, n, key=KEY, **options)
        params, apply = self._split(stack)
        blocks, caches = stack.to_layers(cache)

        def step(params, cache, x, pos):
            return apply(params, x, cache, pos)

        def loop_step(caches, x, pos, reverse=False):
            new = list(caches)
            for i in reversed(range(n)) if reverse else range(n):
                x, new[i] = blocks[i](x, caches[i], pos)
            return x, new

        return params, cache, step, caches, loop_step


def attend(qkv, k_cache, v_cache, pos):
    """Writes this step's keys/values at ``pos`` and attends to the positions seen."""
    q, k, v = jnp.split(qkv, 3, -1)  # [B, L, D]
    k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k, pos, 1)
    v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v, pos, 1)
    scores = jnp.einsum("bqd,bkd->bqk", q, k_cache) / D**0.5
    seen = jnp.arange(T)[None, :] <= (pos + jnp.arange(q.shape[1]))[:, None]
    scores = jnp.where(seen[None], scores, -1e30)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, -1), v_cache), k_cache, v_cache


FRAMEWORKS = {"haiku": Haiku, "flax": Linen, "nnx": NNX, "equinox": Equinox}


@pytest.fixture(params=list(FRAMEWORKS), scope="module")
def fw(request):
    module = {"haiku": "haiku", "flax": "flax.linen", "nnx": "flax.nnx", "equinox": "equinox"}
    pytest.importorskip(module[request.param])
    return FRAMEWORKS[request.param]()


# --------------------------------------------------------------------------
# The properties.

CASES = {
    "default": (["dense"], 3, {}),
    "no-remat-reverse-python-loop": (
        ["dense"],
        4,
        {"remat": False, "reverse": True, "unroll": True},
    ),
    "full-remat-unroll-2": (["dense"], 5, {"remat": True, "unroll": 2}),
    "nested": (["dense"], 6, {"nested": True}),
    "pattern-2": (["dense", "gate"], 5, {}),
    "pattern-3-reverse-remat": (["dense", "dense", "gate"], 7, {"reverse": True, "remat": True}),
    "pattern-2-nested-python-loop": (["gate", "dense"], 6, {"nested": 2, "unroll": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_grads_match_a_loop_of_blocks(fw, case):
    kinds, n, options = CASES[case]
    params, apply = fw.stack(kinds, n, **options)
    steps = fw.loop(kinds, n, params)
    order = list(reversed(range(n))) if options.get("reverse") else list(range(n))

    def loop(x, scale):
        for i in order:
            x = steps[i](x, scale)
        return x

    scale = jnp.float32(0.7)
    assert_trees_close(jax.jit(apply)(params, X, scale), loop(X, scale))
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(apply(p, x, scale))), (0, 1)))(params, X)
    # The loop's gradient w.r.t. its per-layer slices, stacked back, is the Stack's.
    gx = jax.grad(lambda x: jnp.sum(jnp.sin(loop(x, scale))))(X)
    assert_trees_close(grads[1], gx)
    g_params = _loop_param_grads(fw, kinds, n, params, order, scale)
    assert_trees_close(grads[0], g_params)


def _loop_param_grads(fw, kinds, n, params, order, scale):
    """d loss / d params through the loop, by perturbing the stacked params' slices."""

    def loss(params):
        steps = fw.loop(kinds, n, params)
        x = X
        for i in order:
            x = steps[i](x, scale)
        return jnp.sum(jnp.sin(x))

    return jax.grad(loss)(params)


def test_per_layer_inputs_reach_each_layer_of_a_pattern(fw):
    kinds, n = ["dense", "gate", "dense"], 5
    params, apply = fw.stack(kinds, n)
    steps = fw.loop(kinds, n, params)
    scales = jnp.linspace(0.5, 1.5, n)
    x = X
    for i in range(n):
        x = steps[i](x, scales[i])
    assert_trees_close(jax.jit(apply)(params, X, stackwise.per_layer(scales)), x)


def test_the_block_is_traced_a_bounded_number_of_times(fw):
    for n in (3, 24):
        calls = []
        fw.counted(calls, n)()
        assert 1 <= len(calls) <= 2, f"n={n}: traced {len(calls)} times"


def test_layer_index_outside_a_stack_is_a_runtime_error(fw):
    with pytest.raises(
        RuntimeError, match=rf"stackwise\.{fw.name}\.layer_index\(\) was called outside a block"
    ):
        fw.layer_index()


def test_remat_puts_no_params_through_barriers(fw):
    def lowered(**options):
        params, apply = fw.stack(["dense", "gate"], 4, remat=True, **options)
        return jax.jit(jax.grad(lambda p: jnp.sum(apply(p, X) ** 2))).lower(params).as_text()

    types = barrier_operand_types(lowered(unroll=True))
    assert types, "remat=True with unroll=True protects the carry with barriers"
    assert set(types) == {f"{B}x{D}xf32"}, types  # the carry only, never a param
    # Inside a scan no barrier is needed at all, nested or not.
    assert "optimization_barrier" not in lowered()
    assert "optimization_barrier" not in lowered(nested=True)


def test_a_policy_offloads_each_layers_carry_to_host_memory(fw):
    """``stackwise.CARRY_NAME`` names the carry in every adapter's Stack, so a policy that
    offloads it by name moves each layer's input to host memory (tests/core/test_offload.py
    checks the gradients; on the CPU the offload changes nothing but the memory space)."""
    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[stackwise.CARRY_NAME],
        offload_src="device", offload_dst="pinned_host")
    params, apply = fw.stack(["dense"], 3, remat=offload)
    loss = jax.grad(lambda p: jnp.sum(apply(p, X) ** 2))
    assert set(put_on_host(jax.make_jaxpr(loss)(params).jaxpr)) == {
        ("device_put", (B, D)), ("scan", (3, B, D))}
    _, plain = fw.stack(["dense"], 3, remat=False)
    assert_trees_close(jax.jit(loss)(params), jax.grad(lambda p: jnp.sum(plain(p, X) ** 2))(params))


def test_without_remat_it_compiles_to_the_frameworks_own_tool(fw):
    """With remat off, jit(grad) of a Stack is the tool's program up to names (what the
    benchmark's step-time parity with hk.layer_stack / nn.scan / nnx.scan / the
    hand-written eqx.filter_vmap + lax.scan rests on)."""

    def program(params, apply):
        loss = lambda p, x: jnp.sum(apply(p, x) ** 2)  # noqa: E731
        return program_fingerprint(jax.jit(jax.grad(loss)).lower(params, X).compile().as_text())

    stack = program(*fw.stack(["dense"], 3, remat=False))
    assert stack == program(*fw.tool(3))
    assert stack != program(*fw.stack(["dense"], 3, remat=True))


def test_fsdp_off_a_mesh_changes_nothing_but_the_remat(fw):
    params, apply = fw.stack(["dense", "gate"], 5, remat=False)
    _, apply_fsdp = fw.stack(["dense", "gate"], 5, remat=False, fsdp="data")
    assert_trees_close(apply_fsdp(params, X), apply(params, X))
    grad = lambda f: jax.grad(lambda p: jnp.sum(f(p, X) ** 2))(params)  # noqa: E731
    assert_trees_close(grad(apply_fsdp), grad(apply))


@pytest.mark.parametrize(
    "options",
    [{}, {"remat": False, "reverse": True}, {"pattern": 2}, {"unroll": True, "pattern": 2}],
    ids=["default", "reverse", "pattern", "unroll=True"],
)
def test_decoding_with_a_stacked_cache_matches_the_loop(fw, options):
    n = 3
    params, cache, step, caches, loop_step = fw.decode(n, **options)
    reverse = options.get("reverse", False)
    step = jax.jit(step, donate_argnums=1)
    prompt = jax.random.normal(jax.random.key(1), (B, 4, D))
    y, cache = step(params, cache, prompt, jnp.int32(0))
    y_loop, caches = loop_step(caches, prompt, jnp.int32(0), reverse)
    assert_trees_close(y, y_loop)
    x = y[:, -1:]
    for pos in range(4, 9):
        y, cache = step(params, cache, x, jnp.int32(pos))
        y_loop, caches = loop_step(caches, x, jnp.int32(pos), reverse)
        assert_trees_close(y, y_loop)
        x = jnp.tanh(y)
    k = options.get("pattern", 1)
    expected = [stackwise.stack_layers(caches[p::k]) for p in range(k)]
    assert_trees_close(jax.tree.leaves(cache), jax.tree.leaves(expected))


@pytest.mark.parametrize("n, unroll", [(24, 1), (12, True)], ids=["scan", "unroll=True"])
def test_the_compiled_decode_step_updates_the_donated_cache_in_place(fw, n, unroll):
    """Scanned or (``unroll=True``, the decode that runs at the loop's speed on a TPU: each
    layer writes its row of the stacked cache) as a loop: no copy of the cache either way."""

    def program(n):
        params, cache, step, _, _ = fw.decode(n, unroll=unroll)
        x = jax.ShapeDtypeStruct((B, 1, D), jnp.float32)
        step = jax.jit(step, donate_argnums=1)
        return step.lower(params, cache, x, jnp.int32(3)).compile(), jax.tree.leaves(cache)

    compiled, leaves = program(n)
    assert_aliases_exactly(compiled, leaves)  # the new cache is the donated buffer
    assert (" while(" in compiled.as_text()) == (unroll is not True)
    shallow, shallow_leaves = program(n // 2)
    assert_no_copy_per_layer(shallow, compiled, shallow_leaves, leaves)  # and never copied
    if on_cpu():  # XLA:CPU's bytes are the arrays' own (tests/_programs.py)
        memory = compiled.memory_analysis()
        assert memory.alias_size_in_bytes >= nbytes(leaves)
        assert memory.temp_size_in_bytes <= 0.1 * nbytes(leaves)


def test_importing_the_adapter_module_gives_its_public_names(fw):
    module = importlib.import_module(f"stackwise.{fw.name}")
    assert {"Stack", "layer_index"} <= set(module.__all__)


def test_every_framework_serves_with_the_cores_verb_pair_of_one_shape(fw):
    """`to_serving` / `from_serving` in every adapter: what holds the params, then `path`
    (positional), any further option keyword-only, as the core's."""
    module = importlib.import_module(f"stackwise.{fw.name}")
    for verb in ("to_serving", "from_serving"):
        for f in (getattr(stackwise, verb), getattr(module, verb)):
            parameters = list(inspect.signature(f).parameters.values())
            assert parameters[1].name == "path", (verb, fw.name)
            kinds = [p.kind for p in parameters]
            assert kinds[:2] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 2, (verb, fw.name)
            assert set(kinds[2:]) <= {inspect.Parameter.KEYWORD_ONLY}, (verb, fw.name)


def test_each_stack_takes_the_cores_options_with_their_types_and_defaults(fw):
    # Each Stack spells the core's options in its own signature (linen: its fields), so that
    # help() and type checkers show them; written there again, they must not drift.
    def options(f):
        parameters = inspect.signature(f).parameters
        return {k: (str(parameters[k].annotation), parameters[k].default) for k in OPTION_NAMES}

    stack = importlib.import_module(f"stackwise.{fw.name}").Stack
    assert options(stack if fw.name == "flax" else stack.__init__) == options(stackwise.stack)

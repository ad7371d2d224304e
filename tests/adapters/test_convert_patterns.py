"""A plain loop of blocks <-> a pattern Stack, in every framework, exact or refused.

A Gemma-3-like model, 2 local : 1 global (k=3) over n=7 layers (not a multiple of k): the
local block is sliding-window attention with a learned per-head temperature (a parameter the
global block lacks), the global block full attention with an MLP; state in some kinds only
(Haiku: a running mean in the local blocks; linen: BatchNorm statistics in the global ones;
NNX: BatchNorm in the local ones). `convert` and the name-based verbs move the loop's
params and state into the pattern Stack and back bitwise, equal to the core's
`stack_layers(..., pattern=k)` of the loop's layers; the converted Stack's outputs, state
and gradients equal the loop's. A loop whose layer i is not of position i % k's kind, a depth
that is not the Stack's, and a dtype that differs between layers are refused, naming the layer.
"""

from __future__ import annotations

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import pytest
from _trees import assert_trees_bitwise, assert_trees_close
from flax import nnx

import stackwise
import stackwise.flax as swf
import stackwise.haiku as swh
import stackwise.nnx as swn

D, HEADS, WINDOW = 8, 2, 3
B, T = 2, 6
N, K = 7, 3
PATTERN = ["local", "local", "global"]
SCALE = 0.5 * D**-0.5  # attention weights: activations stay O(1) over the 7 layers
X = jax.random.normal(jax.random.key(1), (B, T, D))


def attend(x, qkv, out, window=None, temp=None):
    """Causal self-attention (x [batch, length, D]); `window` keys back at most."""
    b, t, _ = x.shape
    q, k, v = (a.reshape(b, t, HEADS, D // HEADS) for a in jnp.split(x @ qkv, 3, -1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (D // HEADS) ** 0.5
    if temp is not None:
        scores = scores * temp[None, :, None, None]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    seen = (j <= i) if window is None else (j <= i) & (i - j < window)
    scores = jnp.where(seen[None, None], scores, -1e30)
    y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, t, D)
    return x + y @ out


def loss(y):
    return jnp.sum(jnp.sin(y))


def sequence(kinds, n=N):
    return [kinds[i % len(kinds)] for i in range(n)]


# --------------------------------------------------------------------------
# The model in each framework, behind one interface: loop(seq) and port(kinds, n) build the
# models; init, convert, from_loop/to_loop (by name), per_layer (the loop's layers, read by
# name: the reference), positions (a stacked tree's k positions) and run (outputs, new
# state, grads).


class HaikuCase:
    id = "haiku"

    def __init__(self):
        w = hk.initializers.RandomNormal(SCALE)
        t = hk.initializers.RandomNormal(0.1, 1.0)

        class Local(hk.Module):
            def __call__(self, x):
                qkv = hk.get_parameter("qkv", (D, 3 * D), init=w)
                out = hk.get_parameter("out", (D, D), init=w)
                temp = hk.get_parameter("temp", (HEADS,), init=t)
                mean = hk.get_state("mean", (D,), init=jnp.zeros)
                hk.set_state("mean", 0.9 * mean + 0.1 * x.mean((0, 1)))
                return attend(x, qkv, out, WINDOW, temp)

        class Global(hk.Module):
            def __call__(self, x):
                qkv = hk.get_parameter("qkv", (D, 3 * D), init=w)
                out = hk.get_parameter("out", (D, D), init=w)
                x = attend(x, qkv, out)
                return x + hk.Linear(D)(jax.nn.gelu(hk.Linear(2 * D)(x)))

        class Ffn(hk.Module):  # variables only in modules of its own: hk.Linear
            def __call__(self, x):
                return x + hk.Linear(D)(jax.nn.gelu(x))

        class FfnTwin(Ffn):  # Ffn's variables, another kind of block
            pass

        self.kinds = {"local": Local, "global": Global, "ffn": Ffn, "ffn_twin": FfnTwin}

    def loop(self, seq):
        def forward(x):
            for kind in seq:
                x = self.kinds[kind]()(x)
            return x

        return hk.transform_with_state(forward)

    def port(self, kinds=PATTERN, n=N, reverse=False):
        blocks = [self.kinds[kind] for kind in kinds]
        return hk.transform_with_state(lambda x: swh.Stack(blocks, n, reverse=reverse)(x))

    def init(self, model):
        return model.init(jax.random.key(0), X)

    def convert(self, tree, source, target):
        return swh.convert(tree, source, target, X)

    @staticmethod
    def names(seq, kinds=PATTERN):
        """Layer i's module name in a loop running `seq` (then `kinds` repeated), as Haiku
        names the i-th module of a class: `local`, `local_1`, `global`, `local_2`, ..."""

        def name(i):
            kind = lambda j: seq[j] if j < len(seq) else kinds[j % len(kinds)]  # noqa: E731
            c = sum(kind(j) == kind(i) for j in range(i))
            return kind(i) if c == 0 else f"{kind(i)}_{c}"

        return name

    def paths(self, kinds=PATTERN):
        return [f"stack/{self.names(kinds)(p)}" for p in range(len(kinds))]

    def _each(self, tree, f):
        return tuple(f(t) for t in tree) if isinstance(tree, tuple) else f(tree)

    def from_loop(self, tree, seq=(), kinds=PATTERN, **kwargs):
        names = self.names(seq, kinds)
        return self._each(tree, lambda t: swh.from_loop(t, self.paths(kinds), names, **kwargs))

    def to_loop(self, tree, seq=(), kinds=PATTERN):
        names = self.names(seq, kinds)
        return self._each(tree, lambda t: swh.to_loop(t, self.paths(kinds), names))

    @staticmethod
    def _under(tree, prefix):
        return {
            k[len(prefix) :]: v
            for k, v in tree.items()
            if k == prefix or k.startswith(prefix + "/")
        }

    def per_layer(self, tree):
        return [tuple(self._under(t, self.names(())(i)) for t in tree) for i in range(N)]

    def positions(self, tree):
        return tuple(tuple(self._under(t, path) for t in tree) for path in self.paths())

    def run(self, model, tree):
        params, state = tree
        (y, new_state) = model.apply(params, state, None, X)
        grads = jax.grad(lambda p: loss(model.apply(p, state, None, X)[0]))(params)
        return y, new_state, grads


class FlaxCase:
    id = "flax"

    def __init__(self):
        w = nn.initializers.normal(SCALE)

        def t(key, shape):
            return 1.0 + 0.1 * jax.random.normal(key, shape)

        class Local(nn.Module):
            @nn.compact
            def __call__(self, x):
                qkv = self.param("qkv", w, (D, 3 * D))
                out = self.param("out", w, (D, D))
                return attend(x, qkv, out, WINDOW, self.param("temp", t, (HEADS,)))

        class Global(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = attend(x, self.param("qkv", w, (D, 3 * D)), self.param("out", w, (D, D)))
                h = nn.BatchNorm(use_running_average=False)(nn.Dense(2 * D)(x))
                return x + nn.Dense(D)(jax.nn.gelu(h))

        class Ffn(nn.Module):
            @nn.compact
            def __call__(self, x):
                return x + nn.Dense(D)(jax.nn.gelu(x))

        class FfnTwin(Ffn):
            pass

        self.kinds = {"local": Local, "global": Global, "ffn": Ffn, "ffn_twin": FfnTwin}

    def loop(self, seq):
        kinds = self.kinds

        class Loop(nn.Module):
            @nn.compact
            def __call__(self, x):
                for i, kind in enumerate(seq):
                    x = kinds[kind](name=f"layers_{i}")(x)
                return x

        return Loop()

    def port(self, kinds=PATTERN, n=N, reverse=False):
        blocks = [self.kinds[kind] for kind in kinds]

        class Port(nn.Module):
            @nn.compact
            def __call__(self, x):
                return swf.Stack(blocks, n, reverse=reverse, name="layers")(x)

        return Port()

    def init(self, model):
        return model.init(jax.random.key(0), X)

    def convert(self, tree, source, target):
        return swf.convert(tree, source, target, X)

    def paths(self, kinds=PATTERN):
        counts, out = {}, []
        for kind in kinds:
            cls = self.kinds[kind].__name__
            out.append(f"layers/{cls}_{counts.get(cls, 0)}")
            counts[cls] = counts.get(cls, 0) + 1
        return out

    def from_loop(self, tree, seq=(), kinds=PATTERN, **kwargs):
        return swf.from_loop(tree, self.paths(kinds), **kwargs)

    def to_loop(self, tree, seq=(), kinds=PATTERN):
        return swf.to_loop(tree, self.paths(kinds))

    def per_layer(self, tree):
        return [
            {c: t[f"layers_{i}"] for c, t in tree.items() if f"layers_{i}" in t} for i in range(N)
        ]

    def positions(self, tree):
        names = [path.split("/")[1] for path in self.paths()]
        return tuple(
            {c: t["layers"][p] for c, t in tree.items() if p in t["layers"]} for p in names
        )

    def run(self, model, tree):
        y, new = model.apply(tree, X, mutable=["batch_stats"])
        params = tree["params"]

        def f(p):
            return loss(model.apply({**tree, "params": p}, X, mutable=["batch_stats"])[0])

        return y, new, {"params": jax.grad(f)(params)}


class NNXCase:
    id = "nnx"

    def __init__(self):
        def weight(rngs, shape):
            return nnx.Param(jax.random.normal(rngs.params(), shape) * SCALE)

        class Local(nnx.Module):
            def __init__(self, rngs):
                self.norm = nnx.BatchNorm(D, rngs=rngs)
                self.qkv, self.out = weight(rngs, (D, 3 * D)), weight(rngs, (D, D))
                self.temp = nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (HEADS,)))

            def __call__(self, x):
                return attend(self.norm(x), self.qkv[...], self.out[...], WINDOW, self.temp[...])

        class Global(nnx.Module):
            def __init__(self, rngs):
                self.qkv, self.out = weight(rngs, (D, 3 * D)), weight(rngs, (D, D))
                self.up, self.down = (
                    nnx.Linear(D, 2 * D, rngs=rngs),
                    nnx.Linear(2 * D, D, rngs=rngs),
                )

            def __call__(self, x):
                x = attend(x, self.qkv[...], self.out[...])
                return x + self.down(jax.nn.gelu(self.up(x)))

        class Ffn(nnx.Module):
            def __init__(self, rngs):
                self.linear = nnx.Linear(D, D, rngs=rngs)

            def __call__(self, x):
                return x + self.linear(jax.nn.gelu(x))

        class FfnTwin(Ffn):
            pass

        self.kinds = {"local": Local, "global": Global, "ffn": Ffn, "ffn_twin": FfnTwin}

    def loop(self, seq):
        kinds = self.kinds

        class Loop(nnx.Module):
            def __init__(self, rngs):
                self.layers = nnx.List([kinds[kind](rngs) for kind in seq])

            def __call__(self, x):
                for layer in self.layers:
                    x = layer(x)
                return x

        return Loop(nnx.Rngs(0))

    def port(self, kinds=PATTERN, n=N, reverse=False):
        blocks = [self.kinds[kind] for kind in kinds]

        class Port(nnx.Module):
            def __init__(self, rngs):
                self.layers = swn.Stack(blocks, n, rngs=rngs, reverse=reverse)

            def __call__(self, x):
                return self.layers(x)

        return nnx.eval_shape(lambda: Port(nnx.Rngs(1)))  # filled by nnx.update

    def init(self, model):
        return nnx.state(model)

    def convert(self, tree, source, target):
        return swn.convert(tree, source, target)

    def paths(self, kinds=PATTERN):
        return [f"layers/layers/{p}" for p in range(len(kinds))]

    def from_loop(self, tree, seq=(), kinds=PATTERN, **kwargs):
        return swn.from_loop(tree, self.paths(kinds), **kwargs)

    def to_loop(self, tree, seq=(), kinds=PATTERN):
        return swn.to_loop(tree, self.paths(kinds))

    def per_layer(self, tree):
        return [tree["layers"][i] for i in range(N)]

    def positions(self, tree):
        return tuple(tree["layers"]["layers"][p] for p in range(K))

    def run(self, model, tree):
        model = nnx.clone(model)
        nnx.update(model, tree)
        grads = nnx.grad(lambda m: loss(m(X)))(nnx.clone(model))
        y = model(X)
        return y, nnx.state(model, nnx.BatchStat), grads


CASES = [HaikuCase(), FlaxCase(), NNXCase()]
case_params = pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])


# --------------------------------------------------------------------------
# Both ways, bitwise.


@pytest.mark.slow
@case_params
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_convert_and_by_name_move_a_loop_into_a_pattern_stack_and_back_bitwise(case, reverse):
    loop, port = case.loop(sequence(PATTERN)), case.port(reverse=reverse)
    tree = case.init(loop)
    stacked = case.convert(tree, loop, port)
    # The reference: the loop's layers read by name, regrouped by the core.
    expected = stackwise.stack_layers(case.per_layer(tree), pattern=K)
    assert_trees_bitwise(case.positions(stacked), expected)
    assert_trees_bitwise(case.from_loop(tree), stacked)
    assert_trees_bitwise(case.convert(stacked, port, loop), tree)
    assert_trees_bitwise(case.to_loop(stacked), tree)


@pytest.mark.slow
@case_params
def test_the_converted_pattern_stack_computes_the_loop(case):
    loop, port = case.loop(sequence(PATTERN)), case.port()
    tree = case.init(loop)
    y_loop, state_loop, grads_loop = case.run(loop, tree)
    y, state, grads = case.run(port, case.convert(tree, loop, port))
    assert_trees_close(y, y_loop)
    assert_trees_close(case.to_loop(state), state_loop)  # each layer's own statistics
    assert_trees_close(case.to_loop(grads), grads_loop, zero=ZERO_GRADS.get(case.id, ()))


# Grads that are 0 in exact arithmetic (rounding noise, compared with the whole tree's largest):
# the bias of what a BatchNorm normalises next, in layers 2 and 5 (globals). Linen: the Dense
# before the global's own BatchNorm; NNX: the global's down projection, which the next local's
# BatchNorm normalises.
ZERO_GRADS = {
    "flax": ("layers_2']['Dense_0']['bias']", "layers_5']['Dense_0']['bias']"),
    "nnx": ("[2]['down']['bias']", "[5]['down']['bias']"),
}


# --------------------------------------------------------------------------
# Refused, naming the layer.


@pytest.mark.slow
@case_params
def test_a_loop_layer_of_another_kind_than_its_position_is_refused(case):
    # Layer 4 is global where position 4 % 3 = 1 holds local blocks.
    seq = ["local", "local", "global", "local", "global", "local", "local"]
    loop, port = case.loop(seq), case.port()
    tree = case.init(loop)
    with pytest.raises(ValueError, match=r"(?s)do not correspond one to one.*layer 4"):
        case.convert(tree, loop, port)
    with pytest.raises(ValueError, match=r"layer 4 \S+ holds other leaves than layer 1"):
        case.from_loop(tree, seq)


@case_params
def test_a_loop_layer_of_another_kind_with_the_same_variables_is_refused_by_convert(case):
    # FfnTwin has Ffn's variables (in the same modules) but is another kind of block:
    # convert checks the classes of the blocks around each variable.
    kinds = ["ffn", "ffn", "ffn_twin"]
    loop, port = case.loop(sequence(kinds)), case.port(kinds)
    assert_trees_bitwise(
        case.convert(case.convert(case.init(loop), loop, port), port, loop), case.init(loop)
    )
    seq = ["ffn", "ffn_twin", "ffn"] * 2 + ["ffn"]  # layer 1 is a twin; position 1 is not
    loop = case.loop(seq)
    with pytest.raises(
        ValueError,
        match=r"(?s)first differ at #\d+.*>> #\d+\n\s+source: [^\n]* in (\w+/)*FfnTwin/\w+\n"
        r"\s+target: [^\n]*\(layer 1\)[^\n]* in Ffn/\w+\n",
    ):
        case.convert(case.init(loop), loop, port)


@case_params
def test_a_depth_that_is_not_the_stacks_is_refused(case):
    loop = case.loop(sequence(PATTERN))
    tree = case.init(loop)
    with pytest.raises(ValueError, match=r"found 7 layers .* but n=5: layers 5\.\.6 would be left"):
        case.from_loop(tree, n=5)
    with pytest.raises(ValueError, match=r"do not correspond one to one"):
        case.convert(tree, loop, case.port(n=6))
    shallow = case.init(case.loop(sequence(PATTERN, 6)))
    with pytest.raises(ValueError, match=r"n=7 asks for layers 0\.\.6, but only 6 are present"):
        case.from_loop(shallow, sequence(PATTERN, 7), n=7)


@case_params
def test_a_dtype_that_differs_between_layers_is_refused(case):
    loop = case.loop(sequence(PATTERN))
    tree = case.init(loop)
    half = bf16_layer(case, tree, 4)
    with pytest.raises(
        TypeError,
        match=r"has different dtypes in different layers \(layer 1 \S+: float32; "
        r"layer 4 \S+: bfloat16\)",
    ):
        case.from_loop(half)
    with pytest.raises(ValueError, match=r"(?s)not (those of )?the source model.*bfloat16"):
        case.convert(half, loop, case.port())


def bf16_layer(case, tree, i):
    """The tree with layer i's attention `qkv` in bfloat16."""
    if isinstance(case, HaikuCase):
        params, state = tree
        name = case.names(())(i)
        bundle = dict(params[name])
        bundle["qkv"] = bundle["qkv"].astype(jnp.bfloat16)
        return {**params, name: bundle}, state
    if isinstance(case, FlaxCase):
        layer = dict(tree["params"][f"layers_{i}"])
        layer["qkv"] = layer["qkv"].astype(jnp.bfloat16)
        return {**tree, "params": {**tree["params"], f"layers_{i}": layer}}
    flat = dict(nnx.to_flat_state(tree))
    v = flat[("layers", i, "qkv")]
    flat[("layers", i, "qkv")] = v.copy(v[...].astype(jnp.bfloat16))
    return nnx.from_flat_state(flat)


@case_params
def test_a_wrong_position_path_leaves_nothing_behind(case):
    loop, port = case.loop(sequence(PATTERN)), case.port()
    stacked = case.convert(case.init(loop), loop, port)
    paths = case.paths()
    wrong = paths[:2] + [paths[2] + "x"]
    tree = stacked[0] if isinstance(stacked, tuple) else stacked
    with pytest.raises(ValueError, match=r"would be left behind, stacked"):
        if isinstance(case, HaikuCase):
            swh.to_loop(tree, wrong, case.names(()))
        elif isinstance(case, FlaxCase):
            swf.to_loop(tree, wrong)
        else:
            swn.to_loop(tree, [paths[0], paths[1], "layers/layers/5"])


def test_nnx_a_pattern_stack_given_as_one_path_names_its_positions():
    case = NNXCase()
    loop, port = case.loop(sequence(PATTERN)), case.port()
    stacked = case.convert(case.init(loop), loop, port)
    with pytest.raises(
        ValueError,
        match=r"layers\.layers holds the 3 positions of a pattern Stack .* Pass them as a "
        r"list: path=\['layers\.layers\.0', 'layers\.layers\.1', 'layers\.layers\.2'\]",
    ):
        swn.to_loop(stacked, "layers")

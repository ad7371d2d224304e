"""stackwise.nnx.Stack against a Python loop of the same blocks and against nnx.scan."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import optax
import pytest
from _nnx import Loop
from _references import NNX_D, Block, make, scan_model, stacked
from _tolerance import assert_close as assert_within
from _trees import STACK_BOUND
from flax import nnx

import stackwise
import stackwise.nnx
from stackwise.bench import program_fingerprint

D, B = NNX_D, 3  # features and batch: distinct, so params and activations differ in type


def plain(tree):
    """Variables -> arrays (PRNG keys as key data), for exact comparisons."""
    def leaf(a):
        a = a.get_raw_value() if isinstance(a, nnx.Variable) else a
        return jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a

    return jax.tree.map(leaf, tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


def assert_equal(a, b):
    a, b = plain(a), plain(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert bool(jnp.all(x == y))


def assert_close(a, b, zero=()):
    """Float32 reassociation between scan and loop: each leaf within ``STACK_BOUND * eps``
    times its largest magnitude (tests/_trees.py, tests/_tolerance.py); the leaves whose paths
    hold a part of ``zero``, 0 in exact arithmetic, times the tree's largest."""
    a, b = plain(a), plain(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape
    assert_within(a, b, STACK_BOUND, zero=zero)


# The bias before BatchNorm has a true gradient of 0: what the two programs compute there is
# rounding noise of the batch mean.
BEFORE_NORM = ("['linear']['bias']",)


def loss_and_grads(model, x):
    """``jax.grad`` through ``nnx.split``, as a user writes it."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        m = nnx.merge(graphdef, params, rest, copy=True)
        return jnp.sum(m(x) ** 2)

    return jax.value_and_grad(loss)(params)


@nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
def scan_apply(x, block):
    return block(x)


X = jax.random.normal(jax.random.key(1), (B, D))


# --------------------------------------------------------------------------
# Creation.


def test_creation_equals_nnx_vmap_and_a_loop_of_blocks():
    n = 4
    s = stackwise.nnx.Stack(lambda r: make(r, 0.5), n, rngs=nnx.Rngs(0, dropout=1))
    assert s.layers.linear.kernel.shape == (n, D, D)
    assert_equal(nnx.state(s.layers), nnx.state(scan_model(n, nnx.Rngs(0, dropout=1), 0.5)))
    # A loop of blocks, each built from its own key per stream.
    parent = nnx.Rngs(0, dropout=1)
    keys = {name: jax.random.split(stream(), n) for name, stream in parent.items()}
    blocks = [make(nnx.Rngs(**{k: v[i] for k, v in keys.items()}), 0.5) for i in range(n)]
    assert_equal(nnx.state(s.layers), stacked([nnx.state(b) for b in blocks]))


# --------------------------------------------------------------------------
# Forward, grad and state updates against the loop.

CASES = {
    "scan": dict(),
    "remat-unroll2": dict(remat=True, unroll=2),
    "python-loop-remat-reverse": dict(unroll=True, remat=True, reverse=True),
    "nested-reverse-policy": dict(
        nested=2, reverse=True, remat=jax.checkpoint_policies.dots_saveable
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_forward_grad_and_batch_stats_match_a_loop(case):
    n = 5  # nested=2: two groups of two and a tail of one
    s = stackwise.nnx.Stack(make, n, rngs=nnx.Rngs(0), **CASES[case])
    loop = Loop(s.to_layers(), reverse=CASES[case].get("reverse", False))
    y, y_loop = nnx.jit(lambda m, x: m(x))(s, X), nnx.jit(lambda m, x: m(x))(loop, X)
    assert_close(y, y_loop)
    # BatchNorm statistics were updated in place, per layer, as in the loop.
    assert not jnp.allclose(s.layers.norm.mean[...], 0.0)
    assert_close(nnx.state(s.layers, nnx.BatchStat),
                 stacked([nnx.state(b, nnx.BatchStat) for b in loop.blocks]))
    (value, g), (value_loop, g_loop) = loss_and_grads(s, X), loss_and_grads(loop, X)
    assert_close(value, value_loop)
    assert_close(g["layers"], stacked([g_loop["blocks"][i] for i in range(n)]), BEFORE_NORM)


def test_matches_nnx_scan_forward_grad_dropout_and_state():
    n = 4
    s = stackwise.nnx.Stack(lambda r: make(r, 0.5), n, rngs=nnx.Rngs(0, dropout=1))
    ref = scan_model(n, nnx.Rngs(0, dropout=1), 0.5)
    call = nnx.jit(lambda m, x: m(x))
    ref_call = nnx.jit(scan_apply)
    for _ in range(2):  # the dropout counters advance: the second call differs
        assert_close(call(s, X), ref_call(X, ref))
    assert_equal(nnx.state(s.layers), nnx.state(ref))  # stats, keys, counts
    assert s.layers.drop.rngs.count[...].tolist() == [2] * n

    def ref_loss(params, rest):
        return jnp.sum(scan_apply(X, nnx.merge(graphdef, params, rest, copy=True)) ** 2)

    graphdef, params, rest = nnx.split(ref, nnx.Param, ...)
    g_ref = jax.jit(jax.grad(ref_loss))(params, rest)
    _, g = loss_and_grads(s, X)
    assert_close(g["layers"], g_ref, BEFORE_NORM)


def test_with_batch_stats_and_dropout_it_compiles_to_the_program_of_nnx_scan():
    # With remat off, jit(grad) of a Stack is nnx.scan's program up to names (BatchNorm
    # statistics and dropout included): the benchmark's step-time parity rests on this.
    n = 3

    def program(model, apply):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, rest):
            return jnp.sum(apply(nnx.merge(graphdef, params, rest, copy=True)) ** 2)

        compiled = jax.jit(jax.grad(loss)).lower(params, rest).compile()
        return program_fingerprint(compiled.as_text())

    s = stackwise.nnx.Stack(make, n, rngs=nnx.Rngs(0), remat=False)
    stacked = program(s, lambda m: m(X))
    assert stacked == program(scan_model(n, nnx.Rngs(0)), lambda m: scan_apply(X, m))


def test_eval_mode_leaves_statistics_and_dropout_alone():
    s = stackwise.nnx.Stack(lambda r: make(r, 0.5), 3, rngs=nnx.Rngs(0, dropout=1))
    s.eval()
    before = nnx.state(s, nnx.BatchStat, nnx.RngCount)
    y = s(X)
    assert_equal(nnx.state(s, nnx.BatchStat, nnx.RngCount), before)
    assert_close(y, Loop(s.to_layers())(X))


class Noise(nnx.Module):
    def __init__(self, rngs):
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        self.sow(nnx.Intermediate, "mask", self.drop(jnp.ones((16,))))
        return x


def test_dropout_masks_are_independent_per_layer_and_per_call():
    s = stackwise.nnx.Stack(Noise, 4, rngs=nnx.Rngs(dropout=0))
    forward = nnx.capture(s, nnx.Intermediate)
    (_, first), (_, second) = forward(X), forward(X)
    first, second = first["layers"]["mask"][0], second["layers"]["mask"][0]
    assert first.shape == (4, 16)
    assert len({tuple(m.tolist()) for m in jnp.concatenate([first, second])}) == 8
    assert s.layers.drop.rngs.count[...].tolist() == [2, 2, 2, 2]


class CallRngs(nnx.Module):
    def __init__(self, rngs):
        pass

    def __call__(self, x, rngs):
        self.sow(nnx.Intermediate, "u", jax.random.uniform(rngs.noise(), (8,)))
        return x


def test_rngs_argument_is_split_per_layer():
    s = stackwise.nnx.Stack(CallRngs, 3, rngs=nnx.Rngs(0))
    rngs = nnx.Rngs(noise=7)
    _, sown = nnx.capture(s, nnx.Intermediate)(X, rngs)
    u = sown["layers"]["u"][0]
    assert len({tuple(r.tolist()) for r in u}) == 3
    assert int(rngs.noise.count[...]) == 1
    key = jax.random.split(jax.random.fold_in(jax.random.key(7), 0), 3)[1]
    assert_equal(u[1], jax.random.uniform(nnx.Rngs(noise=key).noise(), (8,)))


# --------------------------------------------------------------------------
# Per-layer inputs and outputs, layer index.


class Indexed(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (2,)))

    def __call__(self, x, scale, offset=0.0):
        i = stackwise.nnx.layer_index()
        return x * scale + self.w[...].sum() + offset + i, i


def test_per_layer_inputs_aux_outputs_and_layer_index():
    n = 4
    for reverse in (False, True):
        s = stackwise.nnx.Stack(Indexed, n, rngs=nnx.Rngs(0), has_aux=True, reverse=reverse)
        scales = jnp.arange(1.0, n + 1)
        y, idx = s(jnp.float32(1.0), stackwise.per_layer(scales), offset=0.5)
        assert idx.tolist() == list(range(n))
        want, w = 1.0, s.layers.w[...].sum(-1)
        for i in reversed(range(n)) if reverse else range(n):
            want = want * scales[i] + w[i] + 0.5 + i
        assert_close(y, want)


class Outer(nnx.Module):
    def __init__(self, rngs):
        self.inner = stackwise.nnx.Stack(Indexed, 2, rngs=rngs, has_aux=True)

    def __call__(self, x, outer_index=None):
        x, inner_index = self.inner(x, 1.0)
        if outer_index is None:  # the index is read after the inner stack ran
            outer_index = stackwise.nnx.layer_index()
        return x + 100 * outer_index + 10 * inner_index.sum()


def test_nested_stacks():
    s = stackwise.nnx.Stack(Outer, 3, rngs=nnx.Rngs(0))
    assert s.layers.inner.layers.w.shape == (3, 2, 2)
    blocks = s.to_layers()
    assert blocks[1].inner.layers.w.shape == (2, 2)
    y_loop = jnp.float32(0.0)
    for i, block in enumerate(blocks):
        y_loop = block(y_loop, outer_index=i)
    assert_close(s(jnp.float32(0.0)), y_loop)


# --------------------------------------------------------------------------
# Training with nnx.Optimizer and optax.


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


@pytest.mark.slow
def test_optimizer_steps_match_the_loop_and_the_loss_falls():
    s = stackwise.nnx.Stack(Mlp, 3, rngs=nnx.Rngs(0), remat=True)
    loop = Loop(s.to_layers())
    target = jnp.cos(X)

    @nnx.jit
    def step(model, opt):
        def loss_fn(model):
            return jnp.mean((model(X) - target) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    opt = nnx.Optimizer(s, optax.adam(1e-2), wrt=nnx.Param)
    opt_loop = nnx.Optimizer(loop, optax.adam(1e-2), wrt=nnx.Param)
    assert_close(step(s, opt), step(loop, opt_loop))
    assert_close(nnx.state(s.layers), stacked([nnx.state(b) for b in loop.blocks]))
    losses = [step(s, opt) for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0]


# --------------------------------------------------------------------------
# Remat in the lowered program.


# --------------------------------------------------------------------------
# Errors.


def test_errors_name_the_block_and_variable():
    with pytest.raises(TypeError, match="must return an nnx.Module.*returned Array"):
        stackwise.nnx.Stack(lambda rngs: jnp.zeros(3), 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="got a built Block module.*lambda rngs: Block"):
        stackwise.nnx.Stack(make(nnx.Rngs(0)), 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"Stack\(make, n=0\): `n` must be at least 1, got 0"):
        stackwise.nnx.Stack(make, 0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="`n` must be a Python int"):
        stackwise.nnx.Stack(make, 2.0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="`remat` must be"):
        stackwise.nnx.Stack(make, 2, rngs=nnx.Rngs(0), remat="yes")

    s = stackwise.nnx.Stack(lambda r: nnx.Linear(D, 2 * D, rngs=r), 2, rngs=nnx.Rngs(0))
    message = (
        r"Stack\(Linear, n=2\): a layer changed carry leaf `x` from "
        r"float32\[3, 8\] to float32\[3, 16\].*project it back"
    )
    with pytest.raises(TypeError, match=message):
        s(X)

    class Cast(nnx.Module):
        def __init__(self, rngs):
            pass

        def __call__(self, x):
            return {"h": x["h"].astype(jnp.bfloat16)}

    with pytest.raises(TypeError, match=r"Stack\(Cast, n=2\).*`x\['h'\]` from float32.*astype"):
        stackwise.nnx.Stack(Cast, 2, rngs=nnx.Rngs(0))({"h": X})

    s = stackwise.nnx.Stack(make, 3, rngs=nnx.Rngs(0))
    s.layers.linear.kernel = nnx.Param(s.layers.linear.kernel[:2])
    with pytest.raises(ValueError, match=r"(?s)Stack\(Block, n=3\).*n=3.*linear\.kernel \(Param\): "
                       r"shape \(2, 8, 8\)"):
        s(X)

    with pytest.raises(TypeError, match=r"block 1 \(Block\) differs in structure"):
        stackwise.nnx.Stack.from_layers([Block(D, nnx.Rngs(0)), Block(D + 1, nnx.Rngs(0))])


# --------------------------------------------------------------------------
# Sharding metadata on 8 simulated devices, and the import guard.

def run_python(code, **env):
    return subprocess.run(
        [sys.executable, "-P", "-c", textwrap.dedent(code)],  # -P: as test_equinox.py's
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_missing_flax_gives_an_install_hint():
    proc = run_python("""
        import sys
        sys.modules["flax"] = None
        try:
            import stackwise.nnx
        except ImportError as e:
            print(e)
        """)
    assert proc.stdout.strip() == "`stackwise.nnx` needs flax: pip install 'stackwise[flax]'"


# --------------------------------------------------------------------------
# Patterns (outputs and grads against the loop: tests/adapters/test_contract.py).


def test_a_pattern_holds_one_stacked_block_per_position():
    s = stackwise.nnx.Stack(
        [make, lambda r: nnx.Linear(D, D, rngs=r)], n=5, rngs=nnx.Rngs(0)
    )
    assert len(s.layers) == 2
    assert s.layers[0].linear.kernel.shape == (3, D, D)
    assert s.layers[1].kernel.shape == (2, D, D)
    blocks = s.to_layers()
    assert [type(b).__name__ for b in blocks] == ["Block", "Linear"] * 2 + ["Block"]
    assert len(s) == 5 and type(s.layer(3)).__name__ == "Linear"
    assert_equal(nnx.state(s.layer(3)), nnx.state(blocks[3]))
    back = stackwise.nnx.Stack.from_layers(blocks, pattern=2)
    assert_equal(nnx.state(back.layers), nnx.state(s.layers))
    assert_close(back(X), s(X))
    with pytest.raises(TypeError, match=r"block 1 \(Linear\) differs.*pass `pattern=k`"):
        stackwise.nnx.Stack.from_layers(blocks)

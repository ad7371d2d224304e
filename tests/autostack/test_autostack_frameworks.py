"""stackwise.autostack on Haiku and linen models written as for loops of blocks."""

import jax
from test_autostack import check_loop

import stackwise

X = jax.random.normal(jax.random.key(1), (2, 5, 8))


def test_haiku_loop_of_named_blocks():
    import haiku as hk

    class Block(hk.Module):
        def __call__(self, x):
            h = hk.LayerNorm(-1, True, True)(x)
            return x + hk.Linear(8)(jax.nn.gelu(hk.Linear(16)(h)))

    def forward(x):
        for i in range(12):  # names sort as layer_0, layer_1, layer_10, ...: moved by path
            x = Block(name=f"layer_{i}")(x)
        return hk.Linear(3)(x)

    model = hk.transform(forward)
    params = model.init(jax.random.key(0), X)
    f = check_loop(lambda p, x: model.apply(p, None, x), params, X, n=12)
    assert f.found.params == 6


def test_linen_loop_of_submodules():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(8)(nn.relu(nn.Dense(16)(nn.LayerNorm()(x))))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(5):
                x = Block(name=f"block_{i}")(x)
            return nn.Dense(3)(x)

    model = Model()
    variables = model.init(jax.random.key(0), X)
    stacked, f = stackwise.autostack(model.apply, variables, X)
    assert f.found.n == 5 and f.found.params == 6
    check_loop(model.apply, variables, X, n=5)
    assert "['params']['block_0']['Dense_0']['kernel']" in stacked["blocks"]

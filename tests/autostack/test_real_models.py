"""stackwise.autostack on the loop models that tests/adapters port onto Stacks, unmodified:
dm-haiku's example transformer (``transformed.apply``), flax's lm1b (``model.apply``),
flax's Gemma on NNX (a pure function of its ``nnx.split`` params) and that Gemma with
Gemma 3's 5 local : 1 global pattern. The run found is the whole depth (for the pattern:
the 6-layer period), outputs and gradients equal the loop's, and the params convert to the
stacked layout and back bitwise.

The models are upstream's files in tests/adapters/upstream, loaded by path (the adapters'
tests import them as the package ``upstream``, on their own directory's path).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest
from _models import check_model
from _tolerance import reassociation_bound

import stackwise

UPSTREAM = pathlib.Path(__file__).parents[1] / "adapters" / "upstream"


def upstream(name: str):
    """tests/adapters/upstream/<name>.py, imported once as ``autostack_upstream_<name>``."""
    module_name = f"autostack_upstream_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, UPSTREAM / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


TOKENS = jnp.array([[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 0]])


# --------------------------------------------------------------------------
# dm-haiku's example transformer: a `for` loop creating the layers' modules by creation order.


def haiku_model(n, dropout_rate):
    import haiku as hk

    hk_upstream = upstream("haiku_transformer")

    def forward(tokens):
        t = hk_upstream.Transformer(num_heads=2, num_layers=n, attn_size=4,
                                    dropout_rate=dropout_rate, name="transformer")
        return hk_upstream.LanguageModel(t, model_size=8, vocab_size=11, pad_token=0)(tokens)

    return hk.transform(forward)


# Upstream adds [T, D] position embeddings to [B, T, D] token embeddings: rank promotion,
# which the suite's strict setting refuses; allowed for the upstream model only (as in
# tests/adapters/test_convert_haiku.py).
def rank_promotion_allowed():
    return jax.numpy_rank_promotion("allow")


# A layer chains sums of D = 8 terms (a norm, q/k/v, the output projection over 2 heads x 4,
# a norm, the MLP's up), 4 (the scores, per head), 6 (softmax and weights @ v over the
# positions) and 32 (the MLP's down); the grads sum the 12 tokens' rows.
HAIKU_SUMS = (8, 8, 4, 6, 8, 8, 8, 32)
# The key projection's bias shifts every score of a query alike, which softmax ignores: its
# gradient is 0, and what the two programs compute there is rounding noise (as in
# tests/adapters/test_convert_haiku.py).
HAIKU_ZERO = ("/key']['b']",)


@pytest.mark.slow  # (4-7 s each on 2 shared cores; the fast tier runs Gemma's first case)
@pytest.mark.parametrize("n", [4, 12])
def test_haiku_transformer(n):
    model = haiku_model(n, dropout_rate=0.0)
    key = jax.random.key(5)
    with rank_promotion_allowed():
        params = model.init(jax.random.key(0), TOKENS)
        fresh = model.init(jax.random.key(1), TOKENS)
        _, f = check_model(model.apply, params, fresh, (key, TOKENS), n=n,
                           bound=reassociation_bound(depth=n, width=HAIKU_SUMS, summed=12),
                           zero=HAIKU_ZERO)
    # Layer i owns layer_norm_{2i}, layer_norm_{2i+1}, linear_{2i}, linear_{2i+1} and
    # multi_head_attention_{i}: 4 attention Linears (w, b each), 2 MLP Linears, 2 norms.
    assert f.found.params == 16, f.found


@pytest.mark.slow
def test_haiku_transformer_with_dropout_threads_the_key_through_the_scan():
    """With dropout, each layer takes its keys from ``hk.next_rng_key()``, split from the
    previous layer's: the key chain is carried by the scan, the masks are the loop's."""
    model = haiku_model(4, dropout_rate=0.25)
    with rank_promotion_allowed():
        params = model.init(jax.random.key(0), TOKENS)
        fresh = model.init(jax.random.key(1), TOKENS)
        check_model(model.apply, params, fresh, (jax.random.key(5), TOKENS), n=4,
                    bound=reassociation_bound(depth=4, width=HAIKU_SUMS, summed=12),
                    zero=HAIKU_ZERO)


# --------------------------------------------------------------------------
# flax's lm1b: a linen `for` loop of `EncoderDecoder1DBlock(name=f"encoderdecoderblock_{i}")`.


def lm1b_config(n):
    return upstream("lm1b").TransformerConfig(
        vocab_size=13, output_vocab_size=13, emb_dim=8, num_heads=2, num_layers=n, qkv_dim=8,
        mlp_dim=16, max_len=16, deterministic=True,
    )


# A layer: a norm (8), q/k/v (8), the scores (4 per head), softmax and weights @ v (6
# positions), the output projection (8), a norm (8), the MLP's up (8) and down (16).
LM1B_SUMS = (8, 8, 4, 6, 8, 8, 8, 16)


# Upstream builds its attention with nn.SelfAttention, which this flax deprecates.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated:DeprecationWarning")
@pytest.mark.parametrize("n", [3, 12])
def test_flax_lm1b(n):
    model = upstream("lm1b").TransformerLM(lm1b_config(n))
    variables = model.init(jax.random.key(0), TOKENS)
    fresh = model.init(jax.random.key(1), TOKENS)
    stacked, f = check_model(model.apply, variables, fresh, (TOKENS,), n=n,
                             bound=reassociation_bound(depth=n, width=LM1B_SUMS, summed=12))
    layer = variables["params"]["decoder"]["encoderdecoderblock_0"]
    assert f.found.params == len(jax.tree.leaves(layer)), f.found  # every leaf of a layer
    leaf = stacked["blocks"]["['params']['decoder']['encoderdecoderblock_0']['MlpBlock_0']"
                             "['Dense_0']['kernel'].value"]
    assert leaf.shape == (n, 8, 16)


# --------------------------------------------------------------------------
# flax's Gemma on NNX: `for i, layer in enumerate(self.layers)`, a pure function of the params
# through nnx.split / nnx.merge.

GEMMA_TOKENS = jnp.array([[1, 2, 3, 4, 0], [5, 6, 7, 0, 0]])
# Upstream reads variables with `.value`, which this flax deprecates.
UPSTREAM_WARNINGS = pytest.mark.filterwarnings(
    "ignore:'\\.value' (access|setter) is now deprecated:DeprecationWarning"
)


def gemma(attention_types, window=None):
    """The loop model ``fn(params, tokens, positions, mask)``, its params, fresh params (another
    init), the example arguments, and the params leaves of one layer."""
    from flax import nnx

    g_upstream = upstream("gemma")
    config = g_upstream.TransformerConfig(
        num_layers=len(attention_types), num_embed=17, embed_dim=16, hidden_dim=24,
        num_heads=4, head_dim=8, num_kv_heads=1, final_logit_softcap=None,
        use_post_attn_norm=True, use_post_ffw_norm=True, attention_types=attention_types,
        sliding_window_size=window,
    )
    model = g_upstream.Transformer(config, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def fn(params, tokens, positions, mask):
        return nnx.merge(graphdef, params, rest, copy=True)(tokens, positions, None, mask)[0]

    fresh = nnx.split(g_upstream.Transformer(config, rngs=nnx.Rngs(1)), nnx.Param, ...)[1]
    mask = GEMMA_TOKENS != 0
    args = (GEMMA_TOKENS, g_upstream.build_positions_from_mask(mask),
            g_upstream.make_causal_attn_mask(mask))
    per_layer = len(jax.tree.leaves(nnx.state(model.layers[0], nnx.Param)))
    return fn, params, fresh, args, per_layer


# A layer: a norm (16), q (16), k/v (16), the scores (8 per head), softmax and weights @ v
# (5 positions), the output projection (4 heads x 8), the post-attention norm (16), a norm
# (16), the gate and up (16), down (24), the post-MLP norm (16); the grads sum 10 tokens.
GEMMA_SUMS = (16, 16, 16, 8, 5, 32, 16, 16, 16, 24, 16)


@UPSTREAM_WARNINGS
@pytest.mark.parametrize("n", [3, 8])  # (the first case runs in the fast tier: 3-4 s)
def test_gemma_nnx(n):
    types = (upstream("gemma").AttentionType.GLOBAL,) * n
    fn, params, fresh, args, per_layer = gemma(types)
    _, f = check_model(fn, params, fresh, args, n=n,
                       bound=reassociation_bound(depth=n, width=GEMMA_SUMS, summed=10))
    assert f.found.params == per_layer, (f.found, per_layer)


@pytest.mark.slow
@UPSTREAM_WARNINGS
@pytest.mark.parametrize("periods", [2, 3])
def test_gemma3_five_local_to_one_global(periods):
    """Gemma 3's pattern: 5 sliding-window layers (their own RoPE base) then a global one. The
    run found is a block of the 6 layers, ``periods`` times: the whole depth."""
    attention = upstream("gemma").AttentionType
    types = ((attention.LOCAL_SLIDING,) * 5 + (attention.GLOBAL,)) * periods
    fn, params, fresh, args, per_layer = gemma(types, window=2)
    stacked, f = check_model(fn, params, fresh, args, n=periods,
                             bound=reassociation_bound(depth=6 * periods, width=GEMMA_SUMS,
                                                       summed=10))
    assert f.found.params == 6 * per_layer, (f.found, per_layer)  # a block is 6 layers
    assert f.found.stop - f.found.start == periods * f.found.period
    # Every stacked leaf holds one layer of one position per period: layer 6 * i + j.
    for key, leaf in stacked["blocks"].items():
        assert leaf.shape[0] == periods, (key, leaf.shape)


@pytest.mark.slow
@UPSTREAM_WARNINGS
def test_gemma_program_is_flat_in_depth():
    """The lowered program of the autostacked Gemma is the same size at 3 and 12 layers; the
    loop's grows with the layers."""
    sizes, loops = [], []
    for n in (3, 12):
        fn, params, _, args, _ = gemma((upstream("gemma").AttentionType.GLOBAL,) * n)
        stacked, f = stackwise.autostack(fn, params, *args, n=n)
        sizes.append(len(jax.jit(f).lower(stacked, *args).as_text()))
        loops.append(len(jax.jit(fn).lower(params, *args).as_text()))
    assert sizes[1] < 1.1 * sizes[0], sizes
    assert loops[1] > 2.5 * loops[0], loops

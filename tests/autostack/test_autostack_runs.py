"""More than one run: a model with two different repeated stacks (an encoder's layers then a
decoder's, a narrow pre-stack then the main stack) gets each run stacked as its own scan,
each with its own stacked param leaves; ``n`` takes a count per run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _models import mlp, mlp_params
from _trees import assert_trees_bitwise
from test_autostack import check_loop

import stackwise

KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (4, 8))


def encoder_decoder(params, x):
    """Encoder layers (tanh MLP), a projection, decoder layers of another width that read
    the encoder's output too (as cross-attention reads its memory)."""
    for p in params["enc"]:
        x = x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
    memory, x = x, x @ params["proj"]
    for p in params["dec"]:
        x = x + jax.nn.gelu(x @ p["w"]) @ p["v"] + memory @ p["c"]
    return x @ params["head"]


def encoder_decoder_params(key, n_enc, n_dec, d=8, e=6):
    keys = iter(jax.random.split(key, 3 * (n_enc + n_dec) + 2))

    def normal(*shape):
        return jax.random.normal(next(keys), shape) / shape[0] ** 0.5

    return {
        "enc": [{"w": normal(d, 16), "b": jnp.full((1, 16), 0.1), "v": normal(16, d)}
                for _ in range(n_enc)],
        "proj": normal(d, e),
        "dec": [{"w": normal(e, 12), "v": normal(12, e), "c": normal(d, e)}
                for _ in range(n_dec)],
        "head": normal(e, 2),
    }


def pre_and_main(params, x):
    """A pre-stack of wide layers, then the main stack of plain ones (``mlp``'s)."""
    for p in params["pre"]:
        x = x + jnp.tanh(x @ p["w"]) @ p["v"]
    return mlp(params, x)


def pre_and_main_params(key, n_pre, n):
    keys = jax.random.split(key, n_pre + 1)
    pre = [{"w": jax.random.normal(k, (8, 32)) / 8, "v": jax.random.normal(k, (32, 8)) / 8}
           for k in keys[:n_pre]]
    return {"pre": pre, **mlp_params(keys[n_pre], n)}


def gelu_after_tanh(params, x):
    """Two stacks of one width back to back: the first ends with the ``add`` the second's
    blocks end with, so the second's repeats reach one equation into the first run."""
    for p in params["layers"]:
        x = x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
    for p in params["gelu"]:
        x = x + jax.nn.gelu(x @ p["w"] + p["b"]) @ p["v"]
    return x @ params["head"]


def gelu_after_tanh_params(key, n1, n2):
    a, b = jax.random.split(key)
    return {**mlp_params(a, n1), "gelu": mlp_params(b, n2)["layers"]}


def scans(f, stacked, *args) -> list[int]:
    """The length of each top-level scan of ``f``'s program."""
    return [e.params["length"] for e in jax.make_jaxpr(f)(stacked, *args).jaxpr.eqns
            if e.primitive.name == "scan"]


@pytest.mark.parametrize("remat", [None, True])
@pytest.mark.parametrize("n_enc, n_dec", [(5, 3), (2, 6)])
def test_an_encoder_and_a_decoder_are_two_scans_with_the_loops_numbers(n_enc, n_dec, remat):
    params = encoder_decoder_params(KEY, n_enc, n_dec)
    f = check_loop(encoder_decoder, params, X, n=(n_enc, n_dec), remat=remat)  # (n= too)
    assert [(r.n, r.params) for r in f.runs] == [(n_enc, 3), (n_dec, 3)]
    assert f.found == max(f.runs, key=lambda r: r.n * r.period)  # the longest run
    stacked = f.stack(params)
    assert sorted(stacked["blocks"]) == [
        "['dec'][0]['c']", "['dec'][0]['v']", "['dec'][0]['w']",
        "['enc'][0]['b']", "['enc'][0]['v']", "['enc'][0]['w']"]
    assert stacked["blocks"]["['dec'][0]['c']"].shape == (n_dec, 8, 6)
    assert stacked["rest"]["enc"] == [{"w": None, "b": None, "v": None}] * n_enc
    assert_trees_bitwise(f.unstack(stacked), params)
    assert scans(f, stacked, X) == [n_enc, n_dec]
    assert repr(f).count("run as one scan") == 2


def test_the_program_of_two_runs_is_flat_in_depth():
    sizes = []
    for n_enc, n_dec in [(2, 2), (6, 5)]:
        stacked, f = stackwise.autostack(encoder_decoder,
                                         encoder_decoder_params(KEY, n_enc, n_dec), X)
        sizes.append(len(jax.make_jaxpr(f)(stacked, X).jaxpr.eqns))
    assert sizes[0] == sizes[1], sizes


@pytest.mark.slow  # (the fast tier runs the encoder and decoder, and the clipped stack)
def test_a_pre_stack_and_the_main_stack():
    """Its first run's last ``add`` is the main blocks' last: the main run's blocks start
    where one value crosses, not one equation earlier (two), leaving the pre-stack whole."""
    params = pre_and_main_params(KEY, 3, 5)
    f = check_loop(pre_and_main, params, X, n=(3, 5))
    assert [r.start for r in f.runs] == [0, f.runs[0].stop]


def test_a_second_stack_whose_repeats_reach_into_the_first_is_clipped_to_its_own():
    params = gelu_after_tanh_params(KEY, 4, 3)
    f = check_loop(gelu_after_tanh, params, X, n=(4, 3))
    assert f.runs[0].stop == f.runs[1].start  # the gelu run starts at its own first block


def norm_params(params, x):
    """A norm's scale and offset, broadcast in turn (consecutive, alike, each its own)."""
    scale, offset = (jnp.broadcast_to(params[k], (4, 8)) for k in ("scale", "offset"))
    return x * scale + offset


PREFIXES = {  # repeats before the loop that are no stack of layers, and why
    "no params": (lambda params, x: jnp.tanh(jnp.tanh(jnp.tanh(x))),
                  "no block reads param leaves of its own"),
    "no value carried": (norm_params, "no value flows from one block to the next"),
    "one equation each": (lambda params, x: x * params["scale"] * params["offset"],
                          "each block is one equation"),
}


@pytest.mark.every_case
@pytest.mark.parametrize("prefix", list(PREFIXES))
def test_a_repeat_that_is_no_stack_of_layers_is_not_a_second_run(prefix):
    before, why = PREFIXES[prefix]

    def model(params, x):
        return mlp(params, before(params, x))

    params = {**mlp_params(KEY, 4), "scale": jnp.full((1, 8), 0.9, jnp.float32),
              "offset": jnp.full((1, 8), 0.1, jnp.float32)}
    f = check_loop(model, params, X, n=4)
    assert len(f.runs) == 1 and f.found.start > 0, f.runs
    assert sorted(f.stack(params)["blocks"]) == [
        "['layers'][0]['b']", "['layers'][0]['v']", "['layers'][0]['w']"]
    with pytest.raises(ValueError, match=rf"outside them, \d blocks of 1 equations from "
                                         rf"equation 0 repeat, but {why}"):
        stackwise.autostack(model, params, X, n=(2, 4))


def test_a_broken_second_stack_is_named():
    def model(params, x):
        for p in params["enc"]:
            x = x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
        memory, x = x, x @ params["proj"]
        for i, p in enumerate(params["dec"]):
            if i == 2:
                x = jnp.sin(x)
            x = x + jax.nn.gelu(x @ p["w"]) @ p["v"] + memory @ p["c"]
        return x @ params["head"]

    params = encoder_decoder_params(KEY, 3, 5)
    with pytest.raises(ValueError) as info:
        stackwise.autostack(model, params, X)
    message = str(info.value)
    assert "the loop is broken at block 2" in message and "(`sin`" in message, message
    assert "Blocks 0-2 of the run at equation" in message, message  # decoder blocks 2-4
    assert "the same block recurs at equation" in message, message
    same, f = stackwise.autostack(model, params, X, best_effort=True)
    assert same is params and f.runs == () and "broken" in f.found.why


def test_the_same_block_twice_with_a_layer_between_is_a_broken_loop():
    def model(params, x):
        for i, p in enumerate(params["layers"]):
            x = x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
            if i == 2:
                x = x * params["mid"]
        return x @ params["head"]

    params = {**mlp_params(KEY, 6), "mid": jnp.full((1, 8), 0.5)}
    with pytest.raises(ValueError, match="the loop is broken at block 3"):
        stackwise.autostack(model, params, X)


def test_n_counts_each_run():
    params = encoder_decoder_params(KEY, 3, 2)
    with pytest.raises(ValueError, match=r"`n=3` expects one run, but 2 were found .* pass "
                                         r"`n=\(3, 2\)`"):
        stackwise.autostack(encoder_decoder, params, X, n=3)
    with pytest.raises(ValueError, match=r"`n=\(3, 4\)`: run 1 \(from equation \d+\) has 2 "
                                         r"blocks, not 4; it ends at block 2"):
        stackwise.autostack(encoder_decoder, params, X, n=(3, 4))
    with pytest.raises(ValueError, match=r"`n=\(3, 2, 2\)` expects 3 runs, but 2 were found "
                                         r".*; outside them no two consecutive blocks"):
        stackwise.autostack(encoder_decoder, params, X, n=[3, 2, 2])
    _, f = stackwise.autostack(encoder_decoder, params, X, n=[3, 2])
    assert [r.n for r in f.runs] == [3, 2]


def test_a_tied_second_stack_is_not_a_run_and_n_says_why():
    def model(params, x):  # then one tied layer applied 3 times
        x = mlp({"layers": params["layers"], "head": jnp.eye(8)}, x)
        for _ in range(3):
            x = x + jnp.tanh(x @ params["tied"])
        return x @ params["head"]

    params = {**mlp_params(KEY, 4), "tied": jnp.eye(8) / 2}
    with pytest.raises(ValueError) as info:
        stackwise.autostack(model, params, X, n=(4, 3))
    message = str(info.value)
    assert "`n=(4, 3)` expects 2 runs, but 1 was found (4 blocks" in message, message
    assert "but no block reads param leaves of its own" in message, message
    f = check_loop(model, params, X, n=4)  # the tied layers run as traced
    assert len(f.runs) == 1

"""stackwise.bench.workloads: every block's rows, the frameworks' common skeleton, what
happens when a framework or an adapter is missing, and that the rows of the decode, prefill
and pattern blocks compute what their Python loops compute (so that the benchmark measures
correct programs)."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close, compare, reassociation_bound

import stackwise
from stackwise.bench import BenchConfig, run_benchmark, workloads

CFG = BenchConfig.quick()
FRAMEWORKS = [m for m in workloads.BLOCKS["transformer"].modules if m != "core"]
# The same float32 math, its sums in another order (a scan against a loop): within *_BOUND * eps *
# (the leaf's largest magnitude) of the loop's (tests/_tolerance.py). Decode: 3 attention layers
# (a chain of sums: of dec_d = 16 for q, of 8 per head for the scores, of the 16 cached positions
# for the softmax and weights @ v, of 16 for o), over 3 steps that read what earlier ones wrote:
# 6 * (2 * 9 * 18.8 + 1) = 2,040 eps. The pattern: 5 layers of sums of d = 16 and pattern_hidden
# = 48 terms, grads summing 4 rows: 6 * (2 * 5 * (4 + 6.9) + 2) = 668 eps.
DECODE_BOUND = reassociation_bound(depth=3 * 3, width=(
    CFG.dec_d, CFG.dec_d // CFG.dec_heads, CFG.dec_cache, CFG.dec_cache, CFG.dec_d))
PATTERN_BOUND = reassociation_bound(depth=5, width=(CFG.d, CFG.pattern_hidden), summed=CFG.batch)
# The mlp block: 5 layers of sums of d = 16 and hidden = 32 terms, grads summing 4 rows.
MLP_BOUND = reassociation_bound(depth=5, width=(CFG.d, CFG.hidden), summed=CFG.batch)


@pytest.mark.parametrize("block", list(workloads.BLOCKS))
def test_rows_are_unique_and_their_references_exist(block):
    notes = []
    cases = workloads.cases(block, CFG, notes)
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), names
    assert workloads.LOOP in names and workloads.SCAN in names
    for case in cases:
        assert not case.tool or case.tool in names, (case.name, case.tool)
        assert case.remat in ("off", *workloads.REMATS, "nested")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_framework_has_the_same_rows(framework):
    pytest.importorskip("flax" if framework == "nnx" else framework)
    notes = []
    cases = [c for c in workloads.cases("transformer", CFG, notes) if c.framework == framework]
    adapter = f"stackwise.{framework}.Stack"
    # a loop; the tool at each remat, its control; the adapter at each remat, against the tool
    assert [c.remat for c in cases] == ["off", "off", "off", "dots", "layer", "off", "dots",
                                        "layer"], [c.name for c in cases]
    tool, control = cases[1], cases[2]
    assert control.name == f"{tool.name} (control)" and control.tool == tool.name
    tools = {c.remat: c.name for c in cases[1:5] if c is not control}
    for case in cases[5:]:
        assert case.name.startswith(adapter) and case.tool == tools[case.remat]


@pytest.mark.parametrize("block", ["decode", "prefill"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_decoding_rows_of_every_framework(block, framework):
    pytest.importorskip("flax" if framework == "nnx" else framework)
    cases = [c for c in workloads.cases(block, CFG, []) if c.framework == framework]
    adapter = f"stackwise.{framework}.Stack"
    # a loop, the tool and its control, the adapter and the adapter unrolled (what
    # Stacked.decode runs), both against the tool; no remat (no grad)
    assert [c.remat for c in cases] == ["off"] * 5, [c.name for c in cases]
    assert cases[2].name == f"{cases[1].name} (control)" and cases[3].name == adapter
    assert cases[4].name == f"{adapter} unroll=True"
    assert cases[3].tool == cases[4].tool == cases[1].name


def _by_framework(cases):
    """The cases of each framework, the first its Python loop (the reference)."""
    groups = {}
    for case in cases:
        groups.setdefault(case.framework, []).append(case)
    for rows in groups.values():
        assert rows[0].name == workloads.LOOP or rows[0].name.endswith(" loop"), rows[0].name
    return groups


def _layer_caches(state):
    """Every layer's key and value cache in a row's state, a stacked leaf split by layer."""
    out = []
    for leaf in jax.tree.leaves(state):
        a = np.asarray(leaf)
        out += list(a) if a.ndim == 5 else [a]  # [n, batch, length, heads, head size]
    return out


def _assert_same_caches(state, reference, name, bound=DECODE_BOUND):
    """Each of the loop's per-layer caches is in the row's state, once (the layouts differ:
    a list of layers, a dict of modules, stacked leaves), within ``bound``."""
    left = _layer_caches(state)
    expected = _layer_caches(reference)
    assert len(left) == len(expected), (name, len(left), len(expected))
    for i, want in enumerate(expected):
        found = [j for j, got in enumerate(left) if np.shape(got) == np.shape(want)
                 and compare(got, want)["in_eps"] <= bound]
        assert found, f"{name}: the loop's cache array {i} is not in the row's state"
        del left[found[0]]


@pytest.mark.slow
@pytest.mark.parametrize("block,dtype", [("decode", "float32"), ("prefill", "float32"),
                                         ("decode", "bfloat16")])
def test_decoding_rows_compute_what_their_loop_computes(block, dtype):
    """Each row's jitted step (the cache donated, as measured) gives its loop's outputs
    and updated caches, over steps that read what earlier steps wrote; in bfloat16
    (``--decode-dtype``) every row computes in it, within the same bound in its epsilon."""
    n, steps = 3, 3 if block == "decode" else 1  # decode: positions pos, pos + 1, pos + 2
    cfg = dataclasses.replace(CFG, dec_dtype=dtype)
    more = [np.random.default_rng(t).standard_normal((cfg.dec_batch, 1, cfg.dec_d), np.float32)
            .astype(jnp.dtype(dtype)) for t in range(1, steps)]  # the tokens after the first
    bound = DECODE_BOUND * float(jnp.finfo(dtype).eps / jnp.finfo(jnp.float32).eps)
    notes = []
    cases = workloads.cases(block, cfg, notes)
    assert not [note for note in notes if "skipped" in note and "stackwise" in note], notes
    for framework, rows in _by_framework(cases).items():
        outputs = {}
        for case in rows:
            params, state, x, step = case.build(n)
            floats = [a.dtype for a in jax.tree.leaves((params, state, x))
                      if jnp.issubdtype(a.dtype, jnp.floating)]
            assert set(floats) == {jnp.dtype(dtype)}, (case.name, set(floats))
            h, pos = x
            step = jax.jit(step, donate_argnums=1)
            ys = []
            for t, tokens in enumerate([h, *more]):
                y, state = step(params, state, (tokens, pos + t))
                assert y.dtype == jnp.dtype(dtype), (case.name, y.dtype)
                ys.append(np.asarray(y, np.float32))
            outputs[case.name] = ys, jax.tree.map(lambda a: np.asarray(a, np.float32), state)
        ref_ys, ref_state = outputs[rows[0].name]
        for name, (ys, state) in outputs.items():
            for t, (y, want) in enumerate(zip(ys, ref_ys)):
                assert_close(y, want, bound, what=f"{name}, step {t}")
            _assert_same_caches(state, ref_state, f"{framework}: {name}", bound)


def test_the_decode_dtypes_cast_frees_each_float32_state_array():
    """``--decode-dtype``'s cast: every floating leaf in the dtype with its values; each
    float32 state array deleted (so a large cache is never held twice; every step donates
    the state anyway), a state array already in the dtype kept as it is (the decode blocks
    make their caches so), params and input kept (builds may share them), integers as they
    were."""
    from stackwise.bench.workloads.common import in_dtype

    weights, cache, h = jnp.linspace(0.0, 1.0, 6).reshape(2, 3), jnp.ones((3,)), jnp.ones(2)
    made = jnp.zeros(4, jnp.bfloat16)
    step = object()
    built = in_dtype(lambda n: ({"w": weights}, {"c": cache, "made": made}, (h, np.int32(n)),
                                step), "bfloat16")
    params, state, (got_h, pos), got_step = built(5)
    assert cache.is_deleted() and not weights.is_deleted() and not h.is_deleted()
    assert state["made"] is made and not made.is_deleted()
    assert got_step is step and pos == 5 and pos.dtype == np.int32
    assert {a.dtype for a in jax.tree.leaves((params, state, got_h))} == {
        jnp.dtype(jnp.bfloat16)}
    # rounded as numpy rounds to bfloat16 (to nearest, ties to even): 0.2, 0.4, ... are inexact
    want = np.linspace(0.0, 1.0, 6, dtype=np.float32).reshape(2, 3).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(params["w"]), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_rows_make_their_cache_on_the_device_in_its_dtype(monkeypatch, dtype):
    """No decode row's build puts its cache through the host (a v5e host's 40 GiB ran out
    when the bench made caches in numpy and sliced them there): no array of a layer's cache
    size passes ``jax.device_put`` or ``np.asarray``, and every cache leaf is made in the
    decode dtype (none cast from float32)."""
    cfg = dataclasses.replace(CFG, dec_dtype=dtype, dec_cache=256)  # a layer's k: the largest
    one_layer = int(np.prod(workloads.common.cache_shape(cfg)))
    assert one_layer > 3 * 3 * cfg.dec_d * cfg.dec_d  # larger than every stacked param
    seen = []

    def watch(fn):
        def watched(a, *args, **kwargs):
            if np.size(a) >= one_layer:
                seen.append((fn.__name__, np.shape(a)))
            return fn(a, *args, **kwargs)
        return watched

    monkeypatch.setattr(jax, "device_put", watch(jax.device_put))
    monkeypatch.setattr(np, "asarray", watch(np.asarray))
    # the builds as made, without --decode-dtype's cast (which keeps a leaf in the dtype)
    monkeypatch.setattr(workloads.common, "in_dtype", lambda build, dtype: build)
    for case in workloads.cases("decode", cfg, []):
        seen.clear()
        _, state, _, _ = case.build(3)
        assert not seen, (case.name, seen)
        caches = [a for a in jax.tree.leaves(state) if np.size(a) >= one_layer]
        assert len(caches) in (2, 6), (case.name, len(caches))  # k and v: stacked or per layer
        assert {a.dtype for a in caches} == {jnp.dtype(dtype)}, case.name
        assert not any(a.is_deleted() for a in caches), case.name


@pytest.mark.slow
def test_pattern_rows_compute_what_the_loop_computes():
    n, k = 5, 3  # a pattern [a, a, b]: one whole repeat, then a and a
    cases = workloads.cases("pattern", CFG, [])
    assert cases[0].name == workloads.LOOP
    loop_params, x, loop_loss = cases[0].build(n)
    want, loop_grads = jax.value_and_grad(loop_loss)(loop_params, x)
    # the loop's per-layer gradients in the stack's layout: position p holds p, p+k, ...
    want_grads = tuple(stackwise.stack_layers(loop_grads[p::k]) for p in range(k))
    for case in cases[1:]:
        params, x, loss = case.build(n)
        assert jax.tree.structure(params) == jax.tree.structure(want_grads), case.name
        value, grads = jax.jit(jax.value_and_grad(loss))(params, x)
        assert_close({"loss": value, "grads": grads}, {"loss": want, "grads": want_grads},
                     PATTERN_BOUND, what=case.name)


# The transformer block at CFG's sizes: 5 layers of a norm, qkv and out (sums of tf_d), the
# scores (of a head's size), softmax and weights @ v (of the sequence), fc1 (tf_d) and fc2
# (tf_hidden); grads summing the batch's tokens.
TRANSFORMER_BOUND = reassociation_bound(depth=5, width=(
    CFG.tf_d, CFG.tf_d, CFG.tf_d // CFG.tf_heads, CFG.tf_seq, CFG.tf_d, CFG.tf_d, CFG.tf_d,
    CFG.tf_hidden), summed=CFG.tf_batch * CFG.tf_seq)


@pytest.mark.parametrize("block", ["mlp", "transformer"])
def test_pure_jax_rows_compute_what_the_loop_computes(block):
    """Every pure-JAX row of the mlp and transformer blocks, the autostacked loop among them,
    gives the loop's loss and grads (the grads in the stacked layout; autostack's
    ``{"blocks", "rest"}`` read by its paths, the whole depth stacked)."""
    n = 5
    bound = {"mlp": MLP_BOUND, "transformer": TRANSFORMER_BOUND}[block]
    cases = [c for c in workloads.cases(block, CFG, []) if c.framework == "jax"]
    assert cases[0].name == workloads.LOOP and cases[-1].name == "stackwise.autostack"
    loop_params, x, loop_loss = cases[0].build(n)
    want, loop_grads = jax.value_and_grad(loop_loss)(loop_params, x)
    want_grads = stackwise.stack_layers(loop_grads)
    for case in cases[1:]:
        params, x, loss = case.build(n)
        value, grads = jax.jit(jax.value_and_grad(loss))(params, x)
        if case.name == "stackwise.autostack":
            assert loss.found.n == n, loss.found
            assert loss.found.params == len(jax.tree.leaves(want_grads)), loss.found
            paths = jax.tree_util.tree_flatten_with_path(want_grads)[0]
            grads = jax.tree.unflatten(jax.tree.structure(want_grads), [
                grads["blocks"][f"[0]{jax.tree_util.keystr(path)}"] for path, _ in paths])
        assert jax.tree.structure(grads) == jax.tree.structure(want_grads), case.name
        assert_close({"loss": value, "grads": grads}, {"loss": want, "grads": want_grads},
                     bound, what=case.name)


@pytest.mark.slow
def test_the_harness_gives_each_step_the_state_the_last_one_returned():
    # the cache is donated: a step given a state that an earlier call consumed would raise
    cfg = BenchConfig.quick(blocks=("decode",), variants=("jax",), rounds=3)
    notes = []
    results, notes = run_benchmark(cfg, progress=False, log=notes.append)
    assert {r.variant for r in results} == {
        workloads.LOOP, workloads.SCAN, "lax.scan (cache in carry)", "stackwise",
        "stackwise serving layout", "stackwise unroll=True"}, notes
    layer_cache = CFG.dec_batch * CFG.dec_cache * CFG.dec_d  # [batch, length, heads, size]
    cache_bytes = 2 * 2 * layer_cache * 4  # k and v of 2 layers, float32
    for r in results:
        assert len(r.step_samples) == 3 and r.state_bytes == cache_bytes, r


def test_selection_by_name_or_framework():
    cases = workloads.cases("transformer", CFG, [])
    haiku = workloads.select(cases, ["haiku"])
    assert {c.framework for c in haiku} == {"haiku"} and len(haiku) == 8
    assert [c.name for c in workloads.select(cases, ["STACKWISE REMAT"])] == ["stackwise remat"]
    assert workloads.select(cases, []) == cases


def test_missing_framework_or_adapter_is_skipped_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "haiku", None)  # `import haiku` now raises ImportError
    monkeypatch.setitem(sys.modules, "stackwise.nnx", None)
    # as in a fresh process, where the Haiku workload module was never imported
    monkeypatch.delitem(sys.modules, "stackwise.bench.workloads.haiku", raising=False)
    notes = []
    names = [c.name for c in workloads.cases("transformer", CFG, notes)]
    assert not any(name.startswith(("hk", "stackwise.haiku")) for name in names)
    assert "nnx.scan" in names and "stackwise.nnx.Stack" not in names
    assert any(note.startswith("haiku: not installed") for note in notes)
    assert any(note.startswith("stackwise.nnx: not importable") for note in notes)


def test_a_selection_of_missing_rows_says_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "haiku", None)
    monkeypatch.delitem(sys.modules, "stackwise.bench.workloads.haiku", raising=False)
    cfg = BenchConfig.quick(blocks=("transformer",), variants=("haiku",))
    with pytest.raises(ValueError, match=r"(?s)no variant.*haiku: not installed.*nn.scan"):
        run_benchmark(cfg, progress=False, log=lambda _: None)


@pytest.mark.slow
def test_haiku_rows_barriers_and_same_program():
    pytest.importorskip("haiku")
    pytest.importorskip("stackwise.haiku")
    cfg = BenchConfig.quick(
        blocks=("transformer",), rounds=1, variants=("hk.layer_stack", "stackwise.haiku.Stack"),
    )
    notes = []
    results, notes = run_benchmark(cfg, progress=False, log=notes.append)
    by = {r.variant: r for r in results}
    assert set(by) == {
        "hk.layer_stack", "hk.layer_stack (control)", "hk.layer_stack+hk.remat(dots)",
        "hk.layer_stack+hk.remat", "stackwise.haiku.Stack", "stackwise.haiku.Stack default",
        "stackwise.haiku.Stack remat",
    }, notes
    # hk.remat keeps prevent_cse=True inside the scan: every layer's params pass a barrier
    for tool in ("hk.layer_stack+hk.remat", "hk.layer_stack+hk.remat(dots)"):
        assert by[tool].barrier_param_bytes > 0
    for adapter in ("stackwise.haiku.Stack default", "stackwise.haiku.Stack remat"):
        assert by[adapter].barrier_param_bytes == 0
        assert by[adapter].ops_unlike_tool > 0  # the barriers differ
    # without remat the adapter compiles to hk.layer_stack's program, names aside
    assert by["stackwise.haiku.Stack"].ops_unlike_tool == 0
    assert by["hk.layer_stack (control)"].ops_unlike_tool == 0
    adapter = by["stackwise.haiku.Stack remat"]
    assert adapter.tool == "hk.layer_stack+hk.remat"
    assert adapter.compile_vs_tool == pytest.approx(
        adapter.compile_s / by["hk.layer_stack+hk.remat"].compile_s)


@pytest.mark.slow
def test_equinox_rows_of_both_blocks_barriers_and_same_program():
    pytest.importorskip("equinox")
    pytest.importorskip("stackwise.equinox")
    tools = ["filter_vmap+scan", "filter_vmap+scan+checkpoint(dots)",
             "filter_vmap+scan+checkpoint"]
    adapters = ["stackwise.equinox.Stack", "stackwise.equinox.Stack default",
                "stackwise.equinox.Stack remat"]
    for block in ("mlp", "transformer"):  # the same skeleton as every framework's rows
        cases = [c for c in workloads.cases(block, CFG, []) if c.framework == "equinox"]
        assert [c.name for c in cases] == ["eqx loop", tools[0], f"{tools[0]} (control)",
                                           *tools[1:], *adapters], block
        assert [c.tool for c in cases[5:]] == tools
    cfg = BenchConfig.quick(blocks=("mlp",), ns=(2,), rounds=1, variants=("equinox",))
    results, notes = run_benchmark(cfg, progress=False, log=lambda _: None)
    by = {r.variant: r for r in results}
    assert set(by) == {"eqx loop", f"{tools[0]} (control)", *tools, *adapters}, notes
    # eqx.filter_checkpoint keeps prevent_cse=True inside the scan: params pass barriers
    for tool in tools[1:]:
        assert by[tool].barrier_param_bytes > 0
    for adapter in adapters[1:]:
        assert by[adapter].barrier_param_bytes == 0
    # without remat the adapter compiles to the hand-written program, names aside
    assert by["stackwise.equinox.Stack"].ops_unlike_tool == 0
    assert by[f"{tools[0]} (control)"].ops_unlike_tool == 0
    remat = by["stackwise.equinox.Stack remat"]
    assert remat.tool == tools[2]
    assert remat.compile_vs_tool == pytest.approx(remat.compile_s / by[tools[2]].compile_s)

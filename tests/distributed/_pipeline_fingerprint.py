"""A fingerprint of the pipelines' compiled programs: run before and after a refactor of
``stackwise/_pipeline`` to show that nothing changed.

For each representative configuration (GPipe, circular, 1F1B, interleaved 1F1B, a
pattern, state, FSDP gathered per step and per tick, explicit and auto mesh axes) it
compiles the training step (``jax.value_and_grad`` of a loss of the pipeline, or of the
1F1B pipeline's own loss) and, for 1F1B and state, the forward alone, and records the
collectives (count per kind and loop depth, ``_hlo.collectives``), the compiled
``memory_analysis()`` temp size, and a SHA-256 of every output's bytes (with the largest
absolute value, to read a difference by). Run on 8 simulated CPU devices with the test
suite's XLA flags::

    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 \
      --xla_cpu_use_fusion_emitters=false" JAX_PLATFORMS=cpu \
      .venv/bin/python tests/distributed/_pipeline_fingerprint.py OUT.json

and compare two such files with ``... _pipeline_fingerprint.py --compare A.json B.json``.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _hlo import collectives  # noqa: E402

import stackwise  # noqa: E402

D = 8


def _init(key):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (D, D)) / D**0.5, "b": 0.1 * jax.random.normal(k2, (D,))}


def _apply(params, x, scale=1.0):
    return x + scale * jnp.tanh(x @ params["w"] + params["b"][None, :])


def _aux_apply(params, x):
    y = _apply(params, x)
    return y, jnp.sum(y**2)


def _scale_init(key):
    return {"s": 1.0 + 0.1 * jax.random.normal(key, (D,))}


def _scale(params, x):
    return x * params["s"][None, :]


def _counted(key):
    return _init(key), {"calls": jnp.zeros((), jnp.float32)}


def _counting(params, state, x):
    return _apply(params, x), {"calls": state["calls"] + jnp.mean(x)}


def _cache_init(key):
    return _init(key), {"kv": jnp.zeros((16, D))}


def _caching(params, state, x):
    y = _apply(params, x)
    return y, {"kv": state["kv"] + y}


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def _meshes():
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    return {
        "auto": Mesh(devices, ("stage", "data")),
        "explicit": jax.make_mesh((4, 2), ("stage", "data")),
    }


def _digest(tree) -> dict:
    leaves = [np.asarray(v) for v in jax.tree.leaves(jax.device_get(tree))]
    h = hashlib.sha256()
    for v in leaves:
        h.update(str((v.shape, v.dtype)).encode())
        h.update(np.ascontiguousarray(v).tobytes())
    big = max((float(np.max(np.abs(v))) for v in leaves if v.size), default=0.0)
    return {"sha256": h.hexdigest(), "max_abs": big}


def _facts(fn, *args) -> dict:
    compiled = jax.jit(fn).lower(*args).compile()
    found = collectives(compiled.as_text())
    counts = collections.Counter(f"{op}@{depth}" for op, _, depth in found)
    return {
        "collectives": dict(sorted(counts.items())),
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "outputs": _digest(compiled(*args)),
    }


def _step_facts(pp, schedule: str, params) -> dict:
    """The training step's facts (and the forward's, for 1F1B, whose apply is its own loss)."""
    x = jax.random.normal(jax.random.key(1), (16, D))
    if schedule == "1f1b":
        t = jax.random.normal(jax.random.key(2), (16, D))
        out = {"grad": _facts(jax.value_and_grad(pp.apply, argnums=(0, 1)), params, x, t)}
        out["forward"] = _facts(pp.apply, params, x, t)
        return out
    loss = lambda p, v: _sin_sum(pp.apply(p, v))  # noqa: E731
    return {"grad": _facts(jax.value_and_grad(loss, argnums=(0, 1)), params, x)}


def _sin_sum(tree):
    return sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(tree))


def _params(n, mesh_kind, mesh, repeats=1, fsdp=False):
    params = jax.jit(stackwise.stack(_init, _apply, n).init)(jax.random.key(0))
    if mesh_kind != "explicit":
        return params
    specs = stackwise.fsdp_specs(params, mesh, "data") if fsdp else None
    return stackwise.shard_stacked(params, mesh, specs, layer_axis="stage", repeats=repeats)


def _plain(mesh_kind, schedule="gpipe", repeats=None, fsdp=None, gather="step", **options):
    mesh = _meshes()[mesh_kind]
    data = None if fsdp else "data"
    pp = stackwise.pipeline(
        _init,
        _apply,
        8,
        mesh,
        microbatches=4,
        data_axis=data,
        schedule=schedule,
        repeats=repeats,
        fsdp=fsdp,
        fsdp_gather=gather,
        loss=_mse if schedule == "1f1b" else None,
        **options,
    )
    params = _params(8, mesh_kind, mesh, repeats or 1, fsdp=bool(fsdp))
    return _step_facts(pp, schedule, params)


def _with_args(mesh_kind):
    """Per-layer scales, a per-example mask and an unmarked array, with has_aux."""
    mesh = _meshes()[mesh_kind]

    def apply(params, x, scale, mask, bias):
        y = _apply(params, x, scale) * mask[:, None] + bias
        return y, jnp.sum(y)

    pp = stackwise.pipeline(
        _init,
        apply,
        8,
        mesh,
        microbatches=4,
        data_axis="data",
        schedule="circular",
        repeats=2,
        has_aux=True,
    )
    params = _params(8, mesh_kind, mesh, 2)
    x = jax.random.normal(jax.random.key(1), (16, D))
    scales = stackwise.per_layer(jnp.linspace(0.5, 1.5, 8))
    mask = stackwise.per_example(jnp.linspace(0.0, 1.0, 16))
    bias = jnp.full((D,), 0.01)

    def loss(p, v):
        y, aux = pp.apply(p, v, scales, mask, bias)
        return _sin_sum(y) + jnp.sum(aux)

    return {"grad": _facts(jax.value_and_grad(loss, argnums=(0, 1)), params, x)}


def _pattern(mesh_kind, schedule="gpipe", repeats=None, fsdp=None, gather="step"):
    """A pattern of 3 (stage boundaries cut it), n=8."""
    mesh = _meshes()[mesh_kind]
    inits, applies = [_init, _scale_init, _init], [_apply, _scale, _apply]
    pp = stackwise.pipeline(
        inits,
        applies,
        8,
        mesh,
        microbatches=4,
        data_axis="data",
        schedule=schedule,
        repeats=repeats,
        fsdp=fsdp,
        fsdp_gather=gather,
        loss=_mse if schedule == "1f1b" else None,
        remat=True,
    )
    params = jax.jit(stackwise.stack(inits, applies, 8).init)(jax.random.key(0))
    if mesh_kind == "explicit":
        specs = stackwise.fsdp_specs(params, mesh, "data") if fsdp else None
        params = stackwise.shard_stacked(params, mesh, specs)
    return _step_facts(pp, schedule, params)


def _state(mesh_kind, batched, schedule="gpipe", repeats=None, pattern=False):
    mesh = _meshes()[mesh_kind]
    one = (_cache_init, _caching) if batched else (_counted, _counting)
    inits, applies = ([one[0], _scale_init_state], [one[1], _scale_state]) if pattern else one
    pp = stackwise.pipeline(
        inits,
        applies,
        8,
        mesh,
        microbatches=4,
        data_axis="data" if batched else None,
        schedule=schedule,
        repeats=repeats,
        with_state=True,
        batched_state=batched,
        loss=_mse if schedule == "1f1b" else None,
    )
    params, state = jax.jit(stackwise.stack(inits, applies, 8, with_state=True).init)(
        jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (16, D))
    if schedule == "1f1b":
        t = jax.random.normal(jax.random.key(2), (16, D))
        step = jax.value_and_grad(pp.apply, argnums=(0, 2), has_aux=True)
        return {
            "grad": _facts(step, params, state, x, t),
            "forward": _facts(pp.apply, params, state, x, t),
        }

    def loss(p, s, v):
        y, new = pp.apply(p, s, v)
        return _sin_sum(y), new

    step = jax.value_and_grad(loss, argnums=(0, 2), has_aux=True)
    return {"grad": _facts(step, params, state, x), "forward": _facts(pp.apply, params, state, x)}


def _scale_init_state(key):
    return _scale_init(key), None


def _scale_state(params, state, x):
    return _scale(params, x), state


CASES = {
    "gpipe_auto": lambda: _plain("auto"),
    "gpipe_explicit_remat": lambda: _plain("explicit", remat=True),
    "gpipe_aux_unroll": lambda: _plain("auto", remat=True, unroll=True, has_aux=False),
    "circular_auto": lambda: _plain("auto", "circular", 2),
    "circular_explicit_remat": lambda: _plain("explicit", "circular", 2, remat=True),
    "circular_unroll": lambda: _plain("auto", "circular", 2, unroll=True),
    "circular_args_aux": lambda: _with_args("auto"),
    "circular_args_aux_explicit": lambda: _with_args("explicit"),
    "1f1b_auto": lambda: _plain("auto", "1f1b"),
    "1f1b_explicit_remat": lambda: _plain("explicit", "1f1b", remat=True),
    "interleaved_auto": lambda: _plain("auto", "1f1b", 2),
    "interleaved_explicit": lambda: _plain("explicit", "1f1b", 2),
    "fsdp_step_gpipe": lambda: _plain("explicit", fsdp="data", remat=True),
    "fsdp_tick_gpipe": lambda: _plain("explicit", fsdp="data", gather="tick", remat=True),
    "fsdp_step_circular": lambda: _plain("explicit", "circular", 2, fsdp="data", remat=True),
    "fsdp_tick_circular": lambda: _plain(
        "explicit", "circular", 2, fsdp="data", gather="tick", remat=True
    ),
    "fsdp_step_1f1b": lambda: _plain("explicit", "1f1b", fsdp="data"),
    "fsdp_tick_interleaved": lambda: _plain("explicit", "1f1b", 2, fsdp="data", gather="tick"),
    "pattern_gpipe_auto": lambda: _pattern("auto"),
    "pattern_gpipe_explicit": lambda: _pattern("explicit"),
    "pattern_circular": lambda: _pattern("explicit", "circular", 2),
    "pattern_1f1b": lambda: _pattern("explicit", "1f1b"),
    "pattern_interleaved": lambda: _pattern("auto", "1f1b", 2),
    "pattern_fsdp_step": lambda: _pattern("explicit", fsdp="data"),
    "pattern_fsdp_tick_circular": lambda: _pattern("explicit", "circular", 2, "data", "tick"),
    "state_batched_gpipe": lambda: _state("auto", True),
    "state_unbatched_circular": lambda: _state("explicit", False, "circular", 2),
    "state_pattern_1f1b": lambda: _state("explicit", False, "1f1b", pattern=True),
    "state_batched_interleaved": lambda: _state("auto", True, "1f1b", 2),
}


def _compare(a_path: str, b_path: str) -> int:
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    bad = 0
    for name in sorted(set(a) | set(b)):
        same = a.get(name) == b.get(name)
        bad += not same
        print(f"{'same' if same else 'DIFFERENT'}  {name}")
        if not same:
            print("   before:", json.dumps(a.get(name)))
            print("   after: ", json.dumps(b.get(name)))
    print(f"{len(set(a) | set(b)) - bad} same, {bad} different")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compare"]:
        return _compare(argv[1], argv[2])
    out, only = argv[0], set(argv[1:])
    results = {}
    for name, case in CASES.items():
        if only and name not in only:
            continue
        results[name] = case()
        print(name, json.dumps(results[name])[:200], file=sys.stderr, flush=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

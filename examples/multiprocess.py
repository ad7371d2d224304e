"""One SGD step of a stacked transformer on 8 CPU devices owned by 1, 2 or 4 JAX processes.

    python examples/multiprocess.py --processes 2     # starts 2 processes here, 4 devices each

or start each process yourself, as on several hosts (here two, on this machine):

    python examples/multiprocess.py --process-id 0 --num-processes 2 --coordinator 127.0.0.1:8476 &
    python examples/multiprocess.py --process-id 1 --num-processes 2 --coordinator 127.0.0.1:8476

Every process runs this same script: it meets the others with ``jax.distributed.initialize``
(process 0 listens at ``--coordinator``), owns ``8 / N`` CPU devices, and CPU collectives
across processes go through gloo (``jax_cpu_collectives_implementation``). The global mesh has
three axes, ``(data=2, stage=2, model=2)``, and the model uses all three:

  * an embedding (tied with the output head) and 4 blocks ``stackwise.stack(..., fsdp="data")``:
    FSDP over ``data``, each layer's weights gathered inside the scan, one layer at a time;
  * 4 more blocks ``stackwise.pipeline(..., data_axis="data")``: 2 stages over ``stage``, 2
    microbatches, the activations handed from stage to stage with ``ppermute``;
  * tensor parallelism over ``model`` in every block (Megatron-style: attention heads and the
    MLP's hidden units split, one all-reduce after each of the two).

Nothing global is built on one host: the params are born sharded (``jax.jit(init,
out_shardings=...)``) and each device's rows of the batch are made by a callback that builds
only those rows (``jax.make_array_from_callback``). The step computes the loss and ``jax.grad``,
takes one SGD step and the loss after it. Every process then gets the whole results
(one program that replicates them on every device, as ``multihost_utils.process_allgather``
does leaf by leaf); ``--out DIR`` has each write its view (``process_<i>.npz``: the loss, the
loss after the step, the initial params and the gradients; ``process_<i>.json``: what the
process holds). The same numbers come out of 1, 2 and 4 processes
(``tests/distributed/test_multiprocess.py``).

On an 8-device mesh, ``make_mesh``'s order puts the ``data`` axis across processes when there
are 2 and both ``data`` and ``stage`` across them when there are 4: then the FSDP gathers,
the gradients' reductions and the pipeline's ``ppermute`` all cross process boundaries.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time

# --------------------------------------------------------------------------
# The command line: one process, or a launcher of N on this machine.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--processes",
        type=int,
        choices=(1, 2, 4, 8),
        help="start this many processes here, 8 / N CPU devices each",
    )
    p.add_argument("--process-id", type=int, help="run one process: its index, 0 to N - 1")
    p.add_argument(
        "--num-processes",
        type=int,
        choices=(1, 2, 4, 8),
        help="run one process: N, the number of them",
    )
    p.add_argument("--coordinator", help="run one process: HOST:PORT where process 0 listens")
    p.add_argument(
        "--out",
        type=pathlib.Path,
        help="a folder for each process's results (--processes: a new temporary one)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="--processes: seconds before every process is killed (default 300)",
    )
    args = p.parse_args(argv)
    one = {
        "--process-id": args.process_id,
        "--num-processes": args.num_processes,
        "--coordinator": args.coordinator,
    }
    if args.processes is not None:
        if given := [k for k, v in one.items() if v is not None]:
            p.error(
                f"--processes starts every process itself; {', '.join(given)} is for "
                "running one process of a run: leave it out, or leave out --processes"
            )
    elif missing := [k for k, v in one.items() if v is None]:
        p.error(
            f"give --processes N (N processes here), or --process-id, --num-processes and "
            f"--coordinator (one process of N); {', '.join(missing)} is missing"
        )
    else:
        if not 0 <= args.process_id < args.num_processes:
            p.error(
                f"--process-id {args.process_id} is not one of 0 to "
                f"{args.num_processes - 1} (--num-processes {args.num_processes})"
            )
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit():
            p.error(f"--coordinator {args.coordinator!r} is not HOST:PORT, e.g. 127.0.0.1:8476")
    if not args.timeout > 0:
        p.error(f"--timeout {args.timeout:g}: expected a positive number of seconds")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        p.error(f"--out {str(args.out)!r} is a file; give a folder (it is made if missing)")
    if args.out is not None and (folder := unwritable_parent(args.out)):
        p.error(f"--out {str(args.out)!r}: cannot make it ({str(folder)!r} is not a writable "
                "folder); give a folder in one you can write")
    return args


def unwritable_parent(path: pathlib.Path) -> pathlib.Path | None:
    """The closest existing folder above ``path`` if it is not a writable folder (a regular
    file, say), else None: the missing folders below it are made."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK):
        return None
    return folder


# The command line above needs only the standard library: run as a script, --help and argument
# errors answer before JAX is imported (seconds, not a minute on a busy machine).
if __name__ == "__main__":
    parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import stackwise  # noqa: E402

DEVICES = 8  # the global mesh: (data=2, stage=2, model=2)
MESH_SHAPE, MESH_AXES = (2, 2, 2), ("data", "stage", "model")
VOCAB, D, HEADS, HEAD_DIM, HIDDEN = 32, 16, 2, 8, 32
SEQ, BATCH = 8, 8
N_FSDP, N_PIPELINE = 4, 4  # blocks in the FSDP stack, blocks in the pipeline
MICROBATCHES, LR = 2, 0.5

#: One block's weights: (shape, fan-in).
WEIGHTS = {
    "q": ((D, HEADS, HEAD_DIM), D),
    "k": ((D, HEADS, HEAD_DIM), D),
    "v": ((D, HEADS, HEAD_DIM), D),
    "o": ((HEADS, HEAD_DIM, D), HEADS * HEAD_DIM),
    "up": ((D, HIDDEN), D),
    "down": ((HIDDEN, D), HIDDEN),
}
#: One block's tensor-parallel specs (per layer: the layer axis is added by stackwise).
TP_SPECS = {
    "attn": {"q": P(None, "model"), "k": P(None, "model"), "v": P(None, "model"), "o": P("model")},
    "mlp": {"up": P(None, "model"), "down": P("model")},
    "norm1": P(),
    "norm2": P(),
}


# --------------------------------------------------------------------------
# The model: pure functions of the params.


def block_init(key: jax.Array) -> dict:
    """One pre-norm transformer block: attention with HEADS heads, then an MLP.

    One normal draw for all of the block's weights, cut into them and scaled by
    1/sqrt(fan-in): one random-number program rather than six, which halves the init's compile.
    """
    sizes = [math.prod(shape) for shape, _ in WEIGHTS.values()]
    draws = jnp.split(jax.random.normal(key, (sum(sizes),)), np.cumsum(sizes)[:-1])
    w = {
        name: z.reshape(shape) / fan_in**0.5
        for (name, (shape, fan_in)), z in zip(WEIGHTS.items(), draws)
    }
    return {
        "attn": {name: w[name] for name in ("q", "k", "v", "o")},
        "mlp": {"up": w["up"], "down": w["down"]},
        "norm1": jnp.ones(D),
        "norm2": jnp.ones(D),
    }


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6) * scale[None, None]


def block_apply(params: dict, x: jax.Array) -> jax.Array:
    """``x: (batch, seq, D) -> (batch, seq, D)``; heads and hidden units split over "model"."""
    # A contraction over the split heads or hidden units is summed over "model": on explicit
    # mesh axes its output's sharding is spelled out (x's own, replicated over "model").
    like_x = jax.typeof(x).sharding
    a = params["attn"]
    h = rms_norm(x, params["norm1"])
    q, k, v = (jnp.einsum("btd,dhk->bthk", h, a[name]) for name in ("q", "k", "v"))
    scores = jnp.einsum("bthk,bshk->bhts", q, k) / HEAD_DIM**0.5
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    weights = jax.nn.softmax(jnp.where(causal[None, None], scores, -1e9), axis=-1)
    heads = jnp.einsum("bhts,bshk->bthk", weights, v)
    x = x + jnp.einsum("bthk,hkd->btd", heads, a["o"], out_sharding=like_x)
    h = jax.nn.gelu(jnp.einsum("btd,df->btf", rms_norm(x, params["norm2"]), params["mlp"]["up"]))
    return x + jnp.einsum("btf,fd->btd", h, params["mlp"]["down"], out_sharding=like_x)


def model_init(key: jax.Array) -> dict:
    k_embed, k_fsdp, k_pipe = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k_embed, (VOCAB, D)) / D**0.5,
        "fsdp_blocks": stackwise.stack(block_init, block_apply, N_FSDP).init(k_fsdp),
        "pipeline_blocks": stackwise.stack(block_init, block_apply, N_PIPELINE).init(k_pipe),
        "norm": jnp.ones(D),
    }


def next_token_loss(params: dict, tokens: jax.Array, blocks) -> jax.Array:
    """Mean cross-entropy of each next token; ``blocks(params, x) -> x`` runs all 8 blocks."""
    x = jnp.einsum("btv,vd->btd", jax.nn.one_hot(tokens, VOCAB), params["embed"])
    x = rms_norm(blocks(params, x), params["norm"])
    logits = jnp.einsum("btd,vd->btv", x, params["embed"])
    labels = jax.nn.one_hot(tokens[:, 1:], VOCAB)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits[:, :-1]) * labels, axis=-1))


def batch_rows(rows: range) -> np.ndarray:
    """Rows ``rows`` of the global batch of token ids, each from its own seed: any process
    builds exactly the rows its devices hold, and the same rows whatever the process count."""
    return np.stack([np.random.default_rng(r).integers(0, VOCAB, SEQ) for r in rows]).astype(
        np.int32
    )


def loop_loss(params: dict, tokens: jax.Array) -> jax.Array:
    """The reference: a plain Python loop over the per-layer params, on one device."""

    def blocks(params, x):
        for name in ("fsdp_blocks", "pipeline_blocks"):
            for p in stackwise.unstack_layers(params[name]):
                x = block_apply(p, x)
        return x

    return next_token_loss(params, tokens, blocks)


# --------------------------------------------------------------------------
# The step on the global mesh.


def build(mesh: jax.sharding.Mesh):
    """The sharded model on ``mesh``: ``(init, step)``, both jitted.

    ``init(key) -> params``, born sharded; ``step(params, tokens) -> (params, loss, grads)``,
    one SGD step.
    """
    fsdp = stackwise.stack(block_init, block_apply, N_FSDP, fsdp="data")
    pipeline = stackwise.pipeline(
        block_init, block_apply, N_PIPELINE, mesh, microbatches=MICROBATCHES, data_axis="data"
    )
    abstract = jax.eval_shape(model_init, jax.random.key(0))
    fsdp_specs = stackwise.fsdp_specs(abstract["fsdp_blocks"], mesh, "data", base=TP_SPECS)
    shardings = {
        "embed": NamedSharding(mesh, P()),
        "fsdp_blocks": stackwise.stacked_shardings(mesh, fsdp_specs),
        "pipeline_blocks": stackwise.stacked_shardings(mesh, TP_SPECS, layer_axis="stage"),
        "norm": NamedSharding(mesh, P()),
    }

    def blocks(params, x):
        return pipeline.apply(params["pipeline_blocks"], fsdp.apply(params["fsdp_blocks"], x))

    def step(params, tokens):
        loss, grads = jax.value_and_grad(next_token_loss)(params, tokens, blocks)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss, grads

    return jax.jit(model_init, out_shardings=shardings), jax.jit(step)


def global_batch(mesh: jax.sharding.Mesh) -> jax.Array:
    """The batch split over "data" and "stage" (the pipeline's output is split so too), each
    device's rows built by the callback for its index."""
    sharding = NamedSharding(mesh, P(("data", "stage")))
    return jax.make_array_from_callback(
        (BATCH, SEQ), sharding, lambda index: batch_rows(range(BATCH)[index[0]])
    )


def run_process(out: pathlib.Path | None) -> dict:
    """This process's part of the run: one SGD step; returns what the process holds and got.

    With ``out``, writes ``process_<i>.npz`` (the gathered loss, loss after the step, initial
    params and gradients, keys ``params[...]`` / ``grads[...]`` by leaf path) and
    ``process_<i>.json`` (the returned view).
    """
    mesh = jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(AxisType.Explicit,) * 3)
    init, step = build(mesh)
    params = init(jax.random.key(0))
    tokens = global_batch(mesh)
    compiled = step.lower(params, tokens).compile()
    new_params, loss, grads = compiled(params, tokens)
    _, loss_after, _ = compiled(new_params, tokens)  # the same program: params keep their layout
    # Every process takes part in the gather (one program: each result replicated on every
    # device, as multihost_utils.process_allgather does leaf by leaf), and each gets it whole.
    replicate = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))
    results = {"params": params, "grads": grads, "loss": loss, "loss_after_step": loss_after}
    gathered = jax.tree.map(np.asarray, replicate(results))
    held = {d: 0 for d in jax.local_devices()}  # param bytes each of this process's devices holds
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    pid = jax.process_index()
    view = {
        "process": pid,
        "processes": jax.process_count(),
        "devices": [jax.local_device_count(), jax.device_count()],
        # The process that owns each device of the mesh, indexed [data][stage][model].
        "mesh_processes": np.vectorize(lambda d: d.process_index)(mesh.devices).tolist(),
        "batch_rows": sorted(
            {r for s in tokens.addressable_shards for r in range(BATCH)[s.index[0]]}
        ),
        "param_bytes_per_device": max(held.values()),
        "param_bytes": sum(a.nbytes for a in jax.tree.leaves(params)),
        "collectives": collectives(compiled.as_text()),
        "loss": float(gathered["loss"]),
        "loss_after_step": float(gathered["loss_after_step"]),
    }
    if out is not None:
        arrays = {
            f"{kind}{jax.tree_util.keystr(path)}": np.asarray(leaf)
            for kind in ("params", "grads")
            for path, leaf in jax.tree_util.tree_leaves_with_path(gathered[kind])
        }
        np.savez(
            out / f"process_{pid}.npz",
            loss=gathered["loss"],
            loss_after_step=gathered["loss_after_step"],
            **arrays,
        )
        (out / f"process_{pid}.json").write_text(json.dumps(view))
    return view


def collectives(hlo: str) -> dict[str, int]:
    """How many of each collective a compiled program (its text) holds."""
    ops = re.findall(
        r" (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)"
        r"(?:-start)?\(",
        hlo,
    )
    return {op: ops.count(op) for op in sorted(set(ops))}


# --------------------------------------------------------------------------
# The launcher of N processes on this machine, and what each process runs.


class Processes:
    """N processes of this script on this machine, started at once; ``wait`` for their views.

    Each process's output goes to ``out/process_<i>.log``, its results to
    ``out/process_<i>.{npz,json}``. ``env``: the processes' environment (default: this one's).
    ``script``: another script to run instead, which takes the same four options (``--out``
    and one process's three), calls :func:`join` and writes ``out/process_<i>.json``.
    """

    def __init__(self, processes: int, out: pathlib.Path, env: dict | None = None,
                 script: str | pathlib.Path | None = None):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.started, self.children = out, time.monotonic(), []
        with socket.socket() as s:  # a free port for the coordinator (process 0)
            s.bind(("127.0.0.1", 0))
            self.coordinator = f"127.0.0.1:{s.getsockname()[1]}"
        for i in range(processes):
            argv = [
                sys.executable,
                str(script or __file__),
                "--process-id",
                str(i),
                "--num-processes",
                str(processes),
                "--coordinator",
                self.coordinator,
                "--out",
                str(out),
            ]
            with open(out / f"process_{i}.log", "w") as log:
                self.children.append(
                    subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
                )

    def kill(self) -> None:
        """Kills every process still running."""
        for c in self.children:
            if c.poll() is None:
                c.kill()
                c.wait()

    def wait(self, timeout: float) -> list[dict]:
        """Each process's view, once all have exited. If one fails, or ``timeout`` seconds
        after the start some still run, kills the others and raises RuntimeError with the
        failed processes' logs."""
        running = lambda: [c for c in self.children if c.poll() is None]  # noqa: E731
        while running() and not any(c.returncode for c in self.children):
            if time.monotonic() > self.started + timeout:
                break
            time.sleep(0.05)
        late = bool(running())
        self.kill()
        failed = [i for i, c in enumerate(self.children) if c.returncode]
        if failed:
            logs = "\n".join(
                f"--- process {i} (exit status {self.children[i].returncode}):\n"
                + (self.out / f"process_{i}.log").read_text()[-3000:]
                for i in failed
            )
            what = (f"still running {timeout:g} s after the start, killed (a longer --timeout "
                    "gives them more time)") if late else "failed"
            raise RuntimeError(
                f"{len(self.children)} processes (coordinator {self.coordinator}): processes "
                f"{failed} {what}. Their logs:\n{logs}"
            )
        return [
            json.loads((self.out / f"process_{i}.json").read_text())
            for i in range(len(self.children))
        ]


def join(process_id: int, num_processes: int, coordinator: str) -> None:
    """Makes this process process ``process_id`` of ``num_processes``, owning
    ``DEVICES / num_processes`` CPU devices; process 0 listens at ``coordinator``."""
    jax.config.update("jax_num_cpu_devices", DEVICES // num_processes)
    if num_processes > 1:  # one process alone uses XLA's own collectives between devices
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # A process that fails exits after at most a minute at the shutdown barrier, and the
        # others then stop too, instead of waiting five minutes for it.
        jax.distributed.initialize(
            coordinator, num_processes, process_id, shutdown_timeout_seconds=60
        )


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (1: a process failed or ran out of time,
    the message says which and shows its log)."""
    args = parse_args(argv)
    if args.processes is not None:  # the launcher
        out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="stackwise_multiprocess_"))
        try:
            views = Processes(args.processes, out).wait(args.timeout)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        for v in views:
            print(
                f"process {v['process']} of {v['processes']}: {v['devices'][0]} of "
                f"{v['devices'][1]} devices, batch rows {v['batch_rows']}, "
                f"{v['param_bytes_per_device']} of {v['param_bytes']} param bytes per device"
            )
        print(f"collectives: {views[0]['collectives']}")
        print(
            f"loss {views[0]['loss']:.6f}, after one SGD step {views[0]['loss_after_step']:.6f}"
            f"; results in {out}"
        )
        return 0
    join(args.process_id, args.num_processes, args.coordinator)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run_process(args.out)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

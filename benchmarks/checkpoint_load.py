"""Loading a multi-GiB per-layer checkpoint into a stacked model, onto one device and in
three sharded layouts over simulated CPU devices: peak host RSS and throughput, streamed against
sequential reading and against the naive script.

Writes a synthetic Llama-like safetensors checkpoint (Hugging Face names, torch's (out, in)
layout, several files and an index; a depth that is a multiple of 4) to a temporary folder,
then runs each path in a fresh subprocess of its own, so that each peak RSS is its own:

- ``sequential``: read each file whole into memory (``f.read()``), kept to the end: plain
  sequential reading of the same files, into as much new memory as the loaded model holds
  (the target's baseline);
- ``sequential_chunks``: read every file's bytes in order, in 64 MiB chunks, nothing kept
  (the page cache's copy rate; the memory is reused chunk after chunk);
- ``sequential_device_put``: the chunks, each put on a device (round robin) and kept: reading
  plus a host-to-device copy (jax copies a host buffer that is not 64-byte aligned, as a
  ``bytes`` is; the loader's shards are aligned, and the CPU devices take them as they are);
- ``stream/<layout>``: ``stackwise.load_checkpoint``, each torch ``(out, in)`` weight
  transposed into JAX's ``(in, out)`` (``Tensor(..., transpose=(1, 0))``), in each layout of
  :func:`_model`: ``one_device`` (no ``shardings``: the default), ``fsdp`` (over 8),
  ``tensor_parallel`` (every leaf's last axis over 8), ``stages`` (the layer axis over 4);
- ``stream_one_thread``: FSDP, the shards filled by one thread (the loader uses two);
- ``stream_torch_layout``: FSDP into leaves of torch's layout (no transposes, as an Equinox
  model has them): the loader's own cost;
- ``naive/one_device``, ``naive/fsdp``: what a converter script does: every file read whole
  (``safetensors.numpy.load_file``), ``np.stack`` of each leaf's transposed layers,
  ``jax.device_put`` (with the FSDP shardings, or onto the first device).

Why the baseline keeps what it reads: the loaded model is new memory of the checkpoint's size,
and memory a process touches for the first time costs the kernel (and on a VM its host) far
more than the copy from the page cache: on the 2-vCPU VM these results come from, 0.5 to 3
CPU seconds a GiB (the VM hands freed memory back to its host, which backs it again on the
next touch), against about 0.15 s a GiB for the copy. Reading into reused 64 MiB chunks never
pays it, so against ``sequential_chunks`` any path that keeps the model measures mostly that
cost; both ratios are reported.

Reports, as ratios within one run of the script (``loads``): each load's peak RSS over the
checkpoint's size (and beyond it, in layers), and its throughput over sequential reading. With
``--repeats R`` the paths run R times in turn and each path's fastest run is reported (on a
shared, loaded machine the fastest is the least disturbed), with every run's seconds, and the
ratios of CPU seconds too (user + system, every thread: the work, hardly changed by other
processes). The checkpoint is deleted at the end. With ``--settle S`` each run starts after S
seconds of rest (default 0: back to back). On the VM these results come from, what ran just
before moves a run's time by up to 2x either way (2 GiB, the loader's runs back to back:
1.29-3.06 s; after 6 s of rest: 1.24-1.49 s; our guess: memory another process has just freed
is still backed by the VM's host, or already handed back to it); a rest before every run gives
each path the same start. The files are read from the page cache once written (sequential
first, so each path reads warm files): the throughput ratio is of the loader's work, not of the
disk.

    python benchmarks/checkpoint_load.py --gib 0.5 > benchmarks/results/checkpoint_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

E, F = 1024, 2816  # width and MLP width (a ~1B-parameter Llama's proportions, narrower)
LINEAR = {  # name -> torch shape (out, in); the JAX leaf is its transpose
    "self_attn.q_proj.weight": (E, E), "self_attn.k_proj.weight": (E, E),
    "self_attn.v_proj.weight": (E, E), "self_attn.o_proj.weight": (E, E),
    "mlp.gate_proj.weight": (F, E), "mlp.up_proj.weight": (F, E),
    "mlp.down_proj.weight": (E, F),
}  # fmt: skip
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
VOCAB = 8192
LAYER_BYTES = 4 * (sum(a * b for a, b in LINEAR.values()) + E * len(NORMS))


def write(folder: str, layers: int, per_file: int) -> int:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    weight_map, files = {}, -(-layers // per_file)
    for f in range(files):
        file = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        arrays = {}
        if f == 0:
            arrays["model.embed_tokens.weight"] = rng.standard_normal((VOCAB, E), np.float32)
            arrays["model.norm.weight"] = np.ones(E, np.float32)
        for i in range(f * per_file, min(layers, (f + 1) * per_file)):
            for name, shape in LINEAR.items():
                arrays[f"model.layers.{i}.{name}"] = rng.standard_normal(shape, np.float32)
            for name in NORMS:
                arrays[f"model.layers.{i}.{name}"] = np.ones(E, np.float32)
        save_file(arrays, os.path.join(folder, file))
        weight_map.update(dict.fromkeys(arrays, file))
        del arrays
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


LAYOUTS = ("one_device", "fsdp", "tensor_parallel", "stages")
STAGES = 4  # the layer axis's split in the "stages" layout (the depth is a multiple of it)


def _model(layers: int, transpose: bool = True, layout: str = "fsdp"):
    """The target, names and shardings of one layout: ``one_device`` (no shardings: the
    default, every leaf on the first device), ``fsdp`` (every stacked leaf split over 8
    devices by ``stackwise.fsdp_specs``, the embedding by rows), ``tensor_parallel`` (every
    leaf's last axis over 8 devices: the torch weight's stored rows) or ``stages`` (the layer
    axis over 4 devices, the embedding by rows, as pipeline stages hold their layers)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import stackwise

    leaf = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    blocks = {name: leaf(layers, *((b, a) if transpose else (a, b)))
              for name, (a, b) in LINEAR.items()}
    blocks |= {name: leaf(layers, E) for name in NORMS}
    target = {"blocks": blocks, "embed": leaf(VOCAB, E), "norm": leaf(E)}
    perm = (1, 0) if transpose else None
    names = {"blocks": {name: stackwise.Tensor(f"model.layers.{{}}.{name}", transpose=perm)
                        for name in LINEAR} | {n: f"model.layers.{{}}.{n}" for n in NORMS},
             "embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    if layout == "one_device":
        return target, names, None
    if layout == "stages":
        mesh = jax.make_mesh((STAGES,), ("stage",), devices=jax.devices()[:STAGES])
        return target, names, {"blocks": NamedSharding(mesh, P("stage")),
                               "embed": NamedSharding(mesh, P("stage")),
                               "norm": NamedSharding(mesh, P())}
    mesh = jax.make_mesh((8,), ("data",))
    if layout == "tensor_parallel":
        return target, names, jax.tree.map(
            lambda a: NamedSharding(mesh, P(*[None] * (a.ndim - 1), "data")), target)
    shardings = {"blocks": stackwise.stacked_shardings(
        mesh, stackwise.fsdp_specs(target["blocks"], mesh, "data")),
        "embed": NamedSharding(mesh, P("data")), "norm": NamedSharding(mesh, P())}
    return target, names, shardings


def _peak_rss() -> int:
    """This process's peak resident memory (VmHWM: unlike ``ru_maxrss``, not inherited from
    the parent across fork and exec)."""
    with open("/proc/self/status") as fh:
        line = next(line for line in fh if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _cpu_seconds() -> float:
    """This process's CPU time (user + system, every thread): what a path's work costs,
    unlike the wall time, hardly changed by other processes sharing the cores."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _naive(folder: str, layers: int, names: dict, shardings):
    """What a converter script does: every file read whole (``load_file``), each leaf's
    layers transposed and ``np.stack`` ed, the tree put on the devices (``jax.device_put``;
    without shardings, on the first device)."""
    import jax
    from safetensors.numpy import load_file

    tensors = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            tensors |= load_file(os.path.join(folder, file))
    host = {"blocks": {}, "embed": tensors["model.embed_tokens.weight"],
            "norm": tensors["model.norm.weight"]}
    for name, spec in names["blocks"].items():
        template = getattr(spec, "name", spec)
        rows = [tensors[template.format(i)] for i in range(layers)]
        host["blocks"][name] = np.stack([r.T if r.ndim == 2 else r for r in rows])
    return jax.device_put(host, shardings if shardings is not None else jax.devices()[0])


def run_path(path: str, folder: str, layers: int) -> dict:
    start, cpu = time.perf_counter(), _cpu_seconds()
    baseline = _peak_rss()
    if path == "sequential":  # each file read whole into memory, kept
        files = []
        for file in sorted(os.listdir(folder)):
            with open(os.path.join(folder, file), "rb") as fh:
                files.append(fh.read())
        total = sum(len(data) for data in files)
    elif path.startswith("sequential"):
        put = path == "sequential_device_put"
        if put:
            import jax

            devices, kept = jax.devices(), []
            jax.device_put(np.zeros(8), devices[0]).block_until_ready()  # jax started
            start, cpu = time.perf_counter(), _cpu_seconds()
        total = 0
        for file in sorted(os.listdir(folder)):
            with open(os.path.join(folder, file), "rb") as fh:
                while chunk := fh.read(64 << 20):
                    total += len(chunk)
                    if put:  # the bytes onto the devices, round robin, kept there
                        device = devices[len(kept) % len(devices)]
                        kept.append(jax.device_put(np.frombuffer(chunk, np.uint8), device))
        if put:
            jax.block_until_ready(kept)
    else:
        import jax

        import stackwise

        if path == "stream_one_thread":
            from stackwise._checkpoint import load

            load._THREADS = 1
        layout = path.split("/")[1] if "/" in path else "fsdp"
        target, names, shardings = _model(layers, transpose=path != "stream_torch_layout",
                                          layout=layout)
        jax.block_until_ready(jax.device_put(np.zeros(8), jax.devices()[-1]))  # devices up
        baseline = _peak_rss()
        start, cpu = time.perf_counter(), _cpu_seconds()  # the load alone, not jax's start-up
        if path.startswith("stream"):
            params = stackwise.load_checkpoint(folder, target, names, shardings=shardings)
        else:
            params = _naive(folder, layers, names, shardings)
        jax.block_until_ready(params)
        total = sum(a.nbytes for a in jax.tree.leaves(params))
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    peak = _peak_rss()
    return {"path": path, "seconds": seconds, "cpu_seconds": cpu, "bytes": total,
            "peak_rss": peak,
            "baseline_rss": baseline, "peak_over_baseline": peak - baseline}


def _number(kind: type, least: float, strict: bool):
    """An argparse type: a number of ``kind``, above ``least`` (``strict``) or at least it."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value > least if strict else value >= least):  # also refuses nan
            bound = f"above {least}" if strict else f"{least} or more"
            raise argparse.ArgumentTypeError(f"expected {bound}, got {text!r}")
        return value

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=_number(float, 0, True), default=2.0,
                        help="checkpoint size (GiB)")
    parser.add_argument("--per-file", type=_number(int, 1, False), default=8,
                        help="layers per file")
    parser.add_argument("--folder", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--repeats", type=_number(int, 1, False), default=1,
                        help="runs of each path, in turn; each path's fastest is reported")
    parser.add_argument("--settle", type=_number(float, 0, False), default=0.0,
                        help="seconds of rest before each run (see the module's docstring)")
    parser.add_argument("--path", help=argparse.SUPPRESS)  # a subprocess's one path
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.folder is not None and not os.path.isdir(args.folder):
        parser.error(f"--folder {args.folder}: not a folder; give an existing folder to write "
                     "the checkpoint's temporary folder in")
    return args


def main() -> None:
    args = parse_args()
    if args.path:
        print(json.dumps(run_path(args.path, args.folder, args.layers)))
        return
    layers = STAGES * max(1, round(args.gib * 2**30 / LAYER_BYTES / STAGES))
    folder = tempfile.mkdtemp(dir=args.folder)
    try:
        size = write(folder, layers, args.per_file)
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
                   JAX_PLATFORMS="cpu")
        runs, seconds = {}, {}
        for _ in range(args.repeats):  # the paths in turn, so that the machine's load drifts
            for path in PATHS:  # alike for all
                time.sleep(args.settle)
                out = subprocess.run(
                    [sys.executable, __file__, "--path", path, "--folder", folder,
                     "--layers", str(layers)], env=env, capture_output=True, text=True,
                    check=True)
                run = json.loads(out.stdout.strip().splitlines()[-1])
                seconds.setdefault(path, []).append(run["seconds"])
                if path not in runs or run["seconds"] < runs[path]["seconds"]:
                    runs[path] = run  # each path's fastest run
        for path, run in runs.items():
            run["all_seconds"] = seconds[path]
    finally:
        shutil.rmtree(folder)
    print(json.dumps(report(runs, size, layers, args), indent=2))


PATHS = ("sequential", "sequential_chunks", "sequential_device_put",
         *(f"stream/{layout}" for layout in LAYOUTS), "stream_one_thread",
         "stream_torch_layout", "naive/one_device", "naive/fsdp")


def report(runs: dict, size: int, layers: int, args: argparse.Namespace) -> dict:
    """Each load's ratios: throughput over sequential reading (wall and CPU seconds: the CPU
    seconds are the work each path does, whatever else shares the cores, on a loaded machine
    the wall ratios' least disturbed estimate) and host memory added over the checkpoint's
    size (jax's runtime before the load excluded)."""
    base = runs["sequential"]
    loads = {}
    for path, run in runs.items():
        if not path.startswith(("stream", "naive")):
            continue
        loads[path] = {
            "seconds": run["seconds"], "cpu_seconds": run["cpu_seconds"],
            "over_sequential": {"wall": base["seconds"] / run["seconds"],
                                "cpu": base["cpu_seconds"] / run["cpu_seconds"]},
            "over_sequential_chunks": runs["sequential_chunks"]["seconds"] / run["seconds"],
            "over_sequential_device_put":
                runs["sequential_device_put"]["seconds"] / run["seconds"],
            "peak_over_size": run["peak_over_baseline"] / size,
            "peak_minus_size_in_layers": (run["peak_over_baseline"] - size) / LAYER_BYTES,
        }
    out = {
        "checkpoint_gib": size / 2**30, "layers": layers, "repeats": args.repeats,
        "settle": args.settle, "layer_mib": LAYER_BYTES / 2**20,
        "files": -(-layers // args.per_file), "loads": loads, "runs": runs,
    }
    out["targets"] = {
        **{f"{layout} throughput >= 0.8 x sequential":
           loads[f"stream/{layout}"]["over_sequential"]["wall"] >= 0.8 for layout in LAYOUTS},
        **{f"{layout} peak <= size + 2 layers":
           loads[f"stream/{layout}"]["peak_minus_size_in_layers"] <= 2 for layout in LAYOUTS},
        "stream/one_device faster than naive/one_device":
            runs["stream/one_device"]["seconds"] < runs["naive/one_device"]["seconds"],
    }
    return out


if __name__ == "__main__":
    main()

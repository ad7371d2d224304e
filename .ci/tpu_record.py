"""The record of one run of the TPU tier (.ci/tpu), as a Markdown section for
benchmarks/results/tpu_tier.md, printed to stdout.

.ci/tpu passes what it knows through the environment: TIER_STATUS (pytest's exit status),
TIER_SECONDS (the run's wall time), TIER_LIMIT (the timeout), TIER_LOG (pytest's output),
TIER_COUNT (how many tests or paths were selected), TIER_SHARD (STACKWISE_TPU_TIER_SHARD, or
empty), TIER_SELECTION (chip or full), TIER_ARGS (the PYTEST ARGS given, empty for the
default selection) and TIER_COSTS
(the JSON that .ci/tpu_costs.py wrote: each test's seconds and compiles; absent, not
reported). The machine is read here: the device, and the jax, jaxlib and libtpu versions.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import sys

OUTCOMES = ("passed", "failed", "skipped", "errors", "xfailed", "xpassed", "deselected")


def counts(log: str) -> dict[str, int]:
    """The outcome counts of pytest's last summary line in ``log``, e.g. ``3 passed, 1 failed,
    2 skipped in 4.0s`` (``1 error`` counted as ``errors``); every outcome, 0 where absent."""
    lines = [ln.strip("= ") for ln in log.splitlines()
             if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s", ln)]
    if not lines:
        raise ValueError("pytest's log has no summary line ('N passed ... in S s'): the run "
                         "ended before pytest reported; read its log for why")
    found = dict.fromkeys(OUTCOMES, 0)
    for number, outcome in re.findall(r"(\d+) (\w+)", lines[-1].rsplit(" in ", 1)[0]):
        outcome = "errors" if outcome == "error" else outcome
        if outcome in found:
            found[outcome] = int(number)
    return found


def short_summary(log: str) -> str:
    """pytest's "short test summary info" section and its last line (the counts)."""
    lines = log.rstrip().splitlines()
    start = next((i for i, ln in enumerate(lines) if "short test summary info" in ln), None)
    body = lines[start + 1:] if start is not None else lines[-1:]
    return "\n".join(ln for ln in body if ln.strip())


def costs(rows: list[dict], slowest: int = 8) -> list[str]:
    """Markdown lines on what the tests cost (rows as .ci/tpu_costs.py writes them): the
    compiles, their seconds and repeats, and the ``slowest`` tests."""
    if not rows:
        return ["- costs: no test finished"]
    seconds = sum(row["seconds"] for row in rows)
    lines = [f"- costs: {len(rows)} tests in {seconds:.0f} s"]
    if rows[0]["compiles"] is not None:
        compiles = sum(row["compiles"] for row in rows)
        lines[0] += (f"; XLA compiled {compiles} programs in "
                     f"{sum(row['compile_seconds'] for row in rows):.0f} s, "
                     f"{sum(row['repeated_compiles'] for row in rows)} of them a program "
                     "compiled before in the run")
    lines.append(f"- the {min(slowest, len(rows))} slowest (seconds, compiles):")
    for row in sorted(rows, key=lambda row: -row["seconds"])[:slowest]:
        lines.append(f"  - `{row['test']}`: {row['seconds']:.1f} s"
                     + (f", {row['compiles']}" if row["compiles"] is not None else ""))
    return lines


def _version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def machine() -> str:
    """The device and the versions that made the run."""
    import jax

    device = jax.devices()[0]
    platform_version = getattr(device.client, "platform_version", "?").strip()
    return (f"{device.device_kind} ({device.platform}, {jax.device_count()} devices); "
            f"jax {jax.__version__}, jaxlib {_version('jaxlib')}, "
            f"libtpu {_version('libtpu', 'libtpu-nightly')}; "
            f"backend: {platform_version.splitlines()[0] if platform_version else '?'}")


def record(env: dict[str, str], log: str, now: datetime.datetime,
           rows: list[dict] | None = None) -> str:
    """The Markdown section for one run (see the module's docstring for ``env``; ``rows``:
    the tests' costs, or None when not measured)."""
    found, status = counts(log), int(env["TIER_STATUS"])
    seconds, limit = int(env["TIER_SECONDS"]), int(env["TIER_LIMIT"])
    stopped = status == 124  # (`timeout`'s status: it stopped pytest with SIGINT)
    selection = (f"`{env['TIER_ARGS']}`" if env.get("TIER_ARGS") else
                 "the fast tier of tests/core, tests/adapters and tests/finetune, and the "
                 "decode, serving, remat and finetune modules whole (STACKWISE_TPU_TIER_"
                 "SELECTION=full)" if env.get("TIER_SELECTION") == "full" else
                 "the chip's selection, .ci/tpu_tier.txt")
    if env.get("TIER_SHARD"):
        selection += f", share {env['TIER_SHARD']} of its test files"
    result = ", ".join(f"{found[k]} {k}" for k in OUTCOMES if found[k] or k in OUTCOMES[:4])
    return "\n".join([
        f"## {now:%Y-%m-%d %H:%M} UTC",
        "",
        f"- machine: {machine()}",
        f"- matmul precision: {env.get('JAX_DEFAULT_MATMUL_PRECISION', 'default')}; "
        f"JAX_PLATFORMS={env.get('JAX_PLATFORMS', '')}",
        f"- selection: {selection} ({env['TIER_COUNT']} "
        f"{'arguments' if env.get('TIER_ARGS') else 'tests'}), one process",
        f"- result: {result}; {seconds} s of a {limit} s limit"
        + ("; stopped at the limit (what ran is counted)" if stopped else "")
        + f"; exit status {status}",
        "- command: `source .tpu/install.sh && cd /tmp && "
        + (f"STACKWISE_TPU_TIER_SHARD={env['TIER_SHARD']} " if env.get("TIER_SHARD") else "")
        + ("STACKWISE_TPU_TIER_SELECTION=full " if env.get("TIER_SELECTION") == "full" else "")
        + "\"$OLDPWD\"/.ci/tpu \"$OUT\""
        + (f" {env['TIER_ARGS']}" if env.get("TIER_ARGS") else "") + "`",
        *(costs(rows) if rows is not None else []),
        "",
        "```",
        short_summary(log),
        "```",
        "",
    ])


def main() -> int:
    with open(os.environ["TIER_LOG"]) as f:
        log = f.read()
    rows = None
    if os.path.exists(os.environ.get("TIER_COSTS", "")):
        with open(os.environ["TIER_COSTS"]) as f:
            rows = json.load(f)
    try:
        text = record(dict(os.environ), log, datetime.datetime.now(datetime.UTC),
                      rows)
    except ValueError as e:
        print(f".ci/tpu_record.py: {e} ({os.environ['TIER_LOG']})", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

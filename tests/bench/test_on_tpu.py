"""benchmarks/on_tpu.sh, read without a TPU: every part its header and its error name is a part
it runs, and every tpu_train.py command in it parses, each of its row selectors picking a row,
as does the tpu_generate.py command with its defaults.
(The fourteenth session named a part, ``train-unrolled``, that the script did not run.)"""

import pathlib
import re
import shlex

import pytest
from _scripts import load_script

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"
SCRIPT = (BENCHMARKS / "on_tpu.sh").read_text()


def cases() -> list[str]:
    labels = re.findall(r"^    ([a-z0-9|-]+)\)", SCRIPT, flags=re.M)
    return [name for label in labels for name in label.split("|")]


def test_every_part_named_is_a_part_it_runs():
    header = SCRIPT.split("\nset -uo")[0]
    named = set(re.findall(r"[a-z0-9-]+", header))
    listed = re.search(r"unknown part \$what \(([^)]*)\)", SCRIPT).group(1).split(", ")
    assert cases() and sorted(listed) == sorted(cases())
    assert [c for c in cases() if c not in named] == []
    # the header's part names, as its prose writes them ("train-unroll-dots and ...")
    in_header = set(re.findall(
        r"(?<![-\w/])(train|tier\d?|(?:train|bench|tier)-[a-z0-9-]*[a-z0-9])(?![-\w/.])", header))
    assert {"train", "tier1", "train-unrolled", "bench-decode-sizes"} <= in_header
    assert sorted(in_header - set(cases())) == []


@pytest.fixture(scope="module")
def train():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        yield load_script(BENCHMARKS / "tpu_train.py")


def train_commands() -> list[list[str]]:
    joined = SCRIPT.replace("\\\n", " ")
    found = re.findall(r"python3 benchmarks/tpu_train\.py ([^;\n]*)", joined)
    return [shlex.split(c.replace("$out", "/tmp/out")) for c in found]


def test_every_train_command_parses_and_each_selector_picks_a_row(train):
    commands = train_commands()
    assert len(commands) >= 8
    for argv in commands:
        args = train.parse_args(argv)
        selectors = argv[argv.index("--variants") + 1].split(",")
        for w in selectors:
            assert train.select(train.variant_names(), w), (w, argv)
        assert args.rows


def test_the_generate_part_parses_with_its_defaults():
    joined = SCRIPT.replace("\\\n", " ")
    (command,) = re.findall(r"python3 benchmarks/tpu_generate\.py ([^;\n]*)", joined)

    def default(match):  # ${NAME:-value} -> value; ${NAME:+flag} -> nothing (NAME unset)
        return match.group(2) if match.group(1) == "-" else ""

    command = re.sub(r"\$\{[A-Z_]+:([-+])([^}]*)\}", default, command)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        generate = load_script(BENCHMARKS / "tpu_generate.py")
    args = generate.parse_args(shlex.split(command.replace("$out", "/tmp/out")))
    assert args.time and args.tokens == 32 and len(args.shapes) == 3 and not args.auto_cache


def test_a_second_call_into_the_same_folder_keeps_the_first_calls_logs(tmp_path):
    import subprocess
    import tarfile

    packing = SCRIPT[SCRIPT.index("# (a second call with the same OUT_DIR"):]
    for call in ("first", "second"):
        (tmp_path / f"{call}.log").write_text(call)
        (tmp_path / "tier").mkdir()
        (tmp_path / "tier" / "pytest.log").write_text(call)
        subprocess.run(["bash", "-c", f"out={shlex.quote(str(tmp_path))}\n{packing}"],
                       check=True, capture_output=True)
    packed = {name: sorted(tarfile.open(tmp_path / name).getnames())
              for name in ("logs.tar.gz", "logs-2.tar.gz")}
    assert packed == {"logs.tar.gz": ["first.log", "tier", "tier/pytest.log"],
                      "logs-2.tar.gz": ["second.log", "tier", "tier/pytest.log"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs-2.tar.gz", "logs.tar.gz"]

"""benchmarks/trace_depth.py: its frames are the ones it says, and its tables (the Haiku and
linen pairs at each offset, the ratio of the two times, the command in the header)."""

import inspect
import pathlib
import re

import pytest
from _scripts import load_script

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def script():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))  # (it imports tpu_decode_hlo)
        yield load_script(BENCHMARKS / "trace_depth.py")


@pytest.mark.parametrize("frames", [0, 1, 7])
def test_under_calls_the_function_that_many_frames_deeper(script, frames):
    depth = lambda: len(inspect.stack(0))  # noqa: E731
    assert script.under(frames, depth) == depth() + 1 + frames


def test_the_offsets_parse(script):
    assert script.parse_args(["--offsets", "0, 3,12"]).offsets == [0, 3, 12]
    assert script.parse_args([]).offsets == list(range(0, 60, 4))


@pytest.mark.slow  # (16 traces of a training step at d_model 1024 on the CPU: 5-10 s)
def test_the_tables_hold_both_pairs_at_every_offset(script, tmp_path, capsys):
    out = tmp_path / "t.md"
    assert script.main(["--offsets", "0,5", "--rounds", "1", "--markdown", str(out)]) == 0
    text = out.read_text()
    assert "`python benchmarks/trace_depth.py --offsets 0,5 --rounds 1 --markdown" in text
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) / (\d+) \|$",
                      text, re.M)
    assert [int(r[0]) for r in rows] == [0, 5, 0, 5]  # Haiku's, then linen's
    for _, tool, stack, ratio, _, _ in rows:
        assert float(ratio) == pytest.approx(float(stack) / float(tool), abs=0.006)
    assert "| offset | hk.layer_stack ms | stackwise.haiku.Stack ms |" in text
    assert "| offset | nn.scan ms | stackwise.flax.Stack ms |" in text
    assert re.search(r"^Haiku: stackwise.haiku.Stack / hk.layer_stack from [\d.]+ to [\d.]+ "
                     r"over the offsets, median [\d.]+\.$", text, re.M)

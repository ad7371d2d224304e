"""stackwise.bench.workloads: every block's rows, the frameworks' common skeleton, and what
happens when a framework or an adapter is missing."""

import sys

import pytest

from stackwise.bench import BenchConfig, run_benchmark, workloads

CFG = BenchConfig.quick()
FRAMEWORKS = [m for m in workloads.BLOCKS["transformer"].modules if m != "core"]


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

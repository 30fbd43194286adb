"""bench/device_step.py's launches_pdl: the step benchmark launches with PDL exactly when the pdl pass runs, also
when it comes in through `all` (the bug it replaced tested `"pdl" in passes`, so every `all` row ran without PDL);
its `--variant` parser: the values it builds, and bad specs refused before any GPU work; and the table call's row
plan under `--budget-s`: the rows the table needs first, the ablation's order kept, the A/B rows only on request; and
`--rows`, the stored result's rows printed without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import pytest  # noqa: E402

from device_step import (AB_ROWS, ablation_sets, launches_pdl, parse_variant,  # noqa: E402
                         print_rows, row_cost_guess, split_by_budget)


def test_pdl_through_all_and_by_name():
    assert launches_pdl(["all"]) and launches_pdl(["all", "fuse_moe"]) and launches_pdl(["partition", "pdl"])
    assert not launches_pdl([]) and not launches_pdl(["partition", "fuse_swiglu", "capture_metadata"])


def test_variant_values():
    import lingc.kernels.linear as linear
    import lingc.kernels.mla as mla
    import lingc.kernels.moe as moe
    from lingc.passes.fuse_moe import FuseMoe
    name, sets = parse_variant('v:lingc.kernels.moe.UP_CONFIG={"block_n": 16};lingc.kernels.mla.SPLIT_ROWS=256')
    assert name == "v" and [(m, a) for m, a, _ in sets] == [(moe, "UP_CONFIG"), (mla, "SPLIT_ROWS")]
    assert sets[0][2] == moe.UP_CONFIG._replace(block_n=16) and sets[1][2] == 256
    (_, attr, table), = parse_variant('t:lingc.kernels.linear.CONFIG_TABLE[1][2]={"num_stages": 6}')[1]
    assert attr == "CONFIG_TABLE" and table[1][2].num_stages == 6 and table[0] == linear.CONFIG_TABLE[0]
    assert type(table[1][2]) is type(linear.CONFIG_TABLE[1][2]) and linear.CONFIG_TABLE[1][2].num_stages != 6
    (_, _, both), = parse_variant('b:lingc.kernels.linear.CONFIG_TABLE[1][1]=8;'
                                  'lingc.kernels.linear.CONFIG_TABLE[1][2]={"rows": 1}')[1]   # items on one attribute compose
    assert both[1][1] == 8 and both[1][2].rows == 1 and linear.CONFIG_TABLE[1][1] != 8
    assert parse_variant("c:lingc.passes.fuse_moe.FuseMoe.in_all=True")[1] == [(FuseMoe, "in_all", True)]
    assert parse_variant("base:") == ("base", [])


@pytest.mark.parametrize("spec", ["x:lingc.kernels.moe.NOT_A_TUNABLE=1", "x:lingc.kernels.moe.UP_CONFIG",
                                  "x:nonexistent_module.ATTR=1", "x:lingc.kernels.mla.SPLIT_ROWS=__import__('os')"])
def test_variant_refuses_bad_specs(spec):
    with pytest.raises((SystemExit, ValueError)):
        parse_variant(spec)


def _args(**kw):
    import argparse
    return argparse.Namespace(**({"only": "", "ab_rows": False, "draft_vocab": 0} | kw))


def test_ablation_rows_and_the_budgeted_order():
    names = [n for n, _, _ in ablation_sets(_args(), [])]
    assert names[:2] == ["none", "partition"] and names[-1] == "all" and not set(AB_ROWS) & set(names)
    assert [n for n, _, _ in ablation_sets(_args(ab_rows=True), [])][-len(AB_ROWS):] == list(AB_ROWS)
    assert dict((n, p) for n, p, _ in ablation_sets(_args(only="all+specialize_sampling"), [])) == {
        "all+specialize_sampling": ["all", "specialize_sampling"]}
    assert [n for n, _, _ in ablation_sets(_args(only="all,all+fuse_moe"), [])] == ["all", "all+fuse_moe"]
    assert [n for n, _, _ in ablation_sets(_args(only="all", ab_rows=True), [])] == ["all", *AB_ROWS]
    variant = parse_variant("base2:")
    sets = ablation_sets(_args(draft_vocab=8), [variant])
    assert [n for n, _, _ in sets][-2:] == ["all+draft_vocab", "all@base2"]
    first, later = split_by_budget(sets)
    assert [n for n, _, _ in first] == ["none", "partition", "all", "all+draft_vocab", "all@base2"]   # the call's own
    assert first + later != sets and sorted(first + later, key=sets.index) == sets   # a partition of the rows
    assert [n for n, _, _ in later][0] == "+fuse_projections" and all(n.startswith("+") for n, _, _ in later)
    first, later = split_by_budget(sets, "none,+pdl")                              # a "+pass" row --only names
    assert "+pdl" in [n for n, _, _ in first] and "+pdl" not in [n for n, _, _ in later]
    assert row_cost_guess([]) == 45.0 and row_cost_guess([3.0, 48.0, 9.0]) == 48.0


def _fake_gpu_work(monkeypatch):
    """device_step's GPU work replaced: a fake clock (30 s a row), fake rows, parity, end to end and pass manager;
    returns (the module, the clock, the calls made)."""
    import types

    import device_step as ds
    import lingc.init
    import lingc.passes.manager
    import lingc.trace  # noqa: F401  (the module: lingc.trace the attribute is its function)

    clock = {"t": 0.0}
    calls = []
    monkeypatch.setattr(ds, "time", types.SimpleNamespace(perf_counter=lambda: clock["t"]))
    monkeypatch.setattr(ds.torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(ds, "_sync", lambda: None)
    monkeypatch.setattr(ds, "hbm_bandwidth_gbps", lambda: 4000.0)
    monkeypatch.setattr(lingc.init, "random_model", lambda config, **kw: types.SimpleNamespace(config=config))
    monkeypatch.setattr(sys.modules["lingc.trace"], "trace", lambda model, programs, options: object())

    def measure(model, traced, passes, bandwidth, with_floor, floor_first=False, warm_only=False):
        calls.append(("warm" if warm_only else "row", tuple(passes)))
        clock["t"] += 30.0
        return {"passes": passes} | ({} if warm_only else {"step": {"ms": {"total": 1.0}}})

    monkeypatch.setattr(ds, "measure_config", measure)
    monkeypatch.setattr(ds, "greedy_parity", lambda *a, **k: calls.append(("parity",)) or {"nextn_equals_plain": True})
    monkeypatch.setattr(ds, "end_to_end", lambda *a, **k: calls.append(("e2e",)) or {"tpot_ms": 1.0})

    class Manager:
        def __init__(self, passes):
            pass

        def run(self, program):
            return types.SimpleNamespace(program=program)

    monkeypatch.setattr(lingc.passes.manager, "PassManager", Manager)
    return ds, clock, calls


def test_budgeted_main_runs_the_table_rows_first_and_skips_what_does_not_fit(monkeypatch, tmp_path):
    """device_step.main under --budget-s with the GPU work faked: the table's rows, then parity and the end-to-end
    run, then the ablation's other rows while a row fits (each fake row costs 30 s of a fake clock); the JSON keeps
    the ablation's order, names the skipped rows and the budget, and has no A/B row."""
    import json

    ds, clock, calls = _fake_gpu_work(monkeypatch)
    out = tmp_path / "step.json"
    monkeypatch.setattr(sys, "argv", ["device_step.py", "--e2e", "--budget-s", "200", "--json", str(out)])
    ds.main()
    result = json.loads(out.read_text())
    names = [r["name"] for r in result["ablation"]]
    order = [n for n, _, _ in ablation_sets(_args(), [])]
    assert names == [n for n in order if n in names]                        # the ablation's order
    assert names[:2] == ["none", "partition"] and "all" in names and not set(AB_ROWS) & set(names)
    assert [c[0] for c in calls[:5]] == ["row", "row", "row", "parity", "e2e"]
    assert calls[2] == ("row", ("all",))
    ran_later = len(names) - 3
    # 90 s spent; the first later row guessed at 45 s (90 + 45 <= 200), the next at 30: rows end at 120, 150, 180
    assert ran_later == 3, names
    assert set(result["skipped_rows"]) == set(order) - set(names) and result["budget_s"] == 200.0
    assert result["end_to_end"] == {"tpot_ms": 1.0} and result["greedy_parity"] == {"nextn_equals_plain": True}


def test_warm_up_shards_compile_their_rows_and_the_engines_without_timing(monkeypatch, tmp_path):
    """--warm-only --shard I/N: shard I compiles rows I, I+N, ... (warm_only, no timing, no bandwidth copy); the last
    shard warms the parity's engines, shard N-2 (with --e2e) the end-to-end run's; bad --shard specs are refused."""
    import json

    ds, clock, calls = _fake_gpu_work(monkeypatch)
    monkeypatch.setattr(ds, "hbm_bandwidth_gbps", lambda: pytest.fail("a warm-up measured the bandwidth"))
    plan = [p for _, p, _ in ablation_sets(_args(), [])]
    for shard, want in ((0, []), (1, ["e2e", "e2e"]), (2, ["parity"])):
        calls.clear()
        out = tmp_path / f"warm{shard}.json"
        monkeypatch.setattr(sys, "argv", ["device_step.py", "--warm-only", "--e2e", "--layers", "4", "--shard",
                                          f"{shard}/3", "--json", str(out)])
        ds.main()
        assert [c[1] for c in calls if c[0] == "warm"] == [tuple(p) for p in plan[shard::3]]
        assert [c[0] for c in calls if c[0] != "warm"] == want and "row" not in [c[0] for c in calls]
        result = json.loads(out.read_text())
        assert len(result["ablation"]) == len(plan[shard::3]) and "end_to_end" not in result
    for bad in ("3/3", "x", "1"):
        with pytest.raises(ValueError, match="--shard"):
            ds.parse_shard(bad)


def test_sampling_copies_keys_requests_and_floors():
    """specialize_sampling's rows: the nucleus copies replay SAMPLED, the plain copies and their general baseline
    PLAIN; a copy's floor is its source graph's."""
    import device_step as ds
    assert ds.request_for("nextn_nucleus") is ds.SAMPLED and ds.request_for("nextn_sampled") is ds.SAMPLED
    assert ds.request_for("nextn_plain") is ds.PLAIN and ds.request_for("nextn_sampled_plain") is ds.PLAIN
    assert ds.request_for("nextn") is None and ds.request_for("nextn_greedy") is None
    assert ds.PLAIN["top_p"] == 1.0 and ds.SAMPLED["top_p"] < 1.0
    assert [ds.source_graph(g) for g in ("verify_plain", "draft_nucleus", "step_greedy", "extend")] == [
        "verify", "draft", "step", "extend"]


def test_rows_prints_each_rows_greedy_times_and_the_parity(tmp_path, capsys):
    """--rows: one line per ablation row (nan for a graph the row did not time), then the parity without its graphs."""
    import json
    path = tmp_path / "ab.json"
    path.write_text(json.dumps({"ablation": [
        {"name": "all", "step_greedy": {"ms": {"step_greedy": 1.25}},
         "nextn_greedy": {"ms": {"verify_greedy": 2.5, "total": 3.75}}},
        {"name": "all@x", "step_greedy": {"ms": {"step_greedy": 1.5}}}],
        "greedy_parity": {"nextn_equals_plain": True, "graphs": ["step"]}}))
    print_rows(str(path))
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["all", "greedy", "decode", "1.2500", "verify", "2.5000", "NEXTN", "3.7500", "ms"]
    assert out[1].split()[3] == "1.5000" and out[1].split()[5] == "nan"
    assert out[2] == "parity {'nextn_equals_plain': True}"

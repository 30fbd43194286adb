"""bench/device_launches.py: graph kernels inherit the eager run's launches in order, grouped by op and weight with
bytes, floor and excess; a graph whose kernels differ from the eager run's is refused, not mis-attributed; the
side stream's hint kernels are kept out of the chain."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from device_launches import attribute, by_kind, group_name, split_replays  # noqa: E402


def _launch(group: str, nbytes: int) -> dict:
    return {"label": "triton:" + group.split()[0], "group": group, "bytes": {"weights": nbytes}}


def test_group_name_uses_the_largest_weight_with_layers_starred():
    w_small, w_big, x = torch.zeros(4), torch.zeros(64, 8), torch.zeros(8)
    ids = {id(w_small): "model.layers.3.attention.o_norm.weight", id(w_big): "model.layers.3.attention.o_proj.weight"}
    want = "linear model.layers.*.attention.o_proj.weight"
    assert group_name("triton:lingc.linear", (x, w_small, w_big), ids) == want
    assert group_name("lingc.kda_recurrent", (x,), ids) == "kda_recurrent"


def test_attribute_groups_kernels_by_launch():
    launches = [_launch("linear a", 4000), {"label": "getitem", "group": "getitem", "bytes": {}},
                _launch("linear a", 4000), _launch("norm", 0)]
    names = ["k1", "k1", "k2", "k3"]
    owner = [0, 2, 2, 3]                 # launch 2 issued two kernels
    reps = [[{"name": n, "ts": 10.0 * i + r, "dur": d} for i, (n, d) in enumerate(zip(names, (2.0, 3.0, 1.0, 1.0)))]
            for r in (0, 100)]
    out = attribute(launches, names, owner, reps, bandwidth_gbps=4.0, replay_us=40.0)
    by = {g["group"]: g for g in out["groups"]}
    assert set(by) == {"linear a", "norm"}                     # a launch with no kernel and no bytes is left out
    a = by["linear a"]
    assert (a["launches"], a["kernels"], a["bytes"], a["us"]) == (2, 3, 8000, 6.0)
    assert a["floor_us"] == pytest.approx(2.0) and a["excess_us"] == pytest.approx(4.0)
    assert out["kernel_sum_us"] == 7.0 and out["gaps_us"] == pytest.approx(40.0 - out["busy_us"])
    assert out["groups"][0]["group"] == "linear a"             # sorted by excess


def test_attribute_refuses_a_different_kernel_sequence():
    launches = [_launch("linear a", 10)]
    reps = [[{"name": "other", "ts": 0.0, "dur": 1.0}]]
    out = attribute(launches, ["k1"], [0], reps, 4.0, 5.0)
    assert "error" in out and out["graph_kernel"] == "other" and out["eager_kernel"] == "k1"


def test_exposed_time_charges_each_kernel_what_it_adds_to_the_chain():
    """--pdl: overlapping kernels are charged end_i - (the chain's end so far); the first its duration; one that ends
    inside its predecessor 0. The charges sum to the busy span."""
    from device_launches import exposed_us
    kernels = [{"ts": 0.0, "dur": 5.0},      # ends 5
               {"ts": 2.0, "dur": 6.0},      # started early (pre-wait prologue), ends 8: +3
               {"ts": 3.0, "dur": 4.0},      # ends 7, inside the chain: 0
               {"ts": 9.0, "dur": 1.0}]      # a gap, then ends 10: +2
    assert exposed_us(kernels) == [5.0, 3.0, 0.0, 2.0]
    assert sum(exposed_us(kernels)) == 10.0


def test_attribute_with_exposed_times():
    launches = [_launch("linear a", 4000), _launch("norm", 0)]
    reps = [[{"name": "k1", "ts": 0.0 + r, "dur": 4.0}, {"name": "k2", "ts": 1.0 + r, "dur": 5.0}] for r in (0, 50)]
    out = attribute(launches, ["k1", "k2"], [0, 1], reps, bandwidth_gbps=4.0, replay_us=7.0, exposed=True)
    by = {g["group"]: g for g in out["groups"]}
    assert out["time_basis"] == "exposed" and out["kernel_sum_us"] == 6.0
    assert by["linear a"]["us"] == 4.0 and by["norm"]["us"] == 2.0       # k2 ends at 6: 2 us after k1


def test_split_replays_keeps_hint_kernels_out_of_the_chain():
    """Two replays of [a, hint, b] (the hint on the side stream, started between a and b): the chain is [a, b] each
    replay, the hints apart, whatever order the trace lists them in."""
    one = [{"name": "a", "ts": 0.0, "dur": 1.0}, {"name": "_l2_prefetch_kernel", "ts": 0.5, "dur": 7.0},
           {"name": "b", "ts": 2.0, "dur": 1.0}]
    events = [dict(k, ts=k["ts"] + r) for r in (100.0, 0.0) for k in one]
    chain, side = split_replays(events, 2)
    assert [[k["name"] for k in r] for r in chain] == [["a", "b"], ["a", "b"]]
    assert [[(k["name"], k["ts"]) for k in r] for r in side] == [[("_l2_prefetch_kernel", 0.5)],
                                                                  [("_l2_prefetch_kernel", 100.5)]]


def test_by_kind_splits_latency_bound_groups_from_streams():
    """A group is latency-bound where its floor is under half its time and under 1 us a launch; the rest stream."""
    groups = [{"group": "router", "launches": 23, "kernels": 23, "us": 46.0, "floor_us": 0.0},
              {"group": "gate", "launches": 23, "kernels": 23, "us": 59.0, "floor_us": 3.0},
              {"group": "up", "launches": 23, "kernels": 23, "us": 350.0, "floor_us": 215.0},   # a stream over floor
              {"group": "q_a", "launches": 6, "kernels": 6, "us": 17.0, "floor_us": 12.0},     # over half its time
              {"group": "mla", "launches": 6, "kernels": 24, "us": 94.0, "floor_us": 27.0}]    # 4.5 us a launch
    out = by_kind(groups)
    lat, st = out["latency_bound"], out["streams"]
    assert (lat["groups"], lat["kernels"], lat["us"], lat["floor_us"]) == (2, 46, 105.0, 3.0)
    assert (st["groups"], st["kernels"], st["us"], st["floor_us"]) == (3, 53, 461.0, 254.0)
    assert lat["us_per_kernel"] == pytest.approx(105.0 / 46)
    assert st["excess_us_per_kernel"] == pytest.approx((461.0 - 254.0) / 53)
    assert by_kind([])["streams"]["us_per_kernel"] == 0.0


def test_split_of_stored_results_runs_without_a_gpu(tmp_path, capsys):
    """--split FILE: the by_kind line of every graph of a stored launches file (the committed H100 one here)."""
    import device_launches
    stored = Path(__file__).resolve().parents[1] / "bench" / "results" / "launches-h100-20261206-b.json"
    device_launches.print_split([str(stored)])
    out = capsys.readouterr().out
    assert "step_greedy: 133 latency-bound kernels 315 us (2.37 a kernel), 115 streams 994 us over a 759 us floor" in out
    assert "verify_greedy:" in out

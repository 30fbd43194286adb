"""bench/kernel_moe_scaling.py's CPU parts: the routings have exactly the asked-for experts (8 distinct a token, every
expert of the set read) and the least-squares line recovers a known intercept and slope."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kernel_moe_scaling as scaling  # noqa: E402


@pytest.mark.parametrize("T,d", scaling.POINTS)
def test_routing_reads_exactly_d_experts(T: int, d: int) -> None:
    ids = scaling.routing(T, d, torch.Generator().manual_seed(d), torch.device("cpu"))
    assert ids.shape == (T, scaling.TOP_K) and ids.dtype == torch.int32
    assert int(torch.unique(ids).numel()) == d
    assert all(int(torch.unique(row).numel()) == scaling.TOP_K for row in ids)
    assert int(ids.min()) >= 0 and int(ids.max()) < scaling.E


def test_fit_recovers_a_line() -> None:
    xs = [25.0, 50.0, 100.0, 150.0]
    a, slope = scaling.fit(xs, [3.5 + 0.25 * x for x in xs])
    assert a == pytest.approx(3.5) and slope == pytest.approx(0.25)


def test_parse_configs() -> None:
    assert scaling.parse_configs("64,128,4,4,1; 32,128,4,4,0;") == [(64, 128, 4, 4, True), (32, 128, 4, 4, False)]
    assert scaling.parse_configs("") == []


@pytest.mark.parametrize("T,d", scaling.EXIT_POINTS)
def test_exit_points_read_eight_experts(T: int, d: int) -> None:
    ids = scaling.routing(T, d, torch.Generator().manual_seed(T), torch.device("cpu"))
    assert int(torch.unique(ids).numel()) == scaling.TOP_K == d


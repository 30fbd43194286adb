"""bench/expert_prediction.py on test-tiny: the prediction is exact when the attention adds nothing to the residual,
and a fraction of the picks in [0, 1] otherwise, one row per MoE layer over every position."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lingc.modules import KDA, MLA

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from expert_prediction import measure  # noqa: E402


def test_exact_without_attention(monkeypatch) -> None:
    """With every attention output zero the router's input is the layer's input through the same norm: every pick
    predicted, at every MoE layer (test-tiny: layer 0 is dense)."""
    for cls in (KDA, MLA):
        forward = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, x, meta, state, f=forward: torch.zeros_like(f(self, x, meta,
                                                                                                       state)))
    rows = measure(layers=6, prompt=5, new=3, config_name="test-tiny")
    assert sorted(rows) == [f"model.layers.{i}.mlp" for i in range(1, 6)]
    assert all(r["hit"] == 1.0 and r["hit_decode"] == 1.0 and r["positions"] == 5 + 2 for r in rows.values())


def test_fractions() -> None:
    rows = measure(layers=6, prompt=5, new=3, config_name="test-tiny")
    assert len(rows) == 5
    assert all(0.0 <= r["hit"] <= 1.0 and 0.0 <= r["hit_decode"] <= 1.0 for r in rows.values())
    assert any(r["hit"] < 1.0 for r in rows.values())       # random attention moves the residual: not all exact

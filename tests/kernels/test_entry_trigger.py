"""The entry_trigger launch hint (passes/pdl.py, kernels/pdl.py) on each kernel that takes it: the launcher accepts it
and, where PDL is off (the interpreter), it changes nothing: the same bits as without it. Where it lands in the
compiled PTX is tests/kernels/test_pdl_trigger.py's check."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernel_support import poisoned_empty  # tests/kernels is on sys.path
from lingc.kernels import kda, mla, moe, rmsnorm
from lingc.passes.pdl import ENTRY_TRIGGER_HINT_OPS
from lingc.runtime.executor import LAUNCH_HINTS

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
EPS = 1e-6


def test_every_entry_trigger_op_takes_the_hint():
    launchers = {"rmsnorm": rmsnorm.rmsnorm, "add_rmsnorm": rmsnorm.add_rmsnorm, "gated_rmsnorm": kda.gated_rmsnorm,
                 "combine_add_rmsnorm": moe.combine_add_rmsnorm, "mla_attention": mla.mla_attention,
                 "embedding_rmsnorm": rmsnorm.embedding_rmsnorm, "mla_prep": mla.mla_prep}
    assert set(ENTRY_TRIGGER_HINT_OPS) == set(launchers)
    for op, fn in launchers.items():
        assert LAUNCH_HINTS[op] == ({"entry_trigger": bool, "late_q": bool} if op == "mla_attention"
                                    else {"entry_trigger": bool}), op
        assert inspect.signature(fn).parameters["entry_trigger"].default is False, op


def test_norms_give_the_same_bits_with_the_hint():
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(2, 96, generator=g).to(torch.bfloat16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(torch.bfloat16)
    with poisoned_empty():
        assert torch.equal(rmsnorm.rmsnorm(x, w, EPS, entry_trigger=True), rmsnorm.rmsnorm(x, w, EPS))
        for a, b in zip(rmsnorm.add_rmsnorm(res, x, w, EPS, entry_trigger=True), rmsnorm.add_rmsnorm(res, x, w, EPS)):
            assert torch.equal(a, b)
        xh = x.view(2, 3, 32)
        gate = torch.randn(2, 3, 32, generator=g).to(torch.bfloat16)
        assert torch.equal(kda.gated_rmsnorm(xh, w[:32], gate, EPS, entry_trigger=True),
                           kda.gated_rmsnorm(xh, w[:32], gate, EPS))
        e = torch.randn(2 * 3, 96, generator=g).to(torch.bfloat16)
        tw = torch.rand(2, 3, generator=g)
        for a, b in zip(moe.combine_add_rmsnorm(res, e, tw, w, EPS, entry_trigger=True),
                        moe.combine_add_rmsnorm(res, e, tw, w, EPS)):
            assert torch.equal(a, b)
        ids = torch.tensor([[3, 0, 3]])
        for a, b in zip(rmsnorm.embedding_rmsnorm(ids, e, w, EPS, entry_trigger=True),
                        rmsnorm.embedding_rmsnorm(ids, e, w, EPS)):
            assert torch.equal(a, b)


def test_late_q_turns_q_absorbs_early_path_off(monkeypatch):
    """mla_attention's late_q hint (set by the pdl pass after an entry-triggering mla_prep) launches q_absorb with
    EARLY off, whatever QA_EARLY says; without it EARLY follows QA_EARLY."""
    seen = []

    class Stop(Exception):
        pass

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["EARLY"])
                raise Stop
            return launch

    monkeypatch.setattr(mla, "_q_absorb_kernel", Recorder())
    monkeypatch.setattr(mla, "QA_EARLY", True)
    g = torch.Generator().manual_seed(0)
    q_nope, q_rope = torch.randn(1, 1, 2, 8, generator=g), torch.randn(1, 1, 2, 4, generator=g)
    pages, kv_b = torch.randn(2, 4, 20, generator=g), torch.randn(2 * (8 + 8), 16, generator=g)
    rows, pos = torch.tensor([[0, 1]]), torch.tensor([[5]])
    for late in (False, True):
        with pytest.raises(Stop):
            mla.mla_attention(q_nope, q_rope, pages, kv_b, rows, pos, 0.1, late_q=late)
    assert seen == [True, False]

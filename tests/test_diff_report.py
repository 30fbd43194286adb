"""lingc diff / report: the unified diff and op counts around one pass, and the self-contained HTML page."""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from lingc.artifact import Artifact, read_manifest
from lingc.compile import compile_checkpoint
from lingc.diff import pass_diff
from lingc.report import render, write_report
from lingc.trace import TraceOptions

PASSES = ["fuse_swiglu", "bf16_router", "pdl"]
VOID = {"meta", "br", "hr", "img", "input", "link", "col", "wbr"}


@pytest.fixture(scope="module")
def art(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    """tiny_ckpt compiled once (fp32, every program) with fuse_swiglu,bf16_router,pdl; its manifest."""
    out = tmp_path_factory.mktemp("diff_report") / "art"
    compile_checkpoint(tiny_ckpt, out, PASSES, dtype="fp32", options=TraceOptions(max_len=48, prefill_tokens=16))
    return read_manifest(out)


@pytest.fixture(scope="module")
def page(art: Artifact) -> str:
    return render(art)


def _lines(diff: str, sign: str, needle: str) -> list[str]:
    return [line for line in diff.splitlines()
            if line.startswith(sign) and not line.startswith(sign * 3) and needle in line]


# -- pass_diff ------------------------------------------------------------------------------------------------


def test_fuse_swiglu_diff_swaps_moe_up_for_moe_up_act(art):
    d = pass_diff(art, "fuse_swiglu")
    assert d.pass_name == "fuse_swiglu" and d.index == 1 and d.record["name"] == "fuse_swiglu"
    assert d.diff.startswith("--- trace/00-traced.txt\n+++ trace/01-fuse_swiglu.txt\n")
    removed, added = _lines(d.diff, "-", "= lingc.moe_up("), _lines(d.diff, "+", "= lingc.moe_up_act(")
    assert removed and len(removed) == len(added)
    assert not _lines(d.diff, "+", "= lingc.moe_up(")
    assert set(d.op_counts) == set(art.manifest["programs"])
    for graph, counts in d.op_counts.items():
        n, _ = counts["lingc.moe_up"]
        assert n > 0, graph
        assert counts["lingc.moe_up"] == (n, 0) and counts["lingc.moe_up_act"] == (0, n), graph
        before, after = counts["lingc.silu_and_mul"]
        assert before - after == n, graph
    assert len(removed) == sum(c["lingc.moe_up"][0] for c in d.op_counts.values())


def test_program_option_restricts_the_diff(art):
    full, decode = pass_diff(art, "fuse_swiglu"), pass_diff(art, "fuse_swiglu", "decode")
    assert list(decode.op_counts) == ["decode"]
    assert decode.op_counts["decode"] == full.op_counts["decode"]
    n = decode.op_counts["decode"]["lingc.moe_up"][0]
    assert len(_lines(decode.diff, "-", "= lingc.moe_up(")) == n
    assert len(_lines(decode.diff, "+", "= lingc.moe_up_act(")) == n
    assert len(decode.diff) < len(full.diff)


def test_context_option(art):
    narrow, wide = pass_diff(art, "fuse_swiglu", "decode", context=0), pass_diff(art, "fuse_swiglu", "decode")
    assert len(narrow.diff.splitlines()) < len(wide.diff.splitlines())
    assert all(line[:1] in "-+@" for line in narrow.diff.splitlines())


def test_scheduling_pass_leaves_op_counts_alone(art):
    d = pass_diff(art, "pdl")
    assert d.op_counts == {g: {} for g in art.manifest["programs"]}
    assert _lines(d.diff, "+", "pdl=")


@pytest.mark.parametrize("name", ["fuse_moe_align", "traced", "FUSE_SWIGLU"])
def test_pass_that_did_not_run_lists_the_passes_run(art, name):
    with pytest.raises(KeyError, match=rf"pass '{name}' did not run in .* \(passes run: fuse_swiglu, bf16_router, pdl\)"):
        pass_diff(art, name)


def test_unknown_program_lists_the_programs(art):
    with pytest.raises(KeyError, match=r"no program 'decoder' in .*; programs: .*decode"):
        pass_diff(art, "fuse_swiglu", "decoder")


# -- report ---------------------------------------------------------------------------------------------------


class _TagChecker(HTMLParser):
    """Every non-void start tag is closed, in order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.problems: list[str] = []
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'} at {self.getpos()}")
        else:
            self.stack.pop()


def test_report_is_well_formed(page):
    checker = _TagChecker()
    checker.feed(page)
    checker.close()
    assert checker.problems == [] and checker.stack == []
    assert page.startswith("<!doctype html>")
    ids = [attrs["id"] for _, attrs in checker.tags if "id" in attrs]
    assert len(ids) == len(set(ids)) == len(PASSES)
    links = [attrs["href"] for tag, attrs in checker.tags if tag == "a"]
    assert sorted(links) == sorted(f"#{i}" for i in ids)           # every in-page link has a target


def test_report_is_self_contained(page):
    checker = _TagChecker()
    checker.feed(page)
    for tag, attrs in checker.tags:
        assert tag not in ("script", "link", "iframe", "img"), tag
        for key in ("src", "href"):
            assert not re.match(r"\s*(https?:)?//", attrs.get(key) or ""), (tag, attrs)
    assert not re.search(r"https?://", page)
    assert "@import" not in page and "url(" not in page


def test_report_shows_every_pass_and_its_numerics(art, page):
    for i, record in enumerate(art.manifest["passes"], start=1):
        assert f"<h2 id='p{i}'>{i}. {record['name']}</h2>" in page
    assert page.count('<span class="chg">changed</span>') == 1          # bf16_router
    assert page.count('<span class="same">unchanged</span>') == 2
    assert "changed, tolerance 0.05" in page


def test_report_has_the_pdl_chains_table(art, page):
    chains = next(r for r in art.manifest["passes"] if r["name"] == "pdl")["details"]["chains"]
    assert chains
    assert f"<summary>PDL chains ({len(chains)})</summary>" in page
    for c in chains:
        assert html.escape(" -> ".join(c["nodes"])) in page, c["chain"]


def test_report_has_every_diff(art, page):
    for name in PASSES:
        d = pass_diff(art, name)
        first_change = next(line for line in d.diff.splitlines()[2:] if line.startswith(("+", "-")))
        cls = "add" if first_change.startswith("+") else "del"
        assert f'<span class="{cls}">{html.escape(first_change)}</span>' in page, name
    removed = _lines(pass_diff(art, "fuse_swiglu").diff, "-", "= lingc.moe_up(")[0]
    assert f'<span class="del">{html.escape(removed)}</span>' in page


def test_write_report_writes_render(art, tmp_path):
    out = write_report(art, tmp_path / "r.html")
    assert out == tmp_path / "r.html" and out.read_text() == render(art)

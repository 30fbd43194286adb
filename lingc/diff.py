"""Pass-by-pass inspection of an artifact: the unified diff of the program around one pass, and op counts.

Reads only the artifact's manifest and trace/ snapshots (no graph is loaded, nothing is run).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from lingc.artifact import Artifact


@dataclass
class PassDiff:
    pass_name: str
    index: int
    diff: str                                   # unified diff, before -> after
    op_counts: dict[str, dict[str, tuple[int, int]]]   # graph -> op -> (before, after), changed ops only
    record: dict


def stage_index(art: Artifact, pass_name: str) -> int:
    names = [s["name"] for s in art.manifest["stages"]]
    if pass_name not in names[1:]:
        ran = ", ".join(names[1:]) or "none"
        raise KeyError(f"pass '{pass_name}' did not run in {art.path} (passes run: {ran})")
    return names.index(pass_name, 1)


def _graph_section(text: str, graph: str | None) -> list[str]:
    lines = text.splitlines(keepends=True)
    if graph is None:
        return lines
    out, inside = [], False
    for line in lines:
        if line.startswith("def "):
            inside = line.startswith(f"def {graph}(")
        if inside:
            out.append(line)
    return out


def pass_diff(art: Artifact, pass_name: str, graph: str | None = None, context: int = 3) -> PassDiff:
    """The change one pass made, as a unified diff of the readable program before and after it."""
    i = stage_index(art, pass_name)
    if graph is not None and graph not in art.manifest["programs"]:
        raise KeyError(f"no program '{graph}' in {art.path}; programs: {', '.join(art.manifest['programs'])}")
    before_stage, after_stage = art.manifest["stages"][i - 1], art.manifest["stages"][i]
    before = _graph_section(art.stage_text(i - 1), graph)
    after = _graph_section(art.stage_text(i), graph)
    diff = "".join(difflib.unified_diff(before, after, fromfile=before_stage["file"], tofile=after_stage["file"],
                                        n=context))
    record = next(r for r in art.manifest["passes"] if r["name"] == pass_name)
    counts: dict[str, dict[str, tuple[int, int]]] = {}
    for g in sorted(record["op_counts_after"]):
        if graph is not None and g != graph:
            continue
        b, a = record["op_counts_before"].get(g, {}), record["op_counts_after"][g]
        changed = {op: (b.get(op, 0), a.get(op, 0)) for op in sorted(set(a) | set(b)) if b.get(op, 0) != a.get(op, 0)}
        counts[g] = changed
    return PassDiff(pass_name, i, diff, counts, record)

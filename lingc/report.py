"""lingc report: one self-contained HTML page of an artifact: every pass, its record, its diff, its chains."""

from __future__ import annotations

import html
import json
from pathlib import Path

from lingc.artifact import Artifact
from lingc.diff import pass_diff

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
h1{font-size:1.5em} h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
pre{background:#f7f7f7;padding:8px;overflow-x:auto;font-size:12px;line-height:1.3}
.add{color:#116611;background:#eaffea}.del{color:#991111;background:#ffecec}.hunk{color:#555;background:#eef}
.chg{color:#a40}.same{color:#080} details{margin:.5em 0} summary{cursor:pointer;font-weight:600}
"""


def _diff_html(diff: str) -> str:
    out = []
    for line in diff.splitlines():
        cls = ("add" if line.startswith("+") else "del" if line.startswith("-")
               else "hunk" if line.startswith("@@") else "")
        esc = html.escape(line)
        out.append(f'<span class="{cls}">{esc}</span>' if cls else esc)
    return "<pre>" + "\n".join(out) + "</pre>"


def _counts_html(counts: dict) -> str:
    rows = [f"<tr><td>{html.escape(g)}</td><td>{html.escape(op)}</td><td>{b}</td><td>{a}</td></tr>"
            for g, ops in counts.items() for op, (b, a) in ops.items()]
    if not rows:
        return "<p>op counts unchanged</p>"
    return "<table><tr><th>program</th><th>op</th><th>before</th><th>after</th></tr>" + "".join(rows) + "</table>"


def render(art: Artifact) -> str:
    """The whole report as one HTML string (no external assets)."""
    m = art.manifest
    cfg = m["config"]
    parts = ["<!doctype html><html><head><meta charset='utf-8'>"
             f"<title>lingc report: {html.escape(str(art.path))}</title>"
             f"<style>{STYLE}</style></head><body>",
             f"<h1>lingc artifact <code>{html.escape(str(art.path))}</code></h1>",
             f"<p>created {html.escape(m['created'])} from <code>{html.escape(m.get('source', ''))}</code>; "
             f"programs: {', '.join(m['programs'])}; options: <code>{html.escape(json.dumps(m['options']))}</code></p>",
             f"<p>model: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers + "
             f"{cfg['num_nextn_predict_layers']} MTP, {cfg['num_experts']} experts (top-{cfg['num_experts_per_tok']}), "
             f"vocab {cfg['vocab_size']}</p>",
             "<h2>Passes</h2><table><tr><th>#</th><th>pass</th><th>numerics</th><th>matches</th><th>nodes +/-/~</th>"
             "<th>weights written</th><th>ms</th><th>verify</th></tr>"]
    for i, r in enumerate(m["passes"], start=1):
        numerics = ('<span class="chg">changed</span>' if r["changes_numerics"]
                    else '<span class="same">unchanged</span>')
        verify = "not run" if r.get("verify") is None else ("ok" if r["verify"]["ok"] else "FAILED")
        parts.append(f"<tr><td>{i}</td><td><a href='#p{i}'>{html.escape(r['name'])}</a></td><td>{numerics}</td>"
                     f"<td>{r['matches']}</td><td>+{len(r['nodes_added'])} / -{len(r['nodes_removed'])} / "
                     f"~{len(r['nodes_rewritten'])}</td><td>{len(r['weights_added']) + len(r['weights_changed'])}</td>"
                     f"<td>{r['ms']:.1f}</td><td>{verify}</td></tr>")
    parts.append("</table>")
    for i, r in enumerate(m["passes"], start=1):
        d = pass_diff(art, r["name"])
        parts.append(f"<h2 id='p{i}'>{i}. {html.escape(r['name'])}</h2>")
        parts.append(
            f"<p>version {r['version']}; numerics "
            f"{'changed, tolerance ' + str(r['tolerance']) if r['changes_numerics'] else 'unchanged (bit-exact)'}</p>")
        parts.append("<h3>Op counts</h3>" + _counts_html(d.op_counts))
        chains = r.get("details", {}).get("chains")
        if chains:
            rows = "".join(f"<tr><td>{html.escape(c['graph'])}</td><td>{html.escape(c['chain'])}</td>"
                           f"<td>{html.escape(' -> '.join(c['nodes']))}</td></tr>" for c in chains)
            parts.append(f"<details><summary>PDL chains ({len(chains)})</summary><table><tr><th>program</th>"
                         f"<th>chain</th><th>kernels</th></tr>{rows}</table></details>")
        parts.append(f"<details><summary>Graph diff ({d.diff.count(chr(10))} lines)</summary>"
                     f"{_diff_html(d.diff)}</details>")
        record = {k: v for k, v in r.items() if k not in ("op_counts_before", "op_counts_after")}
        parts.append("<details><summary>Record</summary>"
                     f"<pre>{html.escape(json.dumps(record, indent=1))}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(art: Artifact, out: str | Path) -> Path:
    out = Path(out)
    out.write_text(render(art))
    return out

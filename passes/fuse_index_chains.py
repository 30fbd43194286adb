"""fuse_index_chains: merge the page-table gather and the cache-location arithmetic into one op.

Before (once per MLA layer call):
    page_rows = lingc.gather_rows(page_table, slots)                 # [B, MP]
    locs      = lingc.cache_locs(page_rows, positions, PS)           # [B, T]
After:
    refill    = lingc.paged_refill(page_table, slots, positions, PS) # (page_rows, locs)
    page_rows = getitem(refill, 0); locs = getitem(refill, 1)
One launch instead of two, same integers: numerics unchanged. Every side effect stays where it was
(no write is touched); unallocated page-table entries keep pointing at the harmless page.
(techniques.md section 4: SGLang's fused cache-location and state-index kernels.)
"""

from __future__ import annotations

import operator
from typing import Any

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import calls


class FuseIndexChains(Pass):
    name = "fuse_index_chains"
    summary = "fuse page-table gather + cache-location math into one paged_refill op per use"
    after = ("partition",)
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        fused = []
        for gname, graph in program.graphs.items():
            for locs in calls(graph, "cache_locs"):
                page_rows, positions, page_size = locs.args
                if page_rows.target is not OPS.gather_rows or page_rows.args[0].target != "page_table":
                    continue
                page_table, slots = page_rows.args
                with graph.inserting_before(locs):
                    refill = graph.call_function(OPS.paged_refill, (page_table, slots, positions, page_size))
                    rows = graph.call_function(operator.getitem, (refill, 0))
                    flat = graph.call_function(operator.getitem, (refill, 1))
                scope = locs.meta.get("lingc.scope", "")
                for n in (refill, rows, flat):
                    n.meta = {"lingc.scope": scope, **({"lingc.stage": locs.meta["lingc.stage"]}
                                                       if "lingc.stage" in locs.meta else {})}
                refill._rename(locs.name.replace("cache_locs", "paged_refill"))
                locs.replace_all_uses_with(flat)
                page_rows.replace_all_uses_with(rows)
                graph.erase_node(locs)
                if not page_rows.users:
                    graph.erase_node(page_rows)
                fused.append(f"{gname}:{refill.name}")
        return {"matches": len(fused), "fused": fused}

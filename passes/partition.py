"""partition: split the traced NEXTN step into the draft, verify and extend graphs, with explicit relays.

Before: one graph `nextn` whose nodes carry lingc.stage in {draft, verify, extend} (lingc.steps).
After:  graphs `draft`, `verify`, `extend`, run in that order every step. A value made in one stage
and used in a later one crosses through a persistent relay buffer indexed by request slot (the
FutureMap idea, techniques.md section 1):
    draft:   lingc.scatter_rows(relay_x_draft_ids, slots, draft_ids)          # new input [S, K]
    verify:  draft_ids = lingc.gather_rows(relay_x_draft_ids, slots)
The buffers are new inputs with role relay:x.<value> and meta lingc.relay = {from, to}; `lingc diff`
shows them. A crossing value that is just a read of a buffer nobody writes during the step is read
again in the consumer instead (no relay needed).
(Verify's KDA layers already stage their state and commit after acceptance: lingc.steps.)
Numerics unchanged: draft -> verify -> extend computes what nextn computes, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program, TensorMeta
from lingc.passes.base import Pass
from lingc.steps import COPY_SUFFIXES

STAGES = ("draft", "verify", "extend")


def _mutated_inputs(graph: fx.Graph) -> set[fx.Node]:
    out: set[fx.Node] = set()
    for n in graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        named = dict(zip([a.name for a in schema.arguments], n.args)) | dict(n.kwargs)
        out |= {v for k, v in named.items() if k in written and isinstance(v, fx.Node)}
    return out


class Partition(Pass):
    name = "partition"
    summary = ("split the NEXTN step into draft / verify / extend graphs with slot-indexed relay buffers; "
               "stage KDA in verify")
    after = ("specialize_greedy", "specialize_sampling")
    changes_numerics = False
    # --verify runs the three in order against the whole (and each specialised copy's against its nextn copy)
    splits = {"nextn" + suffix: tuple(s + suffix for s in STAGES) for suffix in ("",) + COPY_SUFFIXES}

    def apply(self, program: Program) -> dict[str, Any]:
        relays: list[dict[str, Any]] = []
        matches = 0
        for whole, parts in self.splits.items():
            if whole in program.graphs:
                relays += self._split(program, whole, dict(zip(STAGES, parts)))
                matches += 1
        return {"matches": matches, "relays": relays}

    def _split(self, program: Program, whole: str, names: dict[str, str]) -> list[dict[str, Any]]:
        """Replace graph `whole` by one graph per stage (named names[stage]); returns the relays made."""
        source = program.graphs.pop(whole)
        slots_total = int(program.options.get("request_slots", 1))
        written = _mutated_inputs(source)
        stage_of = {n: n.meta.get("lingc.stage") for n in source.nodes}
        graphs = {s: fx.Graph() for s in STAGES}
        envs: dict[str, dict[fx.Node, fx.Node]] = {s: {} for s in STAGES}
        relays: list[dict[str, Any]] = []
        relay_inputs: dict[fx.Node, str] = {}
        relay_meta: dict[str, dict] = {}

        def value_in(stage: str, node: fx.Node) -> fx.Node:
            """node's value inside `stage`'s graph, copying inputs / weights or reading a relay."""
            env, graph = envs[stage], graphs[stage]
            if node in env:
                return env[node]
            if node.op == "placeholder":
                new = _placeholder(graph, node.target, node.meta)            # inputs stay at the top
            elif node.op == "get_attr":
                # weights next, as traced: pdl hoists a kernel above a chain only if all it reads comes first
                first = next((n for n in graph.nodes if n.op not in ("placeholder", "get_attr")), None)
                with graph.inserting_before(first) if first is not None else graph.inserting_after(None):
                    new = graph.get_attr(node.target)
                new.meta = dict(node.meta)
                new._rename(node.name)
            elif node.target is OPS.gather_rows and node.args[0].op == "placeholder" and node.args[0] not in written:
                new = graph.call_function(OPS.gather_rows, tuple(value_in(stage, a) for a in node.args))
                new.meta = dict(node.meta, **{"lingc.stage": stage})
                new._rename(node.name)
            else:
                buf_name = relay_inputs.get(node) or self._relay_out(node, stage_of[node], graphs, envs, slots_total,
                                                                      relays, relay_inputs, relay_meta)
                buf = _placeholder(graph, buf_name, relay_meta[buf_name])      # the same buffer, read here
                new = graph.call_function(OPS.gather_rows, (buf, value_in(stage, _slots(source))))
                new.meta = {"lingc.stage": stage, "lingc.scope": "relay"}
                new._rename(node.name + "_relay")
                next(r for r in relays if r["buffer"] == buf_name)["to"].append(stage)
            env[node] = new
            return new

        for node in source.nodes:
            stage = stage_of[node]
            if node.op != "call_function" or stage not in graphs:
                continue
            args = fx.node.map_arg(node.args, lambda a: value_in(stage, a))
            kwargs = fx.node.map_arg(node.kwargs, lambda a: value_in(stage, a))
            new = graphs[stage].call_function(node.target, args, kwargs)
            new.meta = dict(node.meta)
            new._rename(node.name)
            envs[stage][node] = new
        for s in STAGES:
            graphs[s].output(None)
            graphs[s].eliminate_dead_code()
        program.graphs.update({names[s]: g for s, g in graphs.items()})
        for r in relays:                                  # stage -> graph name (they differ for the greedy copy)
            r["from"], r["to"] = names[r["from"]], [names[t] for t in r["to"]]
        for graph in graphs.values():
            for node in graph.nodes:
                if "lingc.relay" in node.meta:
                    relay = node.meta["lingc.relay"]
                    node.meta["lingc.relay"] = dict(relay, **{"from": names[relay["from"]]})
        return relays

    def _relay_out(self, node: fx.Node, stage: str, graphs: dict, envs: dict, slots_total: int,
                   relays: list, relay_inputs: dict, relay_meta: dict) -> str:
        """Make `node` (a value of `stage`) persistent: a new relay input and a scatter into it by slot."""
        meta: TensorMeta = node.meta["lingc.tensor"]
        name = f"relay_x_{node.name}"
        graph = graphs[stage]
        relay_meta[name] = {"lingc.input": f"relay:x.{node.name}",
                            "lingc.tensor": TensorMeta((slots_total, *meta.shape[1:]), meta.dtype),
                            "lingc.relay": {"from": stage, "value": node.name}}
        buf = _placeholder(graph, name, relay_meta[name])
        slots = next(n for n in graph.nodes if n.op == "placeholder" and n.target == "slots")
        with graph.inserting_after(envs[stage][node]):
            w = graph.call_function(OPS.scatter_rows, (buf, slots, envs[stage][node]))
        w.meta = {"lingc.stage": stage, "lingc.scope": "relay"}
        w._rename(node.name + "_to_relay")
        relay_inputs[node] = name
        relays.append({"buffer": name, "value": node.name, "from": stage, "to": [],
                       "shape": [slots_total, *meta.shape[1:]], "dtype": str(meta.dtype).removeprefix("torch.")})
        return name


def _slots(graph: fx.Graph) -> fx.Node:
    return next(n for n in graph.nodes if n.op == "placeholder" and n.target == "slots")


def _placeholder(graph: fx.Graph, name: str, meta: dict) -> fx.Node:
    """The input `name` of graph, created (before the first non-input node) if missing."""
    for n in graph.nodes:
        if n.op == "placeholder" and n.target == name:
            return n
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    ctx = graph.inserting_before(first) if first is not None else graph.inserting_after(None)
    with ctx:
        node = graph.placeholder(name)
    node.meta = {k: v for k, v in meta.items() if k in ("lingc.input", "lingc.tensor", "lingc.relay")}
    if "lingc.input" not in node.meta:
        node.meta["lingc.input"] = "relay:" + name.removeprefix("relay_")
    node._rename(name)
    return node

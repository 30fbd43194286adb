"""lingc.trace: capture fixed-shape step programs of the reference model as torch.fx graphs.

Host-fed programs (the prompt; the host gives ids and positions):
  prefill      target over a T-token chunk   (input_ids, positions, slots, page_table, state) -> (logits, hidden)
  decode       target, one token             same signature, T = 1
  mtp_prefill  MTP layer over T tokens with the target's hidden states
                                             (next_ids, hidden, positions, slots, page_table, state)
                                             -> (logits, mtp_hidden)
  mtp_decode   the same, T = 1
Device-fed engine steps (lingc.steps; the host gives only `slots`, everything else is in relay buffers):
  step         plain decode: sample in-graph, publish the token, advance
  nextn        one NEXTN round in three stages (node.meta lingc.stage = draft / verify / extend),
               which the `partition` pass splits into the `draft`, `verify` and `extend` graphs
Capture is make_fx over fake tensors: no weight is read, shapes are concrete, and every op the model
calls appears as one node. Weights become get_attr nodes named as the model's parameters; state pools
and relay buffers are inputs the graph updates in place. Node names say which module made them.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from lingc.model import LingForCausalLM
from lingc.ops.registry import op_name
from lingc.ir.shapes import meta_of
from lingc.program import Program
from lingc.state import ModelState, pools, staging_buffers
from lingc.steps import decode_step, nextn_step, relay_specs

PROGRAMS = ("prefill", "decode", "mtp_prefill", "mtp_decode", "step", "nextn")
TARGET_PROGRAMS = ("prefill", "decode")
MTP_PROGRAMS = ("mtp_prefill", "mtp_decode")
ENGINE_PROGRAMS = ("step", "nextn")


@dataclass(frozen=True)
class TraceOptions:
    batch: int = 1                # requests per step (padded)
    prefill_tokens: int = 32      # tokens per prefill chunk
    max_len: int = 512            # tokens per request (prompt + output)
    page_size: int = 16           # latent-cache rows per page
    request_slots: int = 2        # slots in the state pools and relay buffers
    draft_tokens: int = 6         # verify width = NEXTN steps + 1 (5/6)

    def __post_init__(self) -> None:
        if self.max_len % self.page_size:
            raise ValueError(f"max_len {self.max_len} must be a multiple of page_size {self.page_size}")
        if self.request_slots < self.batch:
            raise ValueError(f"request_slots {self.request_slots} < batch {self.batch}")

    @property
    def draft_steps(self) -> int:
        return self.draft_tokens - 1

    @property
    def pages_per_request(self) -> int:
        return self.max_len // self.page_size

    @property
    def pages(self) -> int:
        """Every slot's pages plus one harmless page that unallocated page-table entries point at."""
        return self.request_slots * self.pages_per_request + 1


def trace(model: LingForCausalLM, programs: tuple[str, ...] | list[str] = ("prefill", "decode"),
          options: TraceOptions | None = None) -> Program:
    """Trace the named step programs of `model` into one Program sharing the model's weights."""
    options = options or TraceOptions()
    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown:
        raise ValueError(f"unknown program(s) {unknown}; known: {list(PROGRAMS)}")
    needs_mtp = [p for p in programs if p in MTP_PROGRAMS or p == "nextn"]
    if needs_mtp and model.config.num_nextn_predict_layers == 0:
        raise ValueError(f"program(s) {needs_mtp} need an MTP layer; the config has num_nextn_predict_layers = 0")
    weights = {k: v for k, v in model.named_parameters()}
    graphs = {p: _trace_one(model, p, options, weights) for p in programs}
    used = {n.target for g in graphs.values() for n in g.nodes if n.op == "get_attr"}
    opts = {**asdict(options), "dtype": str(model.dtype).removeprefix("torch.")}
    return Program(model.config, graphs, {k: v for k, v in weights.items() if k in used}, {}, opts)


def state_input_name(key: str) -> str:
    """Placeholder name of state tensor 'layers.3.kv_pages' -> 'state_layers_3_kv_pages'."""
    return "state_" + key.replace(".", "_")


def state_key(name: str) -> str:
    """Inverse of state_input_name: 'state_layers_3_kv_pages' -> 'layers.3.kv_pages'."""
    m = re.fullmatch(r"state_layers_(\d+)_(.+)", name)
    if not m:
        raise ValueError(f"{name!r} is not a state input name")
    return f"layers.{m.group(1)}.{m.group(2)}"


def example_inputs(model: LingForCausalLM, program: str, options: TraceOptions) -> dict[str, torch.Tensor]:
    """Inputs of the right shapes for `program` by placeholder name (zeros; slots 0..B-1, page table in order)."""
    c, B = model.config, options.batch
    device = model.lm_head.weight.device
    T = {"prefill": options.prefill_tokens, "decode": 1, "mtp_prefill": options.prefill_tokens,
         "mtp_decode": 1}.get(program, 0)
    inputs: dict[str, torch.Tensor] = {}
    ids = torch.zeros(B, T, dtype=torch.int64, device=device)
    if program in TARGET_PROGRAMS:
        inputs["input_ids"] = ids
    elif program in MTP_PROGRAMS:
        inputs["next_ids"] = ids
        inputs["hidden"] = torch.zeros(B, T, c.hidden_size, dtype=model.dtype, device=device)
    if T:
        inputs["positions"] = ids.clone()
    inputs["slots"] = torch.arange(B, dtype=torch.int32, device=device)
    inputs["page_table"] = torch.arange(options.pages - 1, dtype=torch.int32, device=device).view(
        options.request_slots, options.pages_per_request)
    if program in ENGINE_PROGRAMS:
        for r in relay_specs(c, options.draft_tokens, model.dtype):
            inputs["relay_" + r.name] = torch.zeros(options.request_slots, *r.shape, dtype=r.dtype, device=device)
    state = pools(c, options.request_slots, options.pages, options.page_size, model.dtype, device)
    inputs.update({state_input_name(k): v for k, v in state.items()})
    if program == "nextn":
        staged = staging_buffers(c, B, options.draft_tokens, model.dtype, device)
        inputs.update({"staging_" + k.replace(".", "_"): v for k, v in staged.items()})
    return inputs


def _input_role(name: str) -> str:
    if name.startswith("state_"):
        return "state:" + state_key(name)
    if name.startswith("staging_"):
        return "staging:" + state_key("state_" + name[len("staging_"):])
    if name.startswith("relay_"):
        return "relay:" + name[len("relay_"):]
    return name


def _step_function(model: LingForCausalLM, program: str, options: TraceOptions, stage: Callable) -> Callable:
    def target(inputs: dict, state: ModelState):
        return model.step(inputs["input_ids"], inputs["positions"], state)

    def mtp(inputs: dict, state: ModelState):
        return model.mtp_step(inputs["next_ids"], inputs["hidden"], inputs["positions"], state)

    def relay(inputs: dict) -> dict:
        return {k[len("relay_"):]: v for k, v in inputs.items() if k.startswith("relay_")}

    def step(inputs: dict, state: ModelState):
        decode_step(model, inputs["slots"], relay(inputs), state)

    def nextn(inputs: dict, state: ModelState):
        nextn_step(model, inputs["slots"], relay(inputs), state, options.draft_tokens, stage)

    return {"prefill": target, "decode": target, "mtp_prefill": mtp, "mtp_decode": mtp,
            "step": step, "nextn": nextn}[program]


def _tag_stage(name: str, fn: Callable[[], Any]) -> Any:
    """Run fn while tracing and mark the nodes it made with lingc.stage = name."""
    graph = get_proxy_mode().tracer.graph
    before = set(graph.nodes)
    out = fn()
    for node in graph.nodes:
        if node not in before:
            node.meta["lingc.stage"] = name
    return out


def _trace_one(model: LingForCausalLM, program: str, options: TraceOptions,
               weights: dict[str, torch.Tensor]) -> fx.Graph:
    inputs = example_inputs(model, program, options)
    keys = list(inputs)
    names = list(weights)
    step = _step_function(model, program, options, _tag_stage)

    def fn(weight_list, input_list):
        named = dict(zip(keys, input_list))
        state = ModelState({state_key(k): t for k, t in named.items() if k.startswith("state_")},
                           named["slots"], named["page_table"], options.page_size,
                           {state_key("state_" + k[len("staging_"):]): t for k, t in named.items()
                            if k.startswith("staging_")})
        with torch.nn.utils.stateless._reparametrize_module(model, dict(zip(names, weight_list))):
            return step(named, state)

    with _ScopeRecorder(model) as scopes, torch.no_grad():
        gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=False)(
            list(weights.values()), [inputs[k] for k in keys])
        scopes.flush()
    graph = fx.Graph()                 # detach from make_fx's module (its attributes are not ours)
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    for old, new in env.items():
        new.meta = old.meta
    return _clean(graph, names, keys)


class _ScopeRecorder:
    """Tags each node made during tracing with the innermost module running when it was made."""

    def __init__(self, root: torch.nn.Module):
        self.root, self.stack, self.handles = root, [], []
        self.last: fx.Node | None = None

    def __enter__(self) -> "_ScopeRecorder":
        for name, mod in self.root.named_modules():
            self.handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: self._push(n)))
            self.handles.append(mod.register_forward_hook(lambda m, a, o, n=name: self._pop()))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def _push(self, name: str) -> None:
        self.flush()
        self.stack.append(name)

    def _pop(self) -> None:
        self.flush()
        self.stack.pop()

    def flush(self) -> None:
        mode = get_proxy_mode()
        if mode is None:
            return
        scope = self.stack[-1] if self.stack else ""
        for node in reversed(mode.tracer.graph.nodes):
            if "lingc.scope" in node.meta:
                break
            node.meta["lingc.scope"] = scope


def node_base_name(node: fx.Node) -> str:
    """Readable name from scope and op: model.layers.3.mlp + lingc.moe_up -> L3_mlp_moe_up."""
    scope = node.meta.get("lingc.scope", "") or node.meta.get("lingc.stage", "")
    scope = re.sub(r"^model\.layers\.(\d+)\.?", r"L\1_", scope).removeprefix("model.").replace(".", "_")
    op = op_name(node.target).split(".")[1] if node.op == "call_function" and "." in op_name(node.target) \
        else getattr(node.target, "__name__", str(node.target))
    return re.sub(r"_+", "_", f"{scope}_{op}" if scope else op).strip("_")


def _clean(graph: fx.Graph, weight_names: list[str], input_keys: list[str]) -> fx.Graph:
    """Placeholders -> get_attr weights and named inputs; lingc meta; readable node names; unused inputs dropped."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    n_w = len(weight_names)
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for i, ph in enumerate(placeholders):
        if i < n_w:
            if ph.users:
                with graph.inserting_before(first_op):
                    attr = graph.get_attr(weight_names[i])
                attr.meta = {"lingc.tensor": meta_of(ph.meta.get("val"))}
                ph.replace_all_uses_with(attr)
            graph.erase_node(ph)
            continue
        key = input_keys[i - n_w]
        ph.meta = {"lingc.input": _input_role(key), "lingc.tensor": meta_of(ph.meta.get("val"))}
        ph.target = key
        ph._rename(key)
    for node in graph.nodes:
        if node.op in ("call_function", "output"):
            keep = {k: node.meta[k] for k in ("lingc.scope", "lingc.stage") if k in node.meta}
            node.meta = {**keep, "lingc.tensor": meta_of(node.meta.get("val"))}
    graph.eliminate_dead_code()        # e.g. the draft chain's last position increment
    for node in list(graph.nodes):
        if node.op == "placeholder" and not node.users:
            graph.erase_node(node)     # pools and relays this program does not touch
    for node in graph.nodes:
        if node.op == "call_function":
            node._rename(node_base_name(node))
        elif node.op == "get_attr":
            node._rename("w_" + node.target.replace(".", "_").replace("model_layers_", "L"))
    graph.lint()
    return graph

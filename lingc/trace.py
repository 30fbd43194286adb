"""lingc.trace: capture fixed-shape step programs of the reference model as torch.fx graphs.

Programs (B = batch, T = tokens of the step):
  prefill  target over a T-token prompt chunk      (input_ids, positions, target state) -> (logits, hidden)
  decode   target, one token                       same signature, T = 1
  verify   target over the draft chain             same signature, T = draft_tokens
  extend   MTP layer over T tokens with the target's hidden states
                                                   (next_ids, hidden, positions, MTP state) -> (logits, mtp_hidden)
  draft    MTP layer run autoregressively, steps - 1 forwards, greedy chain (topk = 1)
                                                   (next_ids [B,1], hidden [B,1,h], positions, MTP state)
                                                   -> (draft_ids [B, steps-1], draft_logits [B, steps-1, V])
Capture is make_fx over fake tensors: no weight is read, shapes are concrete, and every op the model
calls appears as one node. Weights become get_attr nodes named as the model's parameters; state
tensors are inputs the graph updates in place. Node names say which module made them (L3_mlp_moe_up).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from lingc.model import LingForCausalLM
from lingc.ops.registry import op_name
from lingc.program import Program, TensorMeta
from lingc.state import ModelState

PROGRAMS = ("prefill", "decode", "verify", "extend", "draft")
TARGET_PROGRAMS = ("prefill", "decode", "verify")
MTP_PROGRAMS = ("extend", "draft")


@dataclass(frozen=True)
class TraceOptions:
    batch: int = 1
    prefill_tokens: int = 32      # tokens per prefill chunk
    max_len: int = 256            # cache slots per request
    draft_tokens: int = 6         # verify width = steps + 1 (NEXTN 5/6)
    extend_tokens: int = 6        # MTP extend width (accepted prefix, at most draft_tokens)

    @property
    def draft_steps(self) -> int:
        return self.draft_tokens - 1


def trace(model: LingForCausalLM, programs: tuple[str, ...] | list[str] = ("prefill", "decode"),
          options: TraceOptions | None = None) -> Program:
    """Trace the named step programs of `model` into one Program sharing the model's weights."""
    options = options or TraceOptions()
    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown:
        raise ValueError(f"unknown program(s) {unknown}; known: {list(PROGRAMS)}")
    if any(p in MTP_PROGRAMS for p in programs) and model.config.num_nextn_predict_layers == 0:
        raise ValueError("programs 'extend' and 'draft' need an MTP layer; the config has num_nextn_predict_layers = 0")
    weights = {k: v for k, v in model.named_parameters()}
    graphs = {p: _trace_one(model, p, options, weights) for p in programs}
    used = {n.target for g in graphs.values() for n in g.nodes if n.op == "get_attr"}
    opts = {"batch": options.batch, "prefill_tokens": options.prefill_tokens, "max_len": options.max_len,
            "draft_tokens": options.draft_tokens, "extend_tokens": options.extend_tokens,
            "dtype": str(model.dtype).removeprefix("torch.")}
    return Program(model.config, graphs, {k: v for k, v in weights.items() if k in used}, {}, opts)


def example_inputs(model: LingForCausalLM, program: str, options: TraceOptions) -> dict[str, torch.Tensor]:
    """Inputs of the right shapes (zeros) for `program`, by placeholder name, on the model's device."""
    c, B = model.config, options.batch
    T = {"prefill": options.prefill_tokens, "decode": 1, "verify": options.draft_tokens,
         "extend": options.extend_tokens, "draft": 1}[program]
    device = model.lm_head.weight.device
    ids = torch.zeros(B, T, dtype=torch.int64, device=device)
    inputs: dict[str, torch.Tensor] = {}
    if program in TARGET_PROGRAMS:
        inputs["input_ids"] = ids
        layers = range(c.num_hidden_layers)
    else:
        inputs["next_ids"] = ids
        inputs["hidden"] = torch.zeros(B, T, c.hidden_size, dtype=model.dtype, device=device)
        layers = range(c.num_hidden_layers, c.num_hidden_layers + 1)
    inputs["positions"] = ids.clone()
    state = ModelState.new(c, B, options.max_len, model.dtype, device, layers)
    inputs.update({state_input_name(k): v for k, v in state.tensors.items()})
    return inputs


def state_input_name(key: str) -> str:
    """Placeholder name of state tensor 'layers.3.kv_cache' -> 'state_layers_3_kv_cache'."""
    return "state_" + key.replace(".", "_")


def _step_function(model: LingForCausalLM, program: str, options: TraceOptions) -> Callable:
    def target_step(input_ids, positions, state):
        return model.step(input_ids, positions, state)

    def extend_step(next_ids, hidden, positions, state):
        return model.mtp_step(next_ids, hidden, positions, state)

    def draft_chain(next_ids, hidden, positions, state):
        ids, logits_out = [], []
        for _ in range(options.draft_steps - 1):     # the first draft token comes from extend
            logits, hidden = model.mtp_step(next_ids, hidden, positions, state)
            next_ids = torch.ops.lingc.greedy_sample(logits)
            positions = positions + 1
            ids.append(next_ids)
            logits_out.append(logits)
        return torch.cat(ids, dim=1), torch.cat(logits_out, dim=1)

    return {"prefill": target_step, "decode": target_step, "verify": target_step,
            "extend": extend_step, "draft": draft_chain}[program]


def _trace_one(model: LingForCausalLM, program: str, options: TraceOptions,
               weights: dict[str, torch.Tensor]) -> fx.Graph:
    inputs = example_inputs(model, program, options)
    state_keys = [k for k in inputs if k.startswith("state_")]
    plain_keys = [k for k in inputs if not k.startswith("state_")]
    names = list(weights)
    step = _step_function(model, program, options)
    max_len = options.max_len

    def fn(weight_list, plain_list, state_list):
        state = ModelState({state_key(k): t for k, t in zip(state_keys, state_list)}, max_len)
        with torch.nn.utils.stateless._reparametrize_module(model, dict(zip(names, weight_list))):
            return step(*plain_list, state)

    with _ScopeRecorder(model) as scopes, torch.no_grad():
        gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=False)(
            list(weights.values()), [inputs[k] for k in plain_keys], [inputs[k] for k in state_keys])
        scopes.flush()
    graph = fx.Graph()                 # detach from make_fx's module (its attributes are not ours)
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    for old, new in env.items():
        new.meta = old.meta
    return _clean(graph, names, plain_keys, state_keys, program)


def state_key(name: str) -> str:
    """Inverse of state_input_name: 'state_layers_3_kv_cache' -> 'layers.3.kv_cache'."""
    m = re.fullmatch(r"state_layers_(\d+)_(.+)", name)
    assert m, name
    return f"layers.{m.group(1)}.{m.group(2)}"


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


def _to_meta(val: object) -> TensorMeta | list | None:
    if isinstance(val, torch.Tensor):
        return TensorMeta(tuple(val.shape), val.dtype)
    if isinstance(val, (list, tuple)):
        return [_to_meta(v) for v in val]
    return None


def node_base_name(node: fx.Node) -> str:
    """Readable name from scope and op: model.layers.3.mlp + lingc.moe_up -> L3_mlp_moe_up."""
    scope = node.meta.get("lingc.scope", "")
    scope = re.sub(r"^model\.layers\.(\d+)\.?", r"L\1_", scope).removeprefix("model.").replace(".", "_")
    op = op_name(node.target).split(".")[1] if node.op == "call_function" and "." in op_name(node.target) \
        else getattr(node.target, "__name__", str(node.target))
    return re.sub(r"_+", "_", f"{scope}_{op}" if scope else op).strip("_")


def _clean(graph: fx.Graph, weight_names: list[str], plain_keys: list[str], state_keys: list[str],
           program: str) -> fx.Graph:
    """Placeholders -> get_attr weights and named inputs; lingc meta; readable node names."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    n_w, n_p = len(weight_names), len(plain_keys)
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for i, ph in enumerate(placeholders):
        if i < n_w:
            if ph.users:
                with graph.inserting_before(first_op):
                    attr = graph.get_attr(weight_names[i])
                attr.meta = {"lingc.tensor": _to_meta(ph.meta.get("val"))}
                ph.replace_all_uses_with(attr)
            graph.erase_node(ph)
            continue
        key = plain_keys[i - n_w] if i < n_w + n_p else state_keys[i - n_w - n_p]
        ph.meta = {"lingc.input": key if i < n_w + n_p else "state:" + state_key(key),
                   "lingc.tensor": _to_meta(ph.meta.get("val"))}
        ph.target = key
        ph._rename(key)
    for node in graph.nodes:
        if node.op in ("call_function", "output"):
            scope = node.meta.get("lingc.scope", "")
            node.meta = {"lingc.scope": scope, "lingc.tensor": _to_meta(node.meta.get("val"))}
    graph.eliminate_dead_code()        # e.g. the draft chain's last position increment
    for node in graph.nodes:
        if node.op == "call_function":
            node._rename(node_base_name(node))
        elif node.op == "get_attr":
            node._rename("w_" + node.target.replace(".", "_").replace("model_layers_", "L"))
    graph.lint()
    return graph

"""How well a MoE layer's routed experts can be predicted before its attention runs (CPU, reference model).

The decode step's largest excess over the byte floor is the MoE up-GEMM (docs/measurements.md): its weights are known
only once the router has run on the attention's output, so its first bytes come ~2 us after its PDL wait and an L2
prefetch of the picked experts can only run beside it. A prediction from the layer's input (the pre-attention
residual h, normalised with the layer's post-attention norm and routed by its own gate, the same grouped selection)
would let a prefetch start a whole attention block earlier. This measures, per MoE layer, the fraction of the router's
top-k that such a prediction gets right, over a prompt's prefill positions and a few decode steps, on lingc's random
checkpoint at the real widths (Ling-3.0-tiny's 2048 hidden, 128 experts, top 8 in 4 of 8 groups; fewer layers to fit
the CPU). Random weights are not a real model: their attention outputs dwarf the 0.02-scale embeddings, so the
residual changes more across a layer than a trained model's is expected to; the numbers are a floor on the idea, not
a forecast.

    python3 bench/expert_prediction.py [--layers 12] [--prompt 48] [--new 6] [--json OUT.json]

2026-12-07 (12 layers, 48-token prompt, 6 new tokens, seed 0): KDA layers' MoE 0.50-0.75 of the picks, the MLA layers'
(3, 7, 11) 0.92-0.95.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lingc.init import random_model
from lingc.model import DecoderLayer
from lingc.modules import MoE
from lingc.ops import OPS as ops
from lingc.presets import preset


def measure(layers: int, prompt: int, new: int, seed: int = 0, config_name: str = "ling-3.0-tiny") -> dict[str, dict]:
    """{MoE module name: {"hit": mean fraction of the router's picks predicted, "hit_decode": the same over the
    decode steps only, "positions": how many}} on the random checkpoint of preset `config_name`."""
    config = preset(config_name, num_hidden_layers=layers)
    model = random_model(config, seed=seed)
    names = {id(m): n for n, m in model.named_modules()}
    hits: dict[int, list[float]] = {}
    current: dict = {}
    layer_forward, moe_forward = DecoderLayer.forward, MoE.forward

    def on_layer(self, x, meta, state):
        current["h"], current["layer"] = x, self
        return layer_forward(self, x, meta, state)

    def on_moe(self, x):
        n, hidden = x.shape[0] * x.shape[1], x.shape[2]
        _, picked = ops.router_topk(self.gate(x.reshape(n, hidden)), self.gate.expert_bias, *self.routing)
        early = current["layer"].post_attention_layernorm(current["h"]).reshape(n, hidden)
        _, predicted = ops.router_topk(self.gate(early), self.gate.expert_bias, *self.routing)
        k = picked.shape[-1]
        hits.setdefault(id(self), []).extend(len(set(a.tolist()) & set(b.tolist())) / k
                                             for a, b in zip(picked, predicted))
        return moe_forward(self, x)

    DecoderLayer.forward, MoE.forward = on_layer, on_moe
    try:
        ids = torch.randint(0, config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new)
    finally:
        DecoderLayer.forward, MoE.forward = layer_forward, moe_forward
    decode = max(new - 1, 1)     # generate's last token is not fed back
    return {names[key]: {"hit": sum(v) / len(v), "hit_decode": sum(v[-decode:]) / len(v[-decode:]),
                         "positions": len(v)} for key, v in hits.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12, help="target layers of the Ling-3.0-tiny config (24 in full)")
    ap.add_argument("--prompt", type=int, default=48, help="prompt tokens")
    ap.add_argument("--new", type=int, default=6, help="new tokens (decode steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="ling-3.0-tiny", help="the config (lingc/presets.py)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    start = time.time()
    rows = measure(args.layers, args.prompt, args.new, args.seed, args.preset)
    for name, row in rows.items():
        print(f"{name:24s} hit {row['hit']:.3f}  decode {row['hit_decode']:.3f}  ({row['positions']} positions)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": vars(args), "seconds": time.time() - start, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""The Ling-3.0 (BailingMoeV3) reference model: the numerical truth every pass and kernel is checked against.

x = embed(ids); per layer: x += mixer(input_norm(x)) (KDA or gated MLA), x += ffn(post_norm(x))
(dense SwiGLU or MoE); logits = lm_head(norm(x)) in fp32. MTP layers (`model.layers.{L..}`) predict
one token further from the normed hidden state and the next token's embedding.
Written from shared/docs/architecture.md; modules in lingc.modules, state in lingc.state.
"""

from __future__ import annotations

import torch
from torch import nn

from lingc.config import LingConfig
from lingc.modules import KDA, MLA, MLP, Linear, MoE, RMSNorm
from lingc.ops import OPS as ops
from lingc.state import ModelState, StepMeta


class DecoderLayer(nn.Module):
    def __init__(self, c: LingConfig, i: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.attention = MLA(c, dtype) if c.is_mla_layer(i) else KDA(c, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = MoE(c, i, dtype) if c.is_moe_layer(i) else MLP(c.hidden_size, c.intermediate_size, dtype)

    def forward(self, x: torch.Tensor, meta: StepMeta, state: dict[str, torch.Tensor]) -> torch.Tensor:
        x = ops.add(x, self.attention(self.input_layernorm(x), meta, state))
        return ops.add(x, self.mlp(self.post_attention_layernorm(x)))


class MTPLayer(DecoderLayer):
    """NextN layer: z = eh_proj([enorm(embed(next token)); hnorm(hidden)]), one MLA + MoE layer, final norm."""

    def __init__(self, c: LingConfig, i: int, dtype: torch.dtype):
        super().__init__(c, i, dtype)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * c.hidden_size, c.hidden_size, dtype)
        self.final_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, meta: StepMeta,
                state: dict[str, torch.Tensor]) -> torch.Tensor:
        z = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))   # embedding first
        return self.final_layernorm(super().forward(z, meta, state))


class LingModel(nn.Module):
    def __init__(self, c: LingConfig, dtype: torch.dtype):
        super().__init__()
        self.word_embeddings = nn.Module()
        self.word_embeddings.weight = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=dtype),
                                                   requires_grad=False)
        L = c.num_hidden_layers
        self.layers = nn.ModuleList([DecoderLayer(c, i, dtype) for i in range(L)] +
                                    [MTPLayer(c, L + k, dtype) for k in range(c.num_nextn_predict_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.num_layers = L

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, state: ModelState) -> torch.Tensor:
        meta = step_meta(positions, state)
        x = ops.embedding(input_ids, self.word_embeddings.weight)                        # [B, T, h]
        for i in range(self.num_layers):
            x = self.layers[i](x, meta, state.layer(i))
        return self.norm(x)


def step_meta(positions: torch.Tensor, state: ModelState) -> StepMeta:
    """The step's page rows and cache rows, derived on the device from slots, page table and positions."""
    page_rows = ops.gather_rows(state.page_table, state.slots)                          # [B, MP]
    return StepMeta(positions, state.slots, page_rows, ops.cache_locs(page_rows, positions, state.page_size))


class LingForCausalLM(nn.Module):
    """`model(input_ids)` -> fp32 logits [B, T, V]; `step` and `mtp_step` are the cached forms."""

    def __init__(self, config: LingConfig, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config, self.dtype = config, dtype
        self.model = LingModel(config, dtype)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, torch.float32, out_dtype=torch.float32)

    def new_state(self, batch: int, max_len: int) -> ModelState:
        return ModelState.new(self.config, batch, max_len, self.dtype, self.lm_head.weight.device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of a fresh forward over input_ids [B, T] (no cache kept)."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        return self.step(input_ids, positions, self.new_state(B, T))[0]

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor,
             state: ModelState) -> tuple[torch.Tensor, torch.Tensor]:
        """One cached forward of the target: (logits fp32 [B, T, V], normed hidden [B, T, h]); updates state."""
        hidden = self.model(input_ids, positions, state)
        return self.lm_head(hidden), hidden

    def mtp_step(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, state: ModelState,
                 depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer `depth`: from the hidden at position t and token t+1, logits for t+2 and the MTP hidden.

        next_ids [B, T], hidden [B, T, h] (target's normed hidden, or the previous MTP hidden when
        chaining), positions [B, T] = t (the rope position and cache slot).
        """
        i = self.config.num_hidden_layers + depth
        embeds = ops.embedding(next_ids, self.model.word_embeddings.weight)
        z = self.model.layers[i](embeds, hidden, step_meta(positions, state), state.layer(i))
        return self.lm_head(z), z

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, max_len: int | None = None) -> torch.Tensor:
        """Greedy decoding: prefill the prompt [B, T0], then one cached step per token. Returns [B, max_new_tokens]."""
        B, T0 = input_ids.shape
        state = self.new_state(B, max_len or T0 + max_new_tokens)
        positions = torch.arange(T0, device=input_ids.device).expand(B, T0)
        logits, _ = self.step(input_ids, positions, state)
        out = []
        for t in range(max_new_tokens):
            token = ops.greedy_sample(logits[:, -1:])                                    # [B, 1]
            out.append(token)
            if t + 1 < max_new_tokens:
                logits, _ = self.step(token, torch.full_like(token, T0 + t), state)
        return torch.cat(out, dim=1)

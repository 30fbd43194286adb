"""Engine step programs: what one decode step does on the device, written over the reference model.

Every per-request value lives in a persistent relay buffer indexed by request slot (`RELAY`), so a
step needs nothing from the host but `slots`. Two steps are traced (lingc.trace):

  step   (plain decode)  root token at seq_len -> target -> sample -> publish, advance
  nextn  (NEXTN, topk=1 chain, draft_tokens = K + 1) in three stages, which the `partition` pass
         turns into three graphs:
     draft   K - 1 MTP forwards from (draft_first, mtp_hidden): d2..dK, their distributions
     verify  target over [root, d1..dK] (KDA staged: state.staging), in-graph acceptance, KDA commit,
             publish accept_len tokens, advance seq_len / root
     extend  MTP over the chain with the target's hidden states; the row at accept_len - 1 gives
             the next round's d1, its distribution and mtp_hidden

Positions: root sits at seq_len; the MTP at position t reads hidden(t) and token t+1 and predicts t+2;
draft forward i runs at position seq_len + i. (docs/engine.md has the whole data flow.)
Letters: B requests in the step, S slots, K = draft_tokens - 1, V vocab, h hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from lingc.config import LingConfig
from lingc.model import LingForCausalLM
from lingc.ops import OPS as ops
from lingc.state import ModelState


# the greedy-only copies of the step graphs (passes/specialize_greedy.py): step_greedy, and nextn_greedy, which
# partition splits into draft_greedy / verify_greedy / extend_greedy; the engine runs them for temperature 0
GREEDY_SUFFIX = "_greedy"
# the sampling copies (passes/specialize_sampling.py, opt-in): every filtered_probs of step / nextn with a static
# filter mask, for requests whose top-k (and top-p) are off, so the off filters' rounds are never launched; the
# value is the op's `filters` mask (1 top-k, 2 top-p)
PLAIN_SUFFIX = "_plain"          # temperature > 0, top-k and top-p off: softmax(logits / T)
NUCLEUS_SUFFIX = "_nucleus"      # temperature > 0, top-k off, top-p on
SAMPLING_COPIES = {PLAIN_SUFFIX: 0, NUCLEUS_SUFFIX: 2}
COPY_SUFFIXES = (GREEDY_SUFFIX, PLAIN_SUFFIX, NUCLEUS_SUFFIX)    # every specialised copy of the step graphs


@dataclass(frozen=True)
class RelaySpec:
    name: str
    shape: tuple[int, ...]       # per slot
    dtype: torch.dtype
    doc: str


def relay_specs(config: LingConfig, draft_tokens: int, dtype: torch.dtype) -> list[RelaySpec]:
    """The persistent per-slot buffers the engine steps read and write (cross-step relays)."""
    V, h = config.vocab_size, config.hidden_size
    return [
        RelaySpec("seq_len", (), torch.int64, "tokens in the target cache"),
        RelaySpec("root", (), torch.int64, "the next token to feed the target (last emitted)"),
        RelaySpec("out_tokens", (draft_tokens,), torch.int64, "tokens the last step emitted"),
        RelaySpec("out_len", (), torch.int32, "how many of out_tokens are new"),
        RelaySpec("temperature", (), torch.float32, "0 = greedy"),
        RelaySpec("top_k", (), torch.int64, "0 = off"),
        RelaySpec("top_p", (), torch.float32, "1 = off"),
        RelaySpec("seed", (), torch.int64, "per-request RNG seed"),
        RelaySpec("simulate_accept", (), torch.float32, "benchmark knob: forced mean accept length, 0 = off"),
        RelaySpec("rng_counter", (), torch.int64, "uniforms used so far"),
        RelaySpec("draft_first", (), torch.int64, "d1, proposed by the last extend"),
        RelaySpec("draft_first_probs", (V,), torch.float32, "d1's draft distribution"),
        RelaySpec("mtp_hidden", (h,), dtype, "the MTP hidden that chains into the draft"),
    ]


Stage = Callable[[str, Callable[[], Any]], Any]


def _plain_stage(name: str, fn: Callable[[], Any]) -> Any:
    return fn()


def _sampling(relay: dict[str, torch.Tensor], slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(ops.gather_rows(relay[k], slots) for k in ("temperature", "top_k", "top_p", "seed", "rng_counter"))


def decode_step(model: LingForCausalLM, slots: torch.Tensor, relay: dict[str, torch.Tensor], state: ModelState) -> None:
    """One plain decode step for `slots`: feed root, sample the next token in-graph, publish, advance."""
    B = slots.shape[0]
    seq = ops.gather_rows(relay["seq_len"], slots)                                    # [B]
    root = ops.gather_rows(relay["root"], slots).view(B, 1)
    logits, _ = model.step(root, ops.step_positions(seq, 1), state)                   # [B, 1, V]
    temperature, top_k, top_p, seed, counter = _sampling(relay, slots)
    probs = ops.filtered_probs(logits, temperature, top_k, top_p)
    token = ops.sample_tokens(probs, ops.uniform(seed, counter, 1))                   # [B, 1]
    ops.emit_tokens(relay["out_tokens"], relay["out_len"], slots, token)
    ops.scatter_rows(relay["root"], slots, token.view(B))
    ops.scatter_rows(relay["seq_len"], slots, seq + 1)
    ops.scatter_rows(relay["rng_counter"], slots, counter + 1)


def nextn_step(model: LingForCausalLM, slots: torch.Tensor, relay: dict[str, torch.Tensor], state: ModelState,
               draft_tokens: int, stage: Stage = _plain_stage) -> None:
    """One NEXTN round for `slots` (see the module docstring); `stage` tags the draft / verify / extend parts."""
    B, K, c = slots.shape[0], draft_tokens - 1, model.config

    def draft() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seq = ops.gather_rows(relay["seq_len"], slots)
        root = ops.gather_rows(relay["root"], slots).view(B, 1)
        token = ops.gather_rows(relay["draft_first"], slots).view(B, 1)
        hidden = ops.gather_rows(relay["mtp_hidden"], slots).view(B, 1, c.hidden_size)
        temperature, top_k, top_p, seed, counter = _sampling(relay, slots)
        ids, probs = [root, token], [ops.gather_rows(relay["draft_first_probs"], slots).view(B, 1, -1)]
        # every forward's position and uniform in one launch each (column i: seq + i, counter + i), not an add
        # and a launch per forward
        positions = ops.step_positions(seq, K - 1)                                    # [B, K - 1]
        u = ops.uniform(seed, counter, K - 1)                                         # [B, K - 1]
        for i in range(K - 1):
            logits, hidden = model.mtp_step(token, hidden, positions[:, i:i + 1], state)
            p = ops.filtered_probs(logits, temperature, top_k, top_p)
            token = ops.sample_tokens(p, u[:, i:i + 1])
            ids.append(token)
            probs.append(p)
        # the chain verify feeds the target, [root, d1..dK]: the root joins the draft's one cat, so verify has no
        # cat of its own (its draft ids are a view of the chain)
        return seq, torch.cat(ids, dim=1), torch.cat(probs, dim=1)                    # [B], [B, K+1], [B, K, V]

    seq, chain, draft_probs = stage("draft", draft)

    def verify() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        draft_ids = chain[:, 1:]                                                      # [B, K]
        positions = ops.step_positions(seq, K + 1)
        logits, hidden = model.step(chain, positions, state)                          # [B, K+1, V]
        temperature, top_k, top_p, seed, counter = _sampling(relay, slots)
        target_probs = ops.filtered_probs(logits, temperature, top_k, top_p)
        # counter + K .. + 2K: the acceptance; + 2K + 1: extend's; + 2K + 2: simulate_accept's (one launch)
        u = ops.uniform(seed, counter, K + 3, K)
        accept_len, tokens = ops.chain_accept(draft_ids, draft_probs, target_probs, logits, temperature,
                                              u[:, :K + 1])
        accept_len = ops.simulate_accept(accept_len, ops.gather_rows(relay["simulate_accept"], slots),
                                         u[:, K + 2], K + 1)
        for key, staged in state.staging.items():                                # keep the accepted state
            ops.kda_commit(state.tensors[key], slots, staged, accept_len)
        ops.emit_tokens(relay["out_tokens"], relay["out_len"], slots, tokens, accept_len)
        bonus = ops.pick_position(tokens, accept_len, -1).view(B)                     # row accept_len - 1
        ops.scatter_rows(relay["root"], slots, bonus)
        ops.scatter_rows(relay["seq_len"], slots, seq + accept_len)
        return positions, hidden, tokens, accept_len

    positions, hidden, tokens, accept_len = stage("verify", verify)

    def extend() -> None:
        logits, mtp_hidden = model.mtp_step(tokens, hidden, positions, state)          # [B, K+1, ...]
        temperature, top_k, top_p, seed, counter = _sampling(relay, slots)
        # row accept_len - 1, and the uniform at counter + 2K + 1: the constants in the ops, not in launches
        probs = ops.filtered_probs(ops.pick_position(logits, accept_len, -1), temperature, top_k, top_p)  # [B, 1, V]
        first = ops.sample_tokens(probs, ops.uniform(seed, counter, 1, 2 * K + 1))
        ops.scatter_rows(relay["draft_first"], slots, first.view(B))
        ops.scatter_rows(relay["draft_first_probs"], slots, probs.view(B, -1))
        ops.scatter_rows(relay["mtp_hidden"], slots, ops.pick_position(mtp_hidden, accept_len, -1).view(B, -1))
        ops.scatter_rows(relay["rng_counter"], slots, counter + 2 * K + 3)

    stage("extend", extend)

"""A mixture-of-experts MLP (Qwen3-MoE): a softmax router picks k of E gated MLPs for each token.

Each expert is a `GatedMLP` of its own (a fused gate/up `Linear` and a down `Linear`), so the weight
conversion treats it like any other linear layer: on the default weights each expert holds its own
int4/int8 group codes (or a GGUF file's, kept exactly) and runs kvserve's C++ quantized matmul. A step's
(token, rank) slots are grouped by expert and every routed expert runs once, on the rows routed to it: a
token reads the weights of its k experts only (a decode step reads k of E), never a dense loop over all.

Row-invariant (README, Determinism): every expert's rows go through the quantized matmul, which computes a
row the same way whatever rows are beside it, and a token's k results are summed in rank order (its best
expert first), not in the order the experts happened to run. So a token's output does not depend on which
other tokens share the step, or which experts they picked.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import ops
from kvserve.model.layers import GatedActivation, GatedMLP, Linear, per_row


class Router(Linear):
    """hidden -> one logit per expert. Held in 8-bit groups where the experts hold 4: which k experts win is a
    discrete choice, and a 4-bit router's logits would flip near-ties."""

    keeps_8_bits = True


class SparseMoE(nn.Module):
    """sum over a token's top-k experts of weight_r * expert_r(x); weights = softmax(router(x)) restricted to the
    top k (renormalised to sum to 1 with `norm_topk_prob`), or, with `softmax_over_top_k` (gpt-oss), the softmax
    of the k best logits alone. Checkpoint names as Hugging Face's Qwen3-MoE: `gate.weight` (the router),
    `experts.{e}.gate_proj.weight` / `up_proj` / `down_proj`; with `bias`, the router and every expert
    projection carry a `.bias`; `activation` as GatedMLP takes it."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, *, softmax_over_top_k: bool = False, bias: bool = False,
                 activation: int | GatedActivation = ops.SILU) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.softmax_over_top_k = softmax_over_top_k
        self.gate = Router(hidden_size, num_experts, bias=bias)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size, activation, bias=bias)
                                     for _ in range(num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[N, hidden]` -> (weights `[N, k]` fp32, experts `[N, k]` int64), best first."""
        if self.softmax_over_top_k:
            logits, experts = torch.topk(self.gate(x).float(), self.top_k, dim=-1)
            return torch.softmax(logits, dim=-1), experts
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        return run_experts(self.experts, x, weights, experts)


def run_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """sum over each token's k chosen experts of weight * expert(x): x `[N, hidden]`, weights and chosen `[N, k]`
    (best first). Each routed expert runs once, on the rows routed to it."""
    num_tokens, k = chosen.shape
    flat = chosen.reshape(-1)  # slot t * k + r: token t's rank-r expert
    order = torch.argsort(flat, stable=True)  # slots grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    routed = x.new_empty(num_tokens * k, x.shape[-1])
    start = 0
    for expert, count in enumerate(counts):
        if count:
            slots = order[start : start + count]
            routed[slots] = experts[expert](x[slots // k])
            start += count
    routed = routed.view(num_tokens, k, -1)
    out = routed[:, 0] * weights[:, :1]
    for rank in range(1, k):  # a token's experts summed in rank order: independent of the batch
        out += routed[:, rank] * weights[:, rank : rank + 1]
    return out


class SharedExpertMoE(SparseMoE):
    """SparseMoE plus a shared expert every token runs (Qwen3.5-MoE, Qwen2-MoE): its output weighted by
    sigmoid(shared_expert_gate(x)), a per-token scalar. Checkpoint names: SparseMoE's, `shared_expert.gate_proj`
    / `up_proj` / `down_proj` and `shared_expert_gate.weight` (held in 8 bits like the router)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 shared_intermediate_size: int) -> None:
        super().__init__(hidden_size, intermediate_size, num_experts, top_k, norm_topk_prob)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = Router(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x) * per_row(torch.sigmoid, self.shared_expert_gate(x))
        return super().forward(x).add_(shared)

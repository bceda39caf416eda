"""Gating against DeepSpeed's formulas on hand-built cases: capacities, drops, l_aux, counts, weights."""

from __future__ import annotations

import math

import pytest
import torch

from zerospeed.moe.gate import TopKGate
from zerospeed.moe.gating import (expert_capacity, gumbel_noise, multiplicative_jitter, top1gating, top2gating,
                                  topkgating)


def _logits_choosing(choices: list[int], num_experts: int, margin: float = 2.0) -> torch.Tensor:
    """Logits whose argmax per token is ``choices[s]``, with distinct values so nothing ties."""
    torch.manual_seed(0)
    logits = torch.rand(len(choices), num_experts) * 0.5
    for s, e in enumerate(choices):
        logits[s, e] += margin
    return logits


def _softmax_rows(logits: torch.Tensor) -> list[list[float]]:
    out = []
    for row in logits.tolist():
        z = sum(math.exp(v) for v in row)
        out.append([math.exp(v) / z for v in row])
    return out


def _slots(kept: dict[int, list[int]]) -> dict[tuple[int, int], int]:
    """(token, expert) -> slot: an expert's kept tokens take slots 0, 1, ... in token order."""
    return {(s, e): c for e, tokens in kept.items() for c, s in enumerate(sorted(tokens))}


@pytest.mark.parametrize("tokens,experts,factor,min_cap,expected", [
    (10, 4, 1.0, 4, 4),    # ceil(2.5) = 3, floored at 4
    (10, 4, 1.0, 1, 3),    # ceil(2.5)
    (10, 4, 2.0, 1, 5),    # top-2: factor x 2
    (12, 4, 0.5, 0, 2),    # ceil(1.5)
    (7, 3, 3.0, 2, 7),     # top-3 at factor 1: ceil(7 / 3 * 3)
    (8, 8, 1.0, 0, 1),
])
def test_capacity_formula(tokens: int, experts: int, factor: float, min_cap: int, expected: int) -> None:
    assert expert_capacity(tokens, experts, factor, min_cap) == expected


def test_top1_drops_by_capacity_in_token_order_without_rts() -> None:
    choices = [0, 0, 1, 0, 0, 0]
    logits = _logits_choosing(choices, 2)
    plan = top1gating(logits, capacity_factor=1.0, min_capacity=1, use_rts=False)
    assert plan.capacity == 3  # ceil(6 / 2 * 1.0)
    assert plan.exp_counts.tolist() == [5, 1]  # counted before drops
    probs = _softmax_rows(logits)
    kept = {0: [0, 1, 3], 1: [2]}  # expert 0 keeps its first three tokens; tokens 4, 5 are dropped
    slots = _slots(kept)
    expected = torch.zeros(6, 2, 3)
    for (s, e), c in slots.items():
        expected[s, e, c] = probs[s][e]
    torch.testing.assert_close(plan.combine_weights, expected)
    assert torch.equal(plan.dispatch_mask, expected.bool())
    me = [sum(p[e] for p in probs) / 6 for e in range(2)]
    ce = [5 / 6, 1 / 6]
    assert plan.l_aux.item() == pytest.approx(sum(m * c for m, c in zip(me, ce)) * 2, rel=1e-6)


def test_top1_random_token_selection_keeps_the_highest_uniform_scores() -> None:
    choices = [0, 0, 1, 0, 0, 0, 0, 1]
    logits = _logits_choosing(choices, 2)
    plan = top1gating(logits, 0.5, 1, use_rts=True, generator=torch.Generator().manual_seed(7))
    capacity = math.ceil(8 / 2 * 0.5)
    assert plan.capacity == capacity == 2
    scores = torch.rand(8, 2, generator=torch.Generator().manual_seed(7)).tolist()  # DeepSpeed's draw
    kept = {}
    for e in range(2):
        mine = [s for s, c in enumerate(choices) if c == e]
        kept[e] = sorted(mine, key=lambda s: -scores[s][e])[:capacity]
    probs = _softmax_rows(logits)
    expected = torch.zeros(8, 2, capacity)
    for (s, e), c in _slots(kept).items():
        expected[s, e, c] = probs[s][e]
    torch.testing.assert_close(plan.combine_weights, expected)
    assert plan.exp_counts.tolist() == [6, 2]


def test_top1_used_token_masks_routing_and_l_aux() -> None:
    choices = [0, 1, 1, 0]
    logits = _logits_choosing(choices, 2)
    used = torch.tensor([1.0, 1.0, 0.0, 1.0])
    plan = top1gating(logits, 4.0, 0, used_token=used, drop_tokens=False)
    assert plan.exp_counts.tolist() == [2, 1]
    probs = _softmax_rows(logits)
    assert plan.expert_indices.flatten().tolist() == choices
    expected_w = [probs[s][choices[s]] * used[s].item() for s in range(4)]
    torch.testing.assert_close(plan.expert_weights.flatten(), torch.tensor(expected_w))
    me = [sum(p[e] for p in probs) / 4 for e in range(2)]
    assert plan.l_aux.item() == pytest.approx((me[0] * 2 / 4 + me[1] * 1 / 4) * 2, rel=1e-6)


def test_top1_rsample_picks_from_gumbel_noised_logits() -> None:
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    plan = top1gating(logits, 1.0, 0, noisy_gate_policy="RSample", drop_tokens=False,
                      generator=torch.Generator().manual_seed(3))
    u = torch.rand(16, 4, generator=torch.Generator().manual_seed(3))
    finfo = torch.finfo(torch.float32)
    u = finfo.tiny + u * (1 - finfo.eps - finfo.tiny)
    noisy = logits - torch.log(-torch.log(u))
    assert plan.expert_indices.flatten().tolist() == noisy.argmax(1).tolist()
    gates = torch.softmax(logits, 1)  # the weights stay the clean softmax
    torch.testing.assert_close(plan.expert_weights.flatten(), gates.gather(1, noisy.argmax(1, keepdim=True)).flatten())


def test_noise_helpers_draw_in_range() -> None:
    x = torch.ones(1000)
    jittered = multiplicative_jitter(x, 0.01, generator=torch.Generator().manual_seed(0))
    assert jittered.min() >= 0.99 and jittered.max() < 1.01 and jittered.std() > 0
    assert torch.equal(multiplicative_jitter(x, 0.0), x)
    g = gumbel_noise((20000,), device=torch.device("cpu"), generator=torch.Generator().manual_seed(0))
    assert g.mean().item() == pytest.approx(0.5772, abs=0.03)  # Euler-Mascheroni: the Gumbel mean


def test_top2_first_choices_fill_slots_before_second_choices() -> None:
    choices = [0, 0, 0, 1]  # with two experts every token's second choice is the other one
    logits = _logits_choosing(choices, 2)
    plan = top2gating(logits, capacity_factor=0.5, min_capacity=1, top2_2nd_expert_sampling=False)
    assert plan.capacity == 2  # ceil(4 / 2 * 0.5 * 2)
    assert plan.exp_counts.tolist() == [4, 4]
    probs = _softmax_rows(logits)
    # expert 0: first choices 0, 1, 2 at slots 0, 1, 2 (2 dropped); token 3's second choice at slot 3: dropped
    # expert 1: token 3's first choice at slot 0; second choices 0, 1, 2 at slots 1, 2, 3: only token 0 stays
    expected = torch.zeros(4, 2, 2)
    expected[0, 0, 0], expected[0, 1, 1] = probs[0][0], probs[0][1]  # both kept: weights sum to one already
    expected[1, 0, 1] = 1.0  # only the first choice kept: renormalised to 1
    expected[3, 1, 0] = 1.0
    torch.testing.assert_close(plan.combine_weights, expected)
    me = [sum(p[e] for p in probs) / 4 for e in range(2)]
    ce = [3 / 4, 1 / 4]  # first choices only
    assert plan.l_aux.item() == pytest.approx((me[0] * ce[0] + me[1] * ce[1]) / 2 * 4, rel=1e-6)


def test_top2_dropless_weights_are_renormalised_and_sampling_uses_gumbel() -> None:
    logits = torch.randn(10, 5, generator=torch.Generator().manual_seed(2))
    plan = top2gating(logits, 1.0, 0, drop_tokens=False, top2_2nd_expert_sampling=True,
                      generator=torch.Generator().manual_seed(4))
    noise = gumbel_noise(logits.shape, device=logits.device, generator=torch.Generator().manual_seed(4))
    gates = torch.softmax(logits, 1)
    first = gates.argmax(1)
    second = (logits + noise).scatter(1, first[:, None], float("-inf")).argmax(1)
    assert plan.expert_indices[:, 0].tolist() == first.tolist()
    assert plan.expert_indices[:, 1].tolist() == second.tolist()
    g1, g2 = gates.gather(1, first[:, None]), gates.gather(1, second[:, None])
    torch.testing.assert_close(plan.expert_weights, torch.cat([g1, g2], 1) / (g1 + g2))
    assert plan.exp_counts.tolist() == torch.bincount(torch.cat([first, second]), minlength=5).tolist()


def test_topk_keeps_the_largest_gates_per_expert() -> None:
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    k, factor = 3, 0.5
    plan = topkgating(logits, k, factor, min_capacity=1)
    capacity = math.ceil(6 / 4 * factor * k)
    assert plan.capacity == capacity == 3
    probs = _softmax_rows(logits)
    routes = {s: sorted(range(4), key=lambda e: -probs[s][e])[:k] for s in range(6)}
    assert plan.exp_counts.tolist() == [sum(e in r for r in routes.values()) for e in range(4)]
    kept = {e: sorted([s for s in routes if e in routes[s]], key=lambda s: -probs[s][e])[:capacity]
            for e in range(4)}
    expected = torch.zeros(6, 4, capacity)
    for s in range(6):
        mine = [e for e in range(4) if s in kept[e]]
        total = sum(probs[s][e] for e in mine)
        for e in mine:
            expected[s, e, sorted(kept[e]).index(s)] = probs[s][e] / total
    torch.testing.assert_close(plan.combine_weights, expected)
    me = [sum(p[e] for p in probs) / 6 for e in range(4)]
    ce = [sum(e in r for r in routes.values()) / 6 for e in range(4)]
    assert plan.l_aux.item() == pytest.approx(sum(m * c for m, c in zip(me, ce)) / 4 * 16 / k, rel=1e-6)


def test_topk_dropless_routes_every_token_to_its_k_best() -> None:
    logits = torch.randn(9, 6, generator=torch.Generator().manual_seed(6))
    plan = topkgating(logits, 3, 1.0, 0, drop_tokens=False)
    top, idx = torch.softmax(logits, 1).topk(3, dim=1)
    assert plan.capacity is None and plan.dropless
    assert torch.equal(plan.expert_indices, idx)
    torch.testing.assert_close(plan.expert_weights, top / top.sum(1, keepdim=True))


def test_gate_uses_eval_capacity_and_no_noise_outside_training() -> None:
    gate = TopKGate(4, 2, k=1, capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=0,
                    noisy_gate_policy="Jitter")
    x = torch.randn(8, 4)
    assert gate(x).capacity == 4
    gate.eval()
    plan_a, plan_b = gate(x), gate(x)
    assert plan_a.capacity == 8
    torch.testing.assert_close(plan_a.l_aux, plan_b.l_aux, rtol=0, atol=0)  # no jitter in eval
    assert gate.wg.weight.dtype == torch.float32 and gate.wg.bias is None


def test_gating_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="noisy_gate_policy='Gaussian'"):
        TopKGate(4, 2, noisy_gate_policy="Gaussian")
    with pytest.raises(ValueError, match="k=3"):
        TopKGate(4, 2, k=3)
    with pytest.raises(ValueError, match=r"\[tokens, experts\]"):
        top1gating(torch.zeros(2, 3, 4), 1.0, 0)

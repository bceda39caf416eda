"""The MoE layer: DeepSpeed's names and refusals, dropless against a per-token loop and against the
capacity path, and expert parallelism over real gloo ranks against a single-process run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zerospeed.moe.layer import MoE
from zerospeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from zerospeed.testing import run_distributed

HIDDEN = 8
NUM_EXPERTS = 4
TOKENS = 12  # per rank, as [3, 4, HIDDEN]


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 16), nn.GELU(), nn.Linear(16, HIDDEN))


def _reference_layer(k: int, drop_tokens: bool = False, **kwargs: object) -> MoE:
    """A single-process layer holding all experts, each made distinct (copies start identical)."""
    torch.manual_seed(0)
    layer = MoE(HIDDEN, _expert(), num_experts=NUM_EXPERTS, k=k, drop_tokens=drop_tokens,
                top2_2nd_expert_sampling=False, **kwargs)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.deepspeed_moe.experts.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def _per_token_loop(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The definition: out[s] = sum over the token's routes of weight * expert(x[s])."""
    tokens = x.reshape(-1, HIDDEN)
    probs = torch.softmax(tokens @ layer.deepspeed_moe.gate.wg.weight.t(), dim=1)
    k = layer.deepspeed_moe.gate.k
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    rows = []
    for s in range(tokens.shape[0]):
        top, idx = probs[s].topk(k)
        weights = top if k == 1 else top / top.sum()
        rows.append(sum(w * experts[int(e)](tokens[s:s + 1])[0] for w, e in zip(weights, idx)))
    return torch.stack(rows).reshape(x.shape)


# -- construction, names, refusals ----------------------------------------------------------------
def test_state_dict_and_attribute_names_are_deepspeeds() -> None:
    layer = MoE(HIDDEN, _expert(), num_experts=4, ep_size=2, use_residual=True)
    keys = set(layer.state_dict())
    expected = {"deepspeed_moe.gate.wg.weight", "coefficient.weight", "coefficient.bias"}
    for i in range(2):  # two local experts at ep_size=2
        for j in (0, 2):
            expected |= {f"deepspeed_moe.experts.deepspeed_experts.{i}.{j}.weight",
                         f"deepspeed_moe.experts.deepspeed_experts.{i}.{j}.bias"}
    expected |= {f"mlp.{j}.{w}" for j in (0, 2) for w in ("weight", "bias")}
    assert keys == expected
    assert (layer.num_local_experts, layer.ep_size, layer.expert_group_name) == (2, 2, "ep_size_2")
    assert layer.deepspeed_moe.ep_group is None and not layer.is_bound
    assert layer.deepspeed_moe.gate.wg.bias is None


def test_expert_params_are_marked_as_deepspeed_marks_them() -> None:
    layer = MoE(HIDDEN, _expert(), num_experts=2, use_residual=True)
    expert_params = list(layer.deepspeed_moe.experts.parameters())
    assert expert_params and all(is_moe_param(p) and p.group_name == "ep_size_1" for p in expert_params)
    others = [p for n, p in layer.named_parameters() if ".deepspeed_experts." not in n]
    assert others and not any(is_moe_param(p) for p in others)  # gate, coefficient, the residual mlp
    groups = split_params_into_different_moe_groups_for_optimizer({"params": layer.parameters(), "name": "all"})
    assert [g.get("moe", False) for g in groups] == [False, True]
    assert len(groups[1]["params"]) == len(expert_params)


def test_refusals_name_the_argument_and_the_fix() -> None:
    with pytest.raises(ValueError, match="use_tutel=True .* Tutel"):
        MoE(HIDDEN, _expert(), num_experts=2, use_tutel=True)
    with pytest.raises(ValueError, match="enable_expert_tensor_parallelism=True"):
        MoE(HIDDEN, _expert(), num_experts=2, enable_expert_tensor_parallelism=True)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep_size=4"):
        MoE(HIDDEN, _expert(), num_experts=6, ep_size=4)
    with pytest.raises(ValueError, match="k=3 exceeds num_experts=2"):
        MoE(HIDDEN, _expert(), num_experts=2, k=3)


def test_unbound_expert_parallel_layer_says_how_to_bind() -> None:
    layer = MoE(HIDDEN, _expert(), num_experts=4, ep_size=2)
    with pytest.raises(RuntimeError, match="zerospeed.initialize.*bind_expert_parallel"):
        layer(torch.randn(4, HIDDEN))
    with pytest.raises(RuntimeError, match="bind_expert_parallel"):
        layer.set_deepspeed_parallelism()


# -- single process ------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
def test_dropless_equals_a_per_token_loop(k: int) -> None:
    layer = _reference_layer(k)
    x = torch.randn(3, 4, HIDDEN, generator=torch.Generator().manual_seed(2))
    out, l_aux, counts = layer(x)
    torch.testing.assert_close(out, _per_token_loop(layer, x), rtol=1e-5, atol=1e-6)
    assert int(counts.sum()) == k * TOKENS and l_aux.dim() == 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dropless_equals_capacity_path_when_nothing_drops(k: int) -> None:
    dropless = _reference_layer(k, drop_tokens=False)
    capacity = _reference_layer(k, drop_tokens=True, capacity_factor=float(NUM_EXPERTS), use_rts=True)
    x = torch.randn(3, 4, HIDDEN, generator=torch.Generator().manual_seed(3))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, aux_a, counts_a = dropless(xa)
    out_b, aux_b, counts_b = capacity(xb)
    torch.testing.assert_close(out_a, out_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(aux_a, aux_b, rtol=0, atol=0)
    assert torch.equal(counts_a, counts_b)
    (out_a.square().sum() + aux_a).backward()
    (out_b.square().sum() + aux_b).backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
    for pa, pb in zip(dropless.parameters(), capacity.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-6)


def test_residual_moe_mixes_expert_and_dense_outputs() -> None:
    layer = _reference_layer(1, use_residual=True)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4))
    out, _, _ = layer(x)
    coef = torch.softmax(layer.coefficient(x), dim=-1)
    expected = _per_token_loop(layer, x) * coef[:, :1] + layer.mlp(x) * coef[:, 1:]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


# -- expert parallelism on real ranks -----------------------------------------------------------
def _inputs(global_rank: int, starve: str) -> torch.Tensor:
    x = torch.randn(3, 4, HIDDEN, generator=torch.Generator().manual_seed(100 + global_rank))
    if starve == "rank" or (starve == "one" and global_rank % 2 == 0):
        x[..., 0] = -3.0  # such tokens never pick the experts _starve_gate biases
    return x


def _starve_gate(layer: MoE, starve: str) -> None:
    """Make tokens with a negative feature 0 avoid expert 3 ("one") or experts 2 and 3 ("rank")."""
    with torch.no_grad():
        w = layer.deepspeed_moe.gate.wg.weight
        for e in ([3] if starve == "one" else [2, 3] if starve == "rank" else []):
            w[e, 0] = 10.0


def _reference_rank(ref: MoE, x: torch.Tensor, global_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor]:
    """(output, l_aux, exp_counts, loss) of the single-process layer on one rank's rows."""
    out, l_aux, counts = ref(x)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(200 + global_rank))
    return out, l_aux, counts, (out * probe).sum() + l_aux


def _ep_parity(k: int) -> dict:
    from zerospeed.distributed.mesh import ParallelDims

    mesh = ParallelDims(world_size=dist.get_world_size(), ep=2).build()
    ep = mesh.comm("ep")
    rank, group = dist.get_rank(), list(ep.global_ranks)
    results: dict = {"errors": {}, "bytes": {}, "calls": {}}
    if dist.get_world_size() > 2:  # binding the wrong group is refused before anything runs
        try:
            MoE(HIDDEN, _expert(), num_experts=NUM_EXPERTS, ep_size=2).bind_expert_parallel(mesh.comm("dp"))
        except ValueError as exc:
            results["wrong_group"] = str(exc)
    for mode in ("dropless", "capacity"):
        for starve in ("none", "one", "rank"):
            if mode == "capacity" and starve != "none":
                continue
            drop = mode == "capacity"
            kwargs: dict = {"capacity_factor": 1.0, "use_rts": False} if drop else {}
            ref = _reference_layer(k, drop_tokens=drop, **kwargs)
            _starve_gate(ref, starve)
            layer = MoE(HIDDEN, _expert(), num_experts=NUM_EXPERTS, ep_size=2, k=k, drop_tokens=drop,
                        top2_2nd_expert_sampling=False, **kwargs)
            local = layer.num_local_experts
            with torch.no_grad():
                layer.deepspeed_moe.gate.wg.weight.copy_(ref.deepspeed_moe.gate.wg.weight)
                for i in range(local):
                    source = ref.deepspeed_moe.experts.deepspeed_experts[ep.rank * local + i]
                    layer.deepspeed_moe.experts.deepspeed_experts[i].load_state_dict(source.state_dict())
            layer.bind_expert_parallel(ep)
            layer.bind_expert_parallel(ep)  # binding the same Comm again is harmless

            # Reference: every rank of this ep group, one process. Experts see all the group's
            # tokens (sum of losses); the gate and the input only this rank's own loss.
            ref_x = {}
            total = torch.zeros(())
            mine = None
            for g in group:
                ref_x[g] = _inputs(g, starve).requires_grad_()
                res = _reference_rank(ref, ref_x[g], g)
                total = total + res[3]
                if g == rank:
                    mine = res
            assert mine is not None
            expert_grads = torch.autograd.grad(total, list(ref.deepspeed_moe.experts.parameters()),
                                               retain_graph=True, allow_unused=True)
            gate_grad, x_grad = torch.autograd.grad(mine[3], [ref.deepspeed_moe.gate.wg.weight, ref_x[rank]])

            x = _inputs(rank, starve).requires_grad_()
            ep.stats.reset()
            out, l_aux, counts, loss = _reference_rank(layer, x, rank)
            forward_bytes = dict(ep.stats.bytes)
            forward_calls = dict(ep.stats.calls)
            loss.backward()
            backward_bytes = {op: ep.stats.bytes[op] - forward_bytes.get(op, 0) for op in ep.stats.bytes}

            per_expert = len(list(ref.deepspeed_moe.experts.deepspeed_experts[0].parameters()))
            mine_expert_grads = expert_grads[ep.rank * local * per_expert:(ep.rank + 1) * local * per_expert]
            errs = {
                "out": (out - mine[0]).abs().max().item(),
                "l_aux": (l_aux - mine[1]).abs().item(),
                "counts": int(not torch.equal(counts, mine[2])),
                "gate_grad": (layer.deepspeed_moe.gate.wg.weight.grad - gate_grad).abs().max().item(),
                "x_grad": (x.grad - x_grad).abs().max().item(),
                "expert_grads": max(((p.grad if p.grad is not None else torch.zeros_like(p))
                                     - (r if r is not None else torch.zeros_like(p))).abs().max().item()
                                    for p, r in zip(layer.deepspeed_moe.experts.parameters(), mine_expert_grads)),
            }
            key = f"{mode}/{starve}"
            results["errors"][key] = errs
            results["bytes"][key] = {"forward": forward_bytes, "backward": backward_bytes,
                                     "capacity": layer.deepspeed_moe.gate.capacity_factor}
            results["calls"][key] = forward_calls
            results.setdefault("counts", {})[key] = counts.tolist()
            if drop:  # routes the capacity dropped on this rank, by the reference's own plan
                plan = ref.deepspeed_moe.gate(x.detach().reshape(-1, HIDDEN))
                results.setdefault("dropped", {})[key] = k * TOKENS - int(plan.dispatch_mask.sum())
    results["group"] = group
    results["ep_rank"] = ep.rank
    return results


@pytest.mark.spawns
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("k", [1, 2])
def test_expert_parallel_matches_single_process(world_size: int, k: int) -> None:
    results = run_distributed(_ep_parity, world_size, k, timeout=240)
    elem = 4  # fp32
    for rank, res in enumerate(results):
        for key, errs in res["errors"].items():
            bad = {name: err for name, err in errs.items() if err > 1e-5}
            assert not bad, f"rank {rank} {key}: {bad}"
        if world_size > 2:
            assert "ep_size=2" in res["wrong_group"] and "4 ranks" in res["wrong_group"]
        # the cases exercise what they claim: starved experts got nothing, the capacity dropped tokens
        if rank % 2 == 0:
            assert res["counts"]["dropless/one"][3] == 0
        assert res["counts"]["dropless/rank"][2:] == [0, 0]
    assert sum(res["dropped"]["capacity/none"] for res in results) > 0
    groups = {tuple(res["group"]) for res in results}
    assert len(groups) == world_size // 2
    for group in groups:
        members = [results[r] for r in group]
        tokens = TOKENS * len(group)
        for key in members[0]["bytes"]:
            forward = sum(m["bytes"][key]["forward"].get("all_to_all", 0) for m in members)
            backward = sum(m["bytes"][key]["backward"].get("all_to_all", 0) for m in members)
            if key.startswith("dropless"):
                # dispatch + combine: k * tokens rows of HIDDEN each, per direction of the pass
                assert forward == backward == 2 * k * tokens * HIDDEN * elem, key
                for m in members:
                    assert m["calls"][key] == {"all_to_all": 2, "all_to_all_counts": 1}, key
                    assert m["bytes"][key]["forward"]["all_to_all_counts"] == NUM_EXPERTS * 8
                    assert m["bytes"][key]["backward"].get("all_to_all_counts", 0) == 0
            else:
                capacity = max(int(-(-TOKENS // NUM_EXPERTS) * k), 4)  # ceil(S / E * factor * k), min 4
                assert forward == backward == 2 * len(group) * NUM_EXPERTS * capacity * HIDDEN * elem, key
                for m in members:
                    assert m["calls"][key] == {"all_to_all": 2}, key


# -- the comm door's all_to_all_single ------------------------------------------------------------
def _all_to_all_single() -> dict:
    from zerospeed.distributed import Comm

    comm = Comm()
    rank, ws = comm.rank, comm.world_size
    # rank r sends (r + p) % 3 rows of 2 to rank p: uneven, and some splits are zero
    send_splits = [(rank + p) % 3 for p in range(ws)]
    recv_splits = [(q + rank) % 3 for q in range(ws)]
    rows = torch.cat([torch.full((n, 2), 10.0 * rank + p) for p, n in enumerate(send_splits)])
    out = torch.empty(sum(recv_splits), 2)
    comm.all_to_all_single(out, rows, recv_splits, send_splits)
    expected = torch.cat([torch.full((n, 2), 10.0 * q + rank) for q, n in enumerate(recv_splits)])
    even_in = torch.arange(2.0 * ws) + 100 * rank
    even_out = torch.empty_like(even_in)
    comm.all_to_all_single(even_out, even_in, op="metadata")
    errors = []
    for bad in (lambda: comm.all_to_all_single(out, rows, recv_splits, send_splits[:-1]),
                lambda: comm.all_to_all_single(out, rows, recv_splits, [n + 1 for n in send_splits]),
                lambda: comm.all_to_all_single(torch.empty(4), torch.empty(4))):
        try:
            bad()
        except ValueError as exc:
            errors.append(str(exc))
    return {"ok": torch.equal(out, expected),
            "even": even_out.tolist() == [100.0 * q + 2 * rank + i for q in range(ws) for i in range(2)],
            "bytes": dict(comm.stats.bytes), "calls": dict(comm.stats.calls), "errors": errors,
            "sent": sum(send_splits) * 2 * 4}


@pytest.mark.spawns
def test_comm_all_to_all_single_uneven_and_counted() -> None:
    results = run_distributed(_all_to_all_single, 3, timeout=120)
    for res in results:
        assert res["ok"] and res["even"]
        assert res["bytes"] == {"all_to_all": res["sent"], "metadata": 2 * 3 * 4}
        assert res["calls"] == {"all_to_all": 1, "metadata": 1}  # refused calls enter no collective
        assert "3 ranks" in res["errors"][0] and "sum to" in res["errors"][1] and "not divisible" in res["errors"][2]

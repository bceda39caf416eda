"""The expert, the naive loop, the timed step and the DeepSpeed side of ``bench_moe.py``.

Importable by both interpreters: the main venv (zerospeed) and the DeepSpeed venv (``/tmp/dsvenv``,
no zerospeed). So at module level this imports only the standard library and torch; deepspeed is
imported inside :func:`serve`.

Run as a script by the DeepSpeed interpreter:

    PYTHONPATH=benchmarks DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python benchmarks/_moe_bench.py serve <state.pt>

builds DeepSpeed 0.19.8 ``MoE`` layers (one rank, gloo) from the weights and inputs in ``state.pt``,
writes their first (seeded) forward outputs next to it, prints ``@@ READY <json>`` and then serves
``run <side> <steps>`` lines on stdin with ``@@ TIMES <json>`` on stdout (``quit`` ends it), so the
main process can time DeepSpeed's layer in the same interleaved rounds as its own sides.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WEIGHT_SEED = 1234  # the layer's initial weights (built once per k, state dict copied to every side)
INPUT_SEED = 4321  # the input tokens
FORWARD_SEED = 99  # reseeded before the checked first forward (random token selection draws)
L_AUX_COEF = 0.01
PROTOCOL = "@@ "


def expert_mlp(hidden: int) -> nn.Module:
    """Every side's expert: hidden -> 4 hidden -> hidden with GELU."""
    return nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))


def moe_kwargs(spec: dict, k: int, drop_tokens: bool, capacity_factor: float) -> dict:
    """The MoE constructor arguments, identical for zerospeed and DeepSpeed. The second top-2 expert is
    the plain runner-up (no Gumbel sampling), so the naive loop routes exactly as the layers do."""
    return {"num_experts": spec["experts"], "ep_size": 1, "k": k, "capacity_factor": capacity_factor,
            "eval_capacity_factor": capacity_factor, "min_capacity": 4, "use_residual": False,
            "noisy_gate_policy": None, "drop_tokens": drop_tokens, "use_rts": True, "use_tutel": False,
            "top2_2nd_expert_sampling": False}


def side_config(side: str) -> tuple[str, bool, float, int]:
    """``zs-cap1.25-k2`` -> ("zs", drop_tokens=True, capacity_factor=1.25, k=2); ``*-dropless-k1`` has
    drop_tokens False; ``naive-k1`` is the per-expert loop."""
    impl, *mode, kpart = side.split("-")
    k = int(kpart[1:])
    if impl == "naive":
        return impl, False, 1.0, k
    if mode == ["dropless"]:
        return impl, False, 1.0, k
    return impl, True, float(mode[0][3:]), k


def loss_of(output: Tensor, l_aux: Tensor) -> Tensor:
    """The loss every side backpropagates."""
    return output.float().square().mean() + L_AUX_COEF * l_aux


class NaiveMoE(nn.Module):
    """The obvious implementation: softmax gate, top-k, one Python iteration per expert over its tokens."""

    def __init__(self, hidden: int, num_experts: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.num_experts = num_experts
        self.wg = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([expert_mlp(hidden) for _ in range(num_experts)])

    def load_moe_state(self, state: dict[str, Tensor]) -> None:
        """Load a DeepSpeed / zerospeed ``MoE`` state dict (``deepspeed_moe.gate.wg.weight``, ...)."""
        prefix = "deepspeed_moe.experts.deepspeed_experts."
        mine = {"wg.weight": state["deepspeed_moe.gate.wg.weight"]}
        mine.update({"experts." + name[len(prefix):]: t for name, t in state.items() if name.startswith(prefix)})
        self.load_state_dict(mine)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        probs = F.softmax(self.wg(x.float()), dim=-1)
        weights, chosen = torch.topk(probs, self.k, dim=-1)  # [S, k]
        if self.k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                y = self.experts[e](x[token]) * weights[token, slot].unsqueeze(-1)
                out.index_add_(0, token, y)  # out[token] += w * expert_e(x[token])
        # DeepSpeed's load-balancing loss (first choices), so the loss is the same as the layers'
        first = F.one_hot(chosen[:, 0], self.num_experts).float()
        l_aux = (probs.mean(dim=0) * first.mean(dim=0)).sum() * self.num_experts
        return out, l_aux, torch.bincount(chosen.reshape(-1), minlength=self.num_experts)


def make_step(module: nn.Module, x: Tensor) -> Callable[[], None]:
    """One forward + backward of ``module`` on ``x`` (gradients freed first)."""

    def step() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        out, l_aux, _ = module(x)
        loss_of(out, l_aux).backward()

    return step


def timed_steps(step: Callable[[], None], count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def first_forward(module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """The checked forward: seeded, no grad; (output, exp_counts)."""
    torch.manual_seed(FORWARD_SEED)
    with torch.no_grad():
        out, _, counts = module(x)
    return out.detach().clone(), counts.detach().clone()


# -- DeepSpeed 0.19.8 (run by /tmp/dsvenv/bin/python) -----------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reply(kind: str, payload: dict) -> None:
    print(PROTOCOL + kind + " " + json.dumps(payload), flush=True)


def serve(state_path: str) -> None:
    try:
        state = torch.load(state_path)
        spec = state["spec"]
        torch.set_num_threads(spec["threads"])
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
        import logging

        import deepspeed
        from deepspeed.moe.layer import MoE
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
        x = state["x"].requires_grad_(True)
        steps, outputs = {}, {}
        for side in state["sides"]:
            _, drop, factor, k = side_config(side)
            layer = MoE(spec["hidden"], expert_mlp(spec["hidden"]), **moe_kwargs(spec, k, drop, factor))
            layer.set_deepspeed_parallelism()  # its ep_size_1 group over the one gloo rank
            layer.load_state_dict(state["weights"][k])
            outputs[side] = first_forward(layer, x)
            steps[side] = make_step(layer, x)
            timed_steps(steps[side], spec["warmup"])
        torch.save(outputs, state_path + ".deepspeed_out.pt")
        _reply("READY", {"threads": torch.get_num_threads(), "version": deepspeed.__version__,
                         "torch": torch.__version__})
    except Exception as exc:
        _reply("ERROR", {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                         "trace": traceback.format_exc()})
        return
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        try:
            _reply("TIMES", {"times": timed_steps(steps[words[1]], int(words[2]))})
        except Exception as exc:
            _reply("ERROR", {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "serve":
        sys.exit("usage: python _moe_bench.py serve <state.pt>")
    serve(sys.argv[2])

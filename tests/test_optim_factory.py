"""build_optimizer: DeepSpeed 0.19.8's mapping of optimizer types and defaults onto classes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.config import ConfigError, load_config
from zerospeed.config.specs import OptimizerSpec
from zerospeed.optim.factory import UNIMPLEMENTED, build_optimizer
from zerospeed.optim.lamb import Lamb


def cfg(type_: str, **params: Any) -> OptimizerSpec:
    section = load_config({"train_batch_size": 8,
                           "optimizer": {"type": type_, "params": params}}).optimizer
    assert section is not None
    return OptimizerSpec.from_config(section)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3),
                               torch.nn.Linear(3, 2))


def hyper(opt: torch.optim.Optimizer, group: int = 0) -> dict[str, Any]:
    return {k: v for k, v in opt.param_groups[group].items() if k != "params"}


@pytest.mark.parametrize("spelling", ["Adam", "adam", "ADAM"])
def test_adam_is_adamw_with_fused_adam_defaults(spelling):
    opt = build_optimizer(cfg(spelling), model().parameters())
    assert type(opt) is torch.optim.AdamW
    h = hyper(opt)
    assert (h["lr"], h["betas"], h["eps"], h["weight_decay"], h["amsgrad"]) == (
        1e-3, (0.9, 0.999), 1e-8, 0.0, False)  # weight_decay 0, not torch AdamW's 0.01


def test_adam_w_mode_false_is_adam_with_l2():
    opt = build_optimizer(cfg("Adam", adam_w_mode=False, lr=0.01, weight_decay=0.1),
                          model().parameters())
    assert type(opt) is torch.optim.Adam
    assert (hyper(opt)["lr"], hyper(opt)["weight_decay"]) == (0.01, 0.1)


def test_adamw_ignores_adam_w_mode_false():
    # DeepSpeed: effective_adam_w_mode = name == AdamW or adam_w_mode
    opt = build_optimizer(cfg("AdamW", adam_w_mode=False), model().parameters())
    assert type(opt) is torch.optim.AdamW and hyper(opt)["weight_decay"] == 0.0


def test_params_given_override_defaults():
    opt = build_optimizer(cfg("AdamW", lr=3e-4, betas=[0.8, 0.95], eps=1e-6, weight_decay=0.05,
                              amsgrad=True), model().parameters())
    h = hyper(opt)
    assert (h["lr"], h["betas"], h["eps"], h["weight_decay"], h["amsgrad"]) == (
        3e-4, (0.8, 0.95), 1e-6, 0.05, True)


def test_torch_adam_uses_torch_defaults():
    opt = build_optimizer(cfg("Adam", torch_adam=True), model().parameters())
    assert type(opt) is torch.optim.AdamW and hyper(opt)["weight_decay"] == 0.01
    opt = build_optimizer(cfg("Adam", torch_adam=True, adam_w_mode=False, foreach=False),
                          model().parameters())
    assert type(opt) is torch.optim.Adam and hyper(opt)["foreach"] is False


def test_deepspeed_only_adam_keys_are_consumed():
    opt = build_optimizer(cfg("Adam", set_grad_none=False, fp32_optimizer_states=True,
                              bias_correction=True), model().parameters())
    assert not {"set_grad_none", "fp32_optimizer_states", "bias_correction"} & set(hyper(opt))


def test_adam_without_bias_correction_not_implemented():
    with pytest.raises(NotImplementedError, match="optimizer.params.bias_correction"):
        build_optimizer(cfg("Adam", bias_correction=False), model().parameters())


def one_step(opt_or_cls, m: torch.nn.Module, **kwargs) -> list[torch.Tensor]:
    opt = opt_or_cls(m.parameters(), **kwargs) if isinstance(opt_or_cls, type) else opt_or_cls
    torch.manual_seed(1)
    loss = m(torch.randn(5, 4)).square().mean()
    loss.backward()
    opt.step()
    return [p.detach().clone() for p in m.parameters()]


def test_adam_modes_match_torch_on_one_step():
    kw = {"lr": 0.1, "weight_decay": 0.5}
    m = model()
    adamw = one_step(build_optimizer(cfg("Adam", **kw), m.parameters()), m)
    adamw_ref = one_step(torch.optim.AdamW, model(), **kw)
    m = model()
    adam = one_step(build_optimizer(cfg("Adam", adam_w_mode=False, **kw), m.parameters()), m)
    adam_ref = one_step(torch.optim.Adam, model(), **kw)
    for got, want in zip(adamw + adam, adamw_ref + adam_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Decoupled decay shrinks every weight by lr*wd; L2 decay goes through the Adam normaliser.
    assert max(float((a - b).abs().max()) for a, b in zip(adamw, adam, strict=True)) > 1e-3


def test_user_param_groups_keep_their_overrides():
    m = model()
    decay = [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() > 1]
    no_decay = [p for n, p in m.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}]
    opt = build_optimizer(cfg("AdamW", lr=1e-3, weight_decay=0.1), groups)
    assert len(opt.param_groups) == 2
    assert opt.param_groups[0]["params"] == decay and opt.param_groups[1]["params"] == no_decay
    assert (hyper(opt, 0)["lr"], hyper(opt, 0)["weight_decay"]) == (1e-3, 0.1)
    assert (hyper(opt, 1)["lr"], hyper(opt, 1)["weight_decay"]) == (5e-4, 0.0)


def test_param_groups_reach_lamb_too():
    m = model()
    params = list(m.parameters())
    opt = build_optimizer(cfg("Lamb", weight_decay=0.01),
                          [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}])
    assert [hyper(opt, i)["weight_decay"] for i in range(2)] == [0.01, 0.0]


def test_lamb_defaults_and_params():
    opt = build_optimizer(cfg("lamb"), model().parameters())
    assert type(opt) is Lamb
    assert hyper(opt) == {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999),
                          "eps": 1e-8, "eps_inside_sqrt": False, "weight_decay": 0.0,
                          "max_grad_norm": 0.0, "max_coeff": 10.0, "min_coeff": 0.01}
    opt = build_optimizer(cfg("Lamb", lr=0.02, max_coeff=5.0, min_coeff=0.1,
                              eps_inside_sqrt=True, bias_correction=False), [torch.zeros(2)])
    h = hyper(opt)
    assert (h["lr"], h["max_coeff"], h["min_coeff"], h["eps_inside_sqrt"],
            h["bias_correction"]) == (0.02, 5.0, 0.1, True, False)


def test_lamb_amsgrad_rejected():
    with pytest.raises(ConfigError, match="AMSGrad"):
        build_optimizer(cfg("Lamb", amsgrad=True), model().parameters())


def test_adagrad_is_torch_adagrad():
    opt = build_optimizer(cfg("Adagrad", lr=0.05, fp32_optimizer_states=True),
                          model().parameters())
    assert type(opt) is torch.optim.Adagrad
    assert (hyper(opt)["lr"], hyper(opt)["eps"]) == (0.05, 1e-10)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        build_optimizer(cfg("Adagrad", amsgrad=True), model().parameters())


def test_sgd_and_other_torch_classes_by_name():
    opt = build_optimizer(cfg("SGD", lr=0.1, momentum=0.9, nesterov=True), model().parameters())
    assert type(opt) is torch.optim.SGD
    assert (hyper(opt)["lr"], hyper(opt)["momentum"], hyper(opt)["nesterov"]) == (0.1, 0.9, True)
    opt = build_optimizer(cfg("RMSprop", lr=0.01, alpha=0.9), [torch.zeros(3)])
    assert type(opt) is torch.optim.RMSprop and hyper(opt)["alpha"] == 0.9
    opt = build_optimizer(cfg("Rprop", etas=[0.4, 1.3]), [torch.zeros(3)])
    assert hyper(opt)["etas"] == (0.4, 1.3)


def test_sgd_matches_torch_on_one_step():
    m = model()
    got = one_step(build_optimizer(cfg("SGD", lr=0.1, momentum=0.9, weight_decay=0.01),
                                   m.parameters()), m)
    want = one_step(torch.optim.SGD, model(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", UNIMPLEMENTED)
def test_unimplemented_deepspeed_optimizers(name):
    with pytest.raises(NotImplementedError, match=f"optimizer.type: '{name}'"):
        build_optimizer(cfg(name), model().parameters())


def test_unresolved_auto_lists_every_key():
    with pytest.raises(ConfigError) as err:
        build_optimizer(cfg("AdamW", lr="auto", weight_decay="auto", eps=1e-8),
                        model().parameters())
    assert [line.split(":")[0] for line in err.value.problems] == [
        "optimizer.params.lr", "optimizer.params.weight_decay"]


def test_torch_range_errors_become_config_errors():
    with pytest.raises(ConfigError, match=r"optimizer.params \(SGD\)"):
        build_optimizer(cfg("SGD", lr=0.1, momentum=0.9, nesterov=True, dampening=0.5),
                        model().parameters())


def test_no_optimizer_configured():
    assert build_optimizer(None, model().parameters()) is None


def test_does_not_mutate_config():
    c = cfg("Adam", adam_w_mode=False, torch_adam=False, lr=0.01)
    build_optimizer(c, model().parameters())
    assert dict(c.params) == {"adam_w_mode": False, "torch_adam": False, "lr": 0.01}

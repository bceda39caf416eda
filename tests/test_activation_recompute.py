"""Activation checkpointing: gradient parity with plain autograd, options, config, memory."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed.checkpointing as checkpointing
from zerospeed.accelerator.cpu_accelerator import CPU_Accelerator
from zerospeed.activation import Recomputer, RecomputeSettings, HostOffloadHooks
from zerospeed.activation import compat
from zerospeed.activation.recompute import HostOffloadStats
from zerospeed.config import ConfigError, load_config


class Block(nn.Module):
    """Transformer-ish: self-attention and an MLP, each with dropout and a residual."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.drop(self.drop(attn) @ v)
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm2(x)))))


def make_model(depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(depth))).train()


def grads_of(model: nn.Module, x: torch.Tensor, seed: int,
             run: Callable[[nn.Module, torch.Tensor], Any] | None) -> list[torch.Tensor]:
    """Gradients of the parameters and of ``x``, each layer run through ``run`` (or plainly)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    h = x
    for layer in model:
        h = layer(h) if run is None else run(layer, h)
    (h.square().mean() + h.sum()).backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def assert_all_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.fixture
def restore_facade() -> Iterator[None]:
    saved = (compat._DEFAULT.recomputer, compat._DEFAULT.configured)
    yield
    compat._DEFAULT.recomputer, compat._DEFAULT.configured = saved


X = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))


def test_block_with_dropout_grads_bit_exact() -> None:
    model = make_model()
    plain = grads_of(model, X, seed=7, run=None)
    ck = Recomputer()
    assert_all_equal(grads_of(model, X, seed=7, run=ck.checkpoint), plain)
    # the dropout masks matter: another seed gives other gradients, so the parity above is real
    other = grads_of(model, X, seed=8, run=None)
    assert not all(torch.equal(a, b) for a, b in zip(other, plain, strict=True))


def test_cpu_checkpointing_grads_equal_and_inputs_stay_on_host() -> None:
    model = make_model()
    plain = grads_of(model, X, seed=3, run=None)
    ck = Recomputer(RecomputeSettings(cpu_checkpointing=True))
    assert_all_equal(grads_of(model, X, seed=3, run=ck.checkpoint), plain)
    # one saved input per checkpointed layer, nothing copied since it already lives on the host
    assert ck.offload_stats == HostOffloadStats(tensors=3, bytes=3 * X.numel() * 4, copied_bytes=0)


def test_host_offload_hooks_keep_host_tensors_without_copy() -> None:
    stats = HostOffloadStats()
    hooks = HostOffloadHooks(CPU_Accelerator(), stats)
    t = torch.arange(6.0).reshape(2, 3)
    device, packed = hooks.pack(t)
    assert packed is t and packed.device.type == "cpu" and device == t.device
    assert hooks.unpack((device, packed)) is t
    assert stats == HostOffloadStats(tensors=1, bytes=24, copied_bytes=0)


def test_non_tensor_args_and_outputs() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def fn(h: torch.Tensor, flag: bool, shape: tuple[int, float]) -> tuple[torch.Tensor, int, str]:
        out = torch.tanh(lin(h)) * shape[1] if flag else lin(h)
        return out, shape[0] + 1, "done"

    out, n, tag = Recomputer().checkpoint(fn, x, True, (4, 0.5))
    assert (n, tag) == (5, "done")
    out.sum().backward()
    got = [x.grad.clone(), lin.weight.grad.clone()]
    x.grad = lin.weight.grad = lin.bias.grad = None
    fn(x, True, (4, 0.5))[0].sum().backward()
    assert_all_equal(got, [x.grad, lin.weight.grad])


def test_kwargs_with_tensors_and_torch_keyword_names() -> None:
    """A tensor keyword gets its gradient, and a user keyword named like one of torch's
    checkpoint options (``debug``) reaches the function instead of torch."""
    seen: list[bool] = []

    def fn(h: torch.Tensor, *, scale: torch.Tensor, debug: bool = False) -> torch.Tensor:
        seen.append(debug)
        return torch.sin(h * scale).sum(dim=-1)

    x = torch.randn(3, 4, requires_grad=True)
    scale = torch.randn(4, requires_grad=True)
    ck = Recomputer(RecomputeSettings(cpu_checkpointing=True))
    ck.checkpoint(fn, x, scale=scale, debug=True).pow(2).sum().backward()
    got = [x.grad.clone(), scale.grad.clone()]
    assert seen == [True, True]  # forward and recompute
    assert ck.offload_stats.tensors == 2  # the keyword tensor is saved like the positional one
    x.grad = scale.grad = None
    fn(x, scale=scale).pow(2).sum().backward()
    assert_all_equal(got, [x.grad, scale.grad])


def test_several_tensor_outputs() -> None:
    lin = nn.Linear(6, 6)
    x = torch.randn(4, 6, requires_grad=True)

    def fn(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = lin(h)
        return torch.relu(y), torch.sigmoid(y), y.mean()

    def loss(outs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return outs[0].sum() + 2 * outs[1].square().sum() - outs[2]

    loss(Recomputer().checkpoint(fn, x)).backward()
    got = [x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()]
    x.grad = lin.weight.grad = lin.bias.grad = None
    loss(fn(x)).backward()
    assert_all_equal(got, [x.grad, lin.weight.grad, lin.bias.grad])


def saved_activation_bytes(model: nn.Sequential, x: torch.Tensor, segment: int | None) -> int:
    """Bytes of distinct non-parameter tensors autograd keeps for backward."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    layers = list(model)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        if segment is None:
            h = model(h)
        else:
            ck = Recomputer()
            for start in range(0, len(layers), segment):
                h = ck.checkpoint(nn.Sequential(*layers[start:start + segment]), h)
    h.sum().backward()
    return sum(seen.values())


def test_checkpointing_saves_far_fewer_activation_bytes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(16) for m in (nn.Linear(512, 512), nn.GELU())))
    x = torch.randn(64, 512, requires_grad=True)
    one = 64 * 512 * 4  # bytes of one activation
    plain = saved_activation_bytes(model, x, segment=None)
    per_layer = saved_activation_bytes(model, x, segment=2)
    per_four = saved_activation_bytes(model, x, segment=8)
    assert plain == 32 * one  # each layer keeps the Linear input and the GELU input
    assert per_layer == 16 * one  # only each checkpoint's input
    assert per_four == 4 * one
    assert per_four < 0.4 * plain


def test_profile_counts_forwards_and_recomputes() -> None:
    model = make_model()
    ck = Recomputer(RecomputeSettings(profile=True))
    grads_of(model, X, seed=1, run=ck.checkpoint)
    t = ck.timings
    assert (t.forward_calls, t.recompute_calls) == (3, 3)
    assert t.forward_seconds > 0 and t.recompute_seconds > 0
    unprofiled = Recomputer()
    grads_of(model, X, seed=1, run=unprofiled.checkpoint)
    assert unprofiled.timings.forward_calls == 0
    with torch.no_grad():
        ck.checkpoint(model[0], X)
    assert (t.forward_calls, t.recompute_calls) == (4, 3)


class CountingAccelerator(CPU_Accelerator):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def synchronize(self, device_index: int | None = None) -> None:
        self.calls.append("sync")


def test_synchronize_checkpoint_boundary_syncs_before_and_after() -> None:
    lin = nn.Linear(4, 4)
    on = CountingAccelerator()
    Recomputer(RecomputeSettings(synchronize_checkpoint_boundary=True),
                 accelerator=on).checkpoint(lin, torch.randn(2, 4))
    off = CountingAccelerator()
    Recomputer(accelerator=off).checkpoint(lin, torch.randn(2, 4))
    assert (on.calls, off.calls) == (["sync", "sync"], [])


DS_CONFIG = {"train_batch_size": 8,
             "activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 4,
                                          "profile": True, "contiguous_memory_optimization": True}}


def test_configure_from_dict_with_overrides(restore_facade: None) -> None:
    ck = checkpointing.configure(None, deepspeed_config=DS_CONFIG, num_checkpoints=2,
                                 profile=False, synchronize=True)
    assert checkpointing.is_configured() and checkpointing.get_recomputer() is ck
    assert ck.settings == RecomputeSettings(
        cpu_checkpointing=True, number_checkpoints=2, profile=False,
        contiguous_memory_optimization=True, synchronize_checkpoint_boundary=True)
    lin = nn.Linear(4, 4)
    checkpointing.checkpoint(lin, torch.randn(2, 4))  # the facade uses the configured settings
    assert ck.offload_stats.tensors == 1
    # every configure starts again from the defaults, as DeepSpeed's does
    reconfigured = checkpointing.configure(None, checkpoint_in_cpu=False)
    assert reconfigured.settings == RecomputeSettings()


def test_configure_from_path_and_parsed_config(restore_facade: None, tmp_path: Any) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_CONFIG))
    want = RecomputeSettings(cpu_checkpointing=True, number_checkpoints=4, profile=True,
                                 contiguous_memory_optimization=True)
    assert checkpointing.configure(None, deepspeed_config=str(path)).settings == want
    assert checkpointing.configure(None, deepspeed_config=load_config(DS_CONFIG)).settings == want
    # only the section is read: a config without batch sizes is fine here
    no_batch = {"activation_checkpointing": DS_CONFIG["activation_checkpointing"]}
    assert RecomputeSettings.from_config(no_batch) == want


def test_bad_config_values_are_named() -> None:
    with pytest.raises(ConfigError, match=r"activation_checkpointing.cpu_checkpointin: unknown "
                                          r"key; did you mean cpu_checkpointing"):
        RecomputeSettings.from_config({"activation_checkpointing": {"cpu_checkpointin": True}})
    with pytest.raises(ValueError, match=r"number_checkpoints: 0 is out of range"):
        RecomputeSettings(number_checkpoints=0)
    with pytest.raises(TypeError, match=r"activation_checkpointing.profile: 'yes' is not a bool"):
        RecomputeSettings(profile="yes")  # type: ignore[arg-type]


def test_partition_activations_is_refused_by_name(restore_facade: None) -> None:
    pattern = r"partition_activations=True needs model \(tensor\) parallelism"
    with pytest.raises(NotImplementedError, match=pattern):
        checkpointing.configure(None, partition_activations=True)
    with pytest.raises(NotImplementedError, match=pattern):
        checkpointing.configure(None, deepspeed_config={
            "activation_checkpointing": {"partition_activations": True}})
    assert checkpointing.configure(None, partition_activations=False).settings == \
        RecomputeSettings()


def test_user_errors() -> None:
    with pytest.raises(TypeError, match=r"function: 3 is not callable"):
        Recomputer().checkpoint(3, torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"settings: dict is not RecomputeSettings"):
        Recomputer({"profile": True})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"seed: 1.5 is not an int"):
        checkpointing.model_parallel_cuda_manual_seed(1.5)  # type: ignore[arg-type]


def test_model_parallel_cuda_manual_seed_seeds_torch() -> None:
    checkpointing.model_parallel_cuda_manual_seed(11)
    a = torch.rand(4)
    checkpointing.model_parallel_cuda_manual_seed(11)
    assert torch.equal(a, torch.rand(4))


def _engine_configures_checkpointing() -> list[Any]:
    import zerospeed
    from zerospeed import checkpointing

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "activation_checkpointing": {"cpu_checkpointing": True, "profile": True}}
    zerospeed.initialize(model=torch.nn.Linear(3, 3), config=config)
    settings = checkpointing.get_recomputer().settings
    out: list[Any] = [settings.cpu_checkpointing, settings.profile]
    try:
        zerospeed.initialize(model=torch.nn.Linear(3, 3),
                             config={**config, "activation_checkpointing": {"partition_activations": True}})
        out.append("no error")
    except NotImplementedError as exc:
        out.append(str(exc))
    return out


def test_the_engine_applies_the_config_section() -> None:
    from zerospeed.testing import run_distributed

    cpu, profile, refused = run_distributed(_engine_configures_checkpointing, 1)[0]
    assert cpu is True and profile is True
    assert "activation_checkpointing.partition_activations" in refused


def _stage3_with_checkpointed_blocks(reentrant: bool) -> dict[str, Any]:
    """ZeRO-3 with checkpointed blocks: a recomputed forward (inside backward, possibly stopped early by
    PyTorch) must neither leave its units marked in use nor release them before their backward."""
    import zerospeed
    from zerospeed.zero.flat_param import FlatParamUnit

    class Net(nn.Module):
        def __init__(self, checkpointed: bool) -> None:
            super().__init__()
            self.checkpointed = checkpointed
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                        for _ in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                if not self.checkpointed:
                    x = x + block(x)
                elif reentrant:  # PyTorch's reentrant form: the first forward runs without grad
                    x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
                else:
                    x = x + checkpointing.checkpoint(block, x)
            return x.pow(2).mean()

    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1}}
    most = [0]
    original = FlatParamUnit.gather

    def gather(unit: FlatParamUnit, async_op: bool = False) -> None:
        original(unit, async_op)
        most[0] = max(most[0], sum(u.numel for u in engine.state.units if u.gathered and not u.persistent))

    losses: dict[bool, list[float]] = {}
    after_forward = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        engine, *_ = zerospeed.initialize(model=Net(checkpointed), config=config)
        FlatParamUnit.gather = gather  # type: ignore[method-assign]
        try:
            losses[checkpointed] = []
            for step in range(3):
                # an input that requires grad, as an embedding's output would (reentrant needs one)
                loss = engine(torch.randn(2, 32, generator=torch.Generator().manual_seed(step)).requires_grad_())
                after_forward.append(sum(u.gathered for u in engine.state.units if not u.persistent))
                engine.backward(loss)
                engine.step()
                losses[checkpointed].append(loss.item())
        finally:
            FlatParamUnit.gather = original  # type: ignore[method-assign]
    unit_numel = max(u.numel for u in engine.state.units)
    return {"losses": losses, "after_forward": after_forward, "most_units": most[0] / unit_numel}


@pytest.mark.parametrize("reentrant", [False, True])
def test_stage3_releases_checkpointed_blocks_after_their_backward(reentrant: bool) -> None:
    from zerospeed.testing import run_distributed

    out = run_distributed(_stage3_with_checkpointed_blocks, 1, reentrant)[0]
    assert out["losses"][True] == out["losses"][False]
    assert max(out["after_forward"]) <= 1, out["after_forward"]  # at most the last block, kept for its backward
    assert out["most_units"] <= 3, out["most_units"]  # never more than a few of the 6 blocks at once

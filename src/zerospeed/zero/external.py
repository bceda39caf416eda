"""Declaring that a module's forward uses a parameter owned by another module (ZeRO-3).

Under stage 3 a module's forward finds only the parameters it owns gathered. A module that reads
another module's parameter (``F.linear(x, self.embed.weight)`` in a head, say) must say so, as in
DeepSpeed, so that parameter is gathered around its forward too. A tied parameter that the module
holds under its own name (``head.weight = embed.weight``) is found automatically. The declaration
lives on the module object itself, so it travels with the model and needs no global registry.
"""

from __future__ import annotations

from torch import nn

_ATTR = "_zerospeed_external_params"


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Gather ``parameter`` around ``module``'s forward under ZeRO-3 (harmless at other stages).

    Call it before :func:`zerospeed.initialize`.
    """
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter expects an nn.Parameter, got {type(parameter).__name__}")
    held = module.__dict__.setdefault(_ATTR, [])
    if not any(p is parameter for p in held):
        held.append(parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    held = module.__dict__.get(_ATTR, [])
    if not any(p is parameter for p in held):
        raise ValueError(f"this parameter (shape {tuple(parameter.shape)}) was not registered as external "
                         f"for module {type(module).__name__}")
    module.__dict__[_ATTR] = [p for p in held if p is not parameter]


def external_parameters(model: nn.Module) -> dict[int, list[nn.Parameter]]:
    """``id(module) -> parameters it declared`` for every module of ``model`` that declared some."""
    return {id(m): list(m.__dict__[_ATTR]) for m in model.modules() if m.__dict__.get(_ATTR)}

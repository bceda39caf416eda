"""``ToTensor``, ``Normalize`` and ``Compose`` with torchvision's arithmetic."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]):
        self.transforms = list(transforms)

    def __call__(self, value: Any) -> Any:
        for transform in self.transforms:
            value = transform(value)
        return value


class ToTensor:
    """An HxWxC uint8 image -> a CxHxW float tensor in [0, 1]."""

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float().div(255.0)


class Normalize:
    """Per channel: (x - mean) / std."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean) / self.std

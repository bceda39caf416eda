"""``CIFAR10`` over files in CIFAR-10's python format (``cifar-10-batches-py/``); downloads refused."""

from __future__ import annotations

import os
import pickle
from typing import Any, Callable

import numpy as np

TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILES = ["test_batch"]
BASE_FOLDER = "cifar-10-batches-py"


class CIFAR10:
    def __init__(self, root: str, train: bool = True, transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None, download: bool = False):
        folder = os.path.join(os.path.expanduser(root), BASE_FOLDER)
        files = [os.path.join(folder, name) for name in (TRAIN_FILES if train else TEST_FILES)]
        missing = [path for path in files if not os.path.isfile(path)]
        if missing:
            raise RuntimeError(f"this test runs offline and {missing[0]} was not generated beforehand "
                               f"(download={download} cannot fetch it)")
        data, targets = [], []
        for path in files:
            with open(path, "rb") as f:
                entry = pickle.load(f, encoding="latin1")
            data.append(entry["data"])
            targets.extend(entry["labels"])
        self.data = np.vstack(data).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # N x H x W x C
        self.targets = targets
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image, target = self.data[index], self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

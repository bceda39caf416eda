"""Real English text that every Python install carries: the standard library's docstrings.

No download, no tokenizer training: the text is byte-level (vocab 256), collected in a fixed file
order so every rank and every run builds the identical corpus, and cut into fixed-length windows.
"""

from __future__ import annotations

import ast
import sysconfig
import warnings
from pathlib import Path
from typing import Iterator

import torch
from torch.utils.data import Dataset

VOCAB = 256
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"})


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _python_files(root: Path) -> Iterator[Path]:
    """The stdlib's .py files in sorted order, without tests and third-party packages."""
    for path in sorted(root.rglob("*.py")):
        if not SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]):
            yield path


def _docstrings(source: str) -> Iterator[str]:
    """Module, class and function docstrings of one file, in source order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # old escape sequences in some stdlib files
        tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:  # one-liners like "Return x." teach little
                yield doc


def build_corpus(max_bytes: int = 2_000_000, root: Path | None = None) -> bytes:
    """Concatenated ASCII docstrings, deterministic for a given stdlib, capped at ``max_bytes``."""
    parts: list[bytes] = []
    total = 0
    for path in _python_files(root or stdlib_dir()):
        try:
            source = path.read_text(encoding="utf-8")
            docs = list(_docstrings(source))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for doc in docs:
            data = doc.encode("ascii", errors="ignore") + b"\n\n"
            parts.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(parts)[:max_bytes]
    return b"".join(parts)


def split(corpus: bytes, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tensors (train, validation); the validation part is the corpus tail, never trained on."""
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    cut = int(len(data) * (1 - val_fraction))
    return data[:cut], data[cut:]


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens; item ``i`` is ``(input, target)``."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("ascii", errors="ignore")), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    return bytes(int(t) for t in tokens).decode("ascii", errors="replace")

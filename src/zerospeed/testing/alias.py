"""The environment of a child process whose ``import deepspeed`` is zerospeed (framework and example tests)."""

from __future__ import annotations

import os
from pathlib import Path

import zerospeed
from zerospeed.deepspeed_alias import ENV_SWITCH, PTH_FILE, pth_hook_installed

# The directory holding this zerospeed package (the checkout's src/), first on a child's path so it runs the
# code under test.
PACKAGE_ROOT = Path(zerospeed.__file__).resolve().parents[1]


def alias_env(*pythonpath: str | os.PathLike[str], **extra: str) -> dict[str, str]:
    """This process's environment with ``ZEROSPEED_AS_DEEPSPEED=1``, ``extra`` variables, and ``PYTHONPATH``
    starting with ``pythonpath`` then :data:`PACKAGE_ROOT`. The switch is read by the installed ``.pth``
    hook, so a missing hook fails here with the fix rather than as a confusing import error in the child."""
    assert pth_hook_installed(), (f"{PTH_FILE} is not in site-packages, so {ENV_SWITCH}=1 does nothing: install the "
                                  f"package (make install; setup.py puts it in wheels and editable installs)")
    path = [*map(str, pythonpath), str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, **{ENV_SWITCH: "1"}, **extra, PYTHONPATH=os.pathsep.join(path))


__all__ = ["PACKAGE_ROOT", "alias_env"]

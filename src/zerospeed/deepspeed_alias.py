"""``import deepspeed`` answered by zerospeed: the same module objects, not copies.

:func:`install_as_deepspeed` puts a meta-path finder in front of the import system that maps every
``deepspeed.X`` import to the module ``zerospeed.X`` (imported under its own name first, so each
class exists once and ``deepspeed.accelerator is zerospeed.accelerator``). DeepSpeed's own module
paths that zerospeed organizes differently are thin re-export modules under ``zerospeed.runtime``,
``zerospeed.moe``, ``zerospeed.utils``... so the map itself stays a plain prefix swap.

The finder also answers ``importlib.metadata`` for the distribution "deepspeed", because frameworks
(transformers, accelerate, Lightning) check it before they import: its version is the DeepSpeed
release whose API zerospeed follows, with zerospeed's own version as the local label.

Setting ``ZEROSPEED_AS_DEEPSPEED=1`` does the same at interpreter start (through the
``zerospeed_as_deepspeed.pth`` file installed with the package), so ``torchrun`` and ``accelerate
launch`` scripts need no edit. With the real DeepSpeed installed, zerospeed never shadows it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Iterable, Mapping, Sequence

DEEPSPEED_API_VERSION = "0.19.8"  # the DeepSpeed release whose public API zerospeed follows
ENV_SWITCH = "ZEROSPEED_AS_DEEPSPEED"
PTH_FILE = "zerospeed_as_deepspeed.pth"  # placed in site-packages by setup.py; reads ENV_SWITCH at start
_ALIAS = "deepspeed"
_TARGET = "zerospeed"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class DeepSpeedInstalledError(RuntimeError):
    """The real DeepSpeed is importable here; zerospeed refuses to hide it."""


def metadata_version() -> str:
    """The version ``importlib.metadata.version("deepspeed")`` reports: the followed DeepSpeed API,
    with zerospeed's version as a PEP 440 local label (it passes ``>=`` gates on the public part)."""
    from zerospeed import __version__

    return f"{DEEPSPEED_API_VERSION}+{_TARGET}.{__version__}"


def _target_name(fullname: str) -> str | None:
    """``deepspeed.X.Y`` -> ``zerospeed.X.Y``; None for names outside ``deepspeed``."""
    if fullname == _ALIAS or fullname.startswith(_ALIAS + "."):
        return _TARGET + fullname[len(_ALIAS):]
    return None


class _SameModuleLoader(importlib.abc.Loader):
    """Hands the import system the already-loaded ``zerospeed`` module instead of a new one."""

    def __init__(self, target: str):
        self.target = target
        self._own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias's spec on the module; it keeps its own identity.
        if self._own_spec is not None:
            module.__spec__ = self._own_spec


class _AliasDistribution(importlib.metadata.Distribution):
    """Package metadata for "deepspeed", describing zerospeed standing in for it."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: {_ALIAS}\nVersion: {metadata_version()}\n"
                    f"Summary: zerospeed, installed as deepspeed (zerospeed.install_as_deepspeed)\n")
        if filename == "top_level.txt":
            return _ALIAS + "\n"
        return None

    def locate_file(self, path: Any) -> Any:
        import pathlib

        return pathlib.Path(os.path.dirname(os.path.dirname(__file__))) / str(path)


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """Maps ``deepspeed.*`` imports onto ``zerospeed.*`` modules and answers the metadata lookup."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        name = _target_name(fullname)
        if name is None:
            return None
        own = sys.modules.get(name)
        own_spec = own.__spec__ if own is not None else importlib.util.find_spec(name)
        if own_spec is None:
            return None  # "No module named 'deepspeed.X'": zerospeed has no such module
        return importlib.machinery.ModuleSpec(fullname, _SameModuleLoader(name),
                                              is_package=own_spec.submodule_search_locations is not None)

    def find_distributions(self, context: Any = None) -> Iterable[importlib.metadata.Distribution]:
        wanted = getattr(context, "name", None)
        if wanted is None or _normalized(wanted) == _ALIAS:
            yield _AliasDistribution()


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _installed_finder() -> DeepSpeedAliasFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, DeepSpeedAliasFinder)), None)


def is_installed() -> bool:
    """Whether ``deepspeed`` imports currently resolve to zerospeed."""
    return _installed_finder() is not None


def real_deepspeed() -> str | None:
    """Where the real DeepSpeed is, if it is importable or installed (None when it is not)."""
    loaded = sys.modules.get(_ALIAS)
    if loaded is not None and not (loaded.__name__ == _TARGET):
        return getattr(loaded, "__file__", None) or "sys.modules['deepspeed']"
    spec = importlib.util.find_spec(_ALIAS) if loaded is None else None
    if spec is not None:
        return spec.origin or ", ".join(spec.submodule_search_locations or ()) or "an importable 'deepspeed'"
    try:
        dist = importlib.metadata.distribution(_ALIAS)
    except importlib.metadata.PackageNotFoundError:
        return None
    if isinstance(dist, _AliasDistribution):
        return None
    return f"deepspeed {dist.version} (package metadata at {dist.locate_file('')})"


def install_as_deepspeed() -> None:
    """Make ``import deepspeed`` (and every ``deepspeed.X``) give zerospeed's modules, and
    ``importlib.metadata`` report a "deepspeed" distribution. Idempotent. Raises
    :class:`DeepSpeedInstalledError` when the real DeepSpeed is installed."""
    if is_installed():
        return
    where = real_deepspeed()
    if where is not None:
        raise DeepSpeedInstalledError(
            f"zerospeed.install_as_deepspeed(): the real DeepSpeed is installed ({where}); zerospeed will not "
            f"shadow it. Uninstall it (pip uninstall deepspeed) to run DeepSpeed scripts on zerospeed, or "
            f"write `import zerospeed as deepspeed` in your own code")
    sys.meta_path.insert(0, DeepSpeedAliasFinder())
    from zerospeed.integrations.hf import install_accelerate_shim

    install_accelerate_shim()  # Accelerate + DeepSpeed on a CPU-only machine (see integrations/hf.py)


def uninstall_as_deepspeed() -> None:
    """Undo :func:`install_as_deepspeed`: remove the finder and the ``deepspeed.*`` aliases it made."""
    finder = _installed_finder()
    if finder is None:
        return
    sys.meta_path.remove(finder)
    from zerospeed.integrations.hf import uninstall_accelerate_shim

    uninstall_accelerate_shim()
    for name in [n for n in sys.modules if _target_name(n) is not None]:
        if sys.modules[name] is sys.modules.get(_target_name(name) or ""):
            del sys.modules[name]


def pth_hook_installed() -> bool:
    """Whether :data:`PTH_FILE` is in a site-packages directory, so ``ZEROSPEED_AS_DEEPSPEED=1`` takes effect
    at interpreter start (the package was installed, not just put on ``PYTHONPATH``)."""
    import site

    return any(os.path.isfile(os.path.join(d, PTH_FILE)) for d in [*site.getsitepackages(), site.getusersitepackages()])


def install_from_environment(environ: Mapping[str, str] | None = None) -> bool:
    """The ``.pth`` hook: install when ``ZEROSPEED_AS_DEEPSPEED`` is on. It runs at interpreter start,
    where an exception would only print a traceback, so problems are reported as one clear line on
    stderr instead. Returns whether the alias is installed.

    The ``.pth`` line calls it only while this module is not imported yet: inside a virtual environment
    CPython's ``site`` reads site-packages twice (once for the venv, once more with the system prefixes),
    which ran the hook, and printed its complaint, twice."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_SWITCH, "").strip().lower()
    if value in _FALSE:
        return False
    if value not in _TRUE:
        print(f"zerospeed: {ENV_SWITCH}={env.get(ENV_SWITCH)!r} is not understood; set it to 1 to make "
              f"`import deepspeed` use zerospeed, or 0 / unset for not", file=sys.stderr)
        return False
    try:
        install_as_deepspeed()
    except DeepSpeedInstalledError as exc:
        print(f"zerospeed: {ENV_SWITCH}=1 ignored: {exc}", file=sys.stderr)
        return False
    return True


__all__ = ["DEEPSPEED_API_VERSION", "ENV_SWITCH", "PTH_FILE", "DeepSpeedAliasFinder", "DeepSpeedInstalledError",
           "install_as_deepspeed", "install_from_environment", "is_installed", "metadata_version", "pth_hook_installed",
           "real_deepspeed", "uninstall_as_deepspeed"]

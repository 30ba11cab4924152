"""The opt-in import hook: ``import areal.…`` served from this package when AReaL is absent.

A :data:`sys.meta_path` finder. Each AReaL module it covers is a fresh module holding the
names of one compat module (the same objects, so ``isinstance`` holds across both);
packages (``areal``, ``areal.api``, ...) run none of AReaL's ``__init__`` code. Names under
``from_source`` prefixes (``areal.workflow`` by default) load from AReaL source files in
a directory given to :func:`install` (an unpacked wheel), unchanged. Any other ``areal``
name raises :class:`ImportError` listing what is covered.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["COVERED", "current_options", "install", "installed", "uninstall"]

_HERE = __name__.rpartition(".")[0]

#: AReaL module -> compat module serving it (None: a package with only the names below).
COVERED: dict[str, str | None] = {
    "areal": None,
    "areal.api": None,
    "areal.api.workflow_api": "workflow_api",
    "areal.api.engine_api": "engine_api",
    "areal.api.io_struct": "io_struct",
    "areal.api.cli_args": "cli_args",
    "areal.api.reward_api": "reward_api",
    "areal.infra": None,
    "areal.infra.workflow_context": "workflow_context",
    "areal.workflow_context": "workflow_context",
    "areal.utils": None,
    "areal.utils.data": "data",
    "areal.utils.stats_tracker": "stats_tracker",
    "areal.utils.perf_tracer": "perf_tracer",
    "areal.utils.logging": "log",
    "areal.utils.hf_utils": "hf_utils",
    "areal.utils.dynamic_import": "dynamic_import",
    "areal.utils.image": "image",
    "areal.experimental": None,
    "areal.experimental.openai": "openai",
}

#: Package names -> (attribute, module or "module:name") they offer, as AReaL's ``__init__`` do.
_PACKAGE_NAMES: dict[str, dict[str, str]] = {
    "areal": {"workflow_context": "areal.infra.workflow_context"},
    "areal.infra": {"workflow_context": "areal.infra.workflow_context"},
    "areal.api": {
        "RolloutWorkflow": "areal.api.workflow_api:RolloutWorkflow",
        "AgentWorkflow": "areal.api.workflow_api:AgentWorkflow",
        "WorkflowLike": "areal.api.workflow_api:WorkflowLike",
        "InferenceEngine": "areal.api.engine_api:InferenceEngine",
        "ModelRequest": "areal.api.io_struct:ModelRequest",
        "ModelResponse": "areal.api.io_struct:ModelResponse",
        "AsyncRewardWrapper": "areal.api.reward_api:AsyncRewardWrapper",
    },
}


def _not_covered(name: str) -> str:
    return (
        f"{name} is not served by rollout_trio.compat.areal (AReaL is not installed); it covers the modules "
        f"{', '.join(m for m in COVERED if COVERED[m])} (see docs/areal.md)"
    )


class _Loader(importlib.abc.Loader):
    def __init__(self, source: str | None) -> None:
        self.source = source

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        if self.source is not None:
            src = importlib.import_module(f"{_HERE}.{self.source}")
            for attr in src.__all__:
                setattr(module, attr, getattr(src, attr))
            module.__doc__ = src.__doc__
        for attr, target in _PACKAGE_NAMES.get(name, {}).items():
            mod_name, _, obj = target.partition(":")
            mod = importlib.import_module(mod_name)
            setattr(module, attr, getattr(mod, obj) if obj else mod)
        if name == "areal":
            module.__version__ = "1.0.4+rollout_trio.compat"  # type: ignore[attr-defined]

        def __getattr__(attr: str) -> Any:  # noqa: N807 - a module's attribute hook
            raise AttributeError(f"{name}.{attr} is not served by rollout_trio.compat.areal (see docs/areal.md)")

        module.__getattr__ = __getattr__  # type: ignore[method-assign]


class _SourcePackage(importlib.abc.Loader):
    """A directory of AReaL sources as a package, without running its ``__init__``."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class ArealFinder(importlib.abc.MetaPathFinder):
    """Serves ``areal`` and its covered submodules (see :data:`COVERED`)."""

    def __init__(self, sources: str | None, from_source: tuple[str, ...]) -> None:
        self.sources = sources
        self.from_source = from_source

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "areal" and not fullname.startswith("areal."):
            return None
        if fullname in COVERED:
            source = COVERED[fullname]
            return importlib.util.spec_from_loader(fullname, _Loader(source), is_package=source is None)
        if self.sources is not None and any(fullname == p or fullname.startswith(p + ".") for p in self.from_source):
            base = os.path.join(self.sources, *fullname.split("."))
            if os.path.isdir(base):
                spec = importlib.util.spec_from_loader(fullname, _SourcePackage(), is_package=True)
                assert spec is not None and spec.submodule_search_locations is not None
                spec.submodule_search_locations.append(base)
                return spec
            if os.path.isfile(base + ".py"):
                return importlib.util.spec_from_file_location(fullname, base + ".py")
        raise ModuleNotFoundError(_not_covered(fullname), name=fullname)


_finder: ArealFinder | None = None


def _real_areal_installed() -> bool:
    return any(
        finder is not _finder and getattr(finder, "find_spec", None) and finder.find_spec("areal", None) is not None
        for finder in sys.meta_path
        if not isinstance(finder, ArealFinder)
    )


def install(sources: str | os.PathLike[str] | None = None, from_source: Sequence[str] = ("areal.workflow",)) -> bool:
    """Serve ``import areal.…`` from rollout_trio.compat.areal, unless AReaL is installed.

    Args:
        sources: a directory holding AReaL's ``areal/`` sources (an unpacked wheel): names
            under ``from_source`` load from its files, unchanged.
        from_source: the module prefixes taken from ``sources``.

    Returns:
        True if the hook serves ``areal`` now; False if the real AReaL is importable (the
        hook then stays out of the way).
    """
    global _finder
    if _finder is None and ("areal" in sys.modules or _real_areal_installed()):
        return False
    options = (os.fspath(sources) if sources is not None else None, tuple(from_source))
    if _finder is None:
        _finder = ArealFinder(*options)
    else:
        _finder.sources, _finder.from_source = options
    if _finder not in sys.meta_path:  # new, or taken off by code that reset sys.meta_path
        sys.meta_path.insert(0, _finder)
    return True


def installed() -> bool:
    """Whether the hook is installed."""
    return _finder is not None


def current_options() -> dict[str, Any] | None:
    """The arguments of :func:`install` now in force (None when not installed)."""
    if _finder is None:
        return None
    return {"sources": _finder.sources, "from_source": _finder.from_source}


def uninstall() -> None:
    """Remove the hook and forget every ``areal`` module it served."""
    global _finder
    if _finder is None:
        return
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
    for name in [n for n in sys.modules if n == "areal" or n.startswith("areal.")]:
        del sys.modules[name]

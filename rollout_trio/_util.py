"""Internal helpers."""

from __future__ import annotations

import os
import typing
from collections.abc import Callable
from typing import Any


# mutmut (mutation testing, README "Developing") adds a method copy per mutant, named
# ``xǁClassǁmethod__mutmut_…``, and maps tests to mutants by each copy's ``__module__``:
# rewritten to the public module, no test reached the methods of a public class.
_MUTMUT_MARK = "__mutmut_"


def fixup_module_metadata(module_name: str, namespace: dict[str, Any]) -> None:
    """Make public names report the public module (``rollout_trio.X``), as Trio does.

    Tracebacks, reprs and documentation then show where users import a name from,
    not the private module it is defined in. A class's string annotations are tied to the
    module they were written in first (``ForwardRef(..., module=...)``): ``get_type_hints``
    and cattrs, which look names up in ``sys.modules[cls.__module__]``, still resolve them
    there, whenever they run (the root loads its names one module at a time).
    """
    seen: set[int] = set()

    def fix(name: str, obj: Any, qualname: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        mod = getattr(obj, "__module__", None)
        if mod is not None and mod.startswith("rollout_trio."):
            if isinstance(obj, type):
                _pin_annotations(obj, mod)
            obj.__module__ = module_name
            if isinstance(obj, type):
                obj.__qualname__ = qualname
                for attr_name, attr_value in obj.__dict__.items():
                    if _MUTMUT_MARK not in attr_name:
                        fix(attr_name, attr_value, f"{qualname}.{attr_name}")

    for name, obj in namespace.items():
        if not name.startswith("_") and (isinstance(obj, type) or callable(obj)):
            fix(name, obj, name)


def _pin_annotations(cls: type, home: str) -> None:
    annotations = cls.__dict__.get("__annotations__")
    if isinstance(annotations, dict):
        for key, value in annotations.items():
            if isinstance(value, str):
                annotations[key] = typing.ForwardRef(value, is_argument=False, module=home, is_class=True)


class LazyModule:
    """A stand-in for a heavy module (torch) that imports it on first attribute access.

    It then puts the real module in its place in the namespace that holds it, so later
    lookups in that module find the real one and pay nothing. Use it as::

        if TYPE_CHECKING:
            import torch
        else:
            torch = LazyModule("torch", globals())

    Args:
        name: the module's import name, also the global it stands in for.
        namespace: the ``globals()`` of the module that holds the stand-in.
    """

    __slots__ = ("_name", "_namespace")

    def __init__(self, name: str, namespace: dict[str, Any]) -> None:
        self._name = name
        self._namespace = namespace

    def __getattr__(self, attribute: str) -> Any:
        import importlib

        module = importlib.import_module(self._name)
        self._namespace[self._name] = module
        return getattr(module, attribute)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def lazy_names(
    package: str, table: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for public names imported on first use (PEP 562).

    Each name imports only the private module that defines it, then reports the package as
    its module (:func:`fixup_module_metadata`) and stays in the package's namespace, so
    later lookups skip ``__getattr__``.

    Args:
        package: the package's ``__name__``.
        table: public name -> the private module defining it, relative (``"._dump"``).
        namespace: the package's ``globals()``.

    Returns:
        ``(__getattr__, __dir__)``, to assign at the package's top level.
    """
    import importlib

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        fixup_module_metadata(package, {name: value})
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *table})

    return __getattr__, __dir__


#: Files of which a saved tokenizer has at least one. From a directory with none of them,
#: transformers 5 builds an *empty* tokenizer out of config.json alone (one token, no chat
#: template), so a checkpoint saved without its tokenizer is refused by name instead.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def lacks_tokenizer(path: str | os.PathLike[str]) -> str | None:
    """Why the checkpoint directory ``path`` has no tokenizer to load, or None if it has one."""
    if any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return None
    return f"no tokenizer in it (none of {', '.join(TOKENIZER_FILES)}); save one with tokenizer.save_pretrained"

"""Internal helpers."""

from __future__ import annotations

from typing import Any


def fixup_module_metadata(module_name: str, namespace: dict[str, Any]) -> None:
    """Make public names report the public module (``rollout_trio.X``), as Trio does.

    Tracebacks, reprs and documentation then show where users import a name from,
    not the private module it is defined in.
    """
    seen: set[int] = set()

    def fix(name: str, obj: Any, qualname: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        mod = getattr(obj, "__module__", None)
        if mod is not None and mod.startswith("rollout_trio."):
            obj.__module__ = module_name
            if isinstance(obj, type):
                obj.__qualname__ = qualname
                for attr_name, attr_value in obj.__dict__.items():
                    fix(attr_name, attr_value, f"{qualname}.{attr_name}")

    for name, obj in namespace.items():
        if not name.startswith("_") and (isinstance(obj, type) or callable(obj)):
            fix(name, obj, name)

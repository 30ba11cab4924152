"""``areal.utils.dynamic_import``: ``import_from_string``."""

from ..._workflow import import_from_string

__all__ = ["import_from_string"]

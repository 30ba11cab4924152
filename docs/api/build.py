"""Build the API reference from the docstrings, with pdoc: ``python docs/api/build.py [OUT_DIR]``.

Writes one HTML page per public module (``rollout_trio`` and its public subpackages) to
OUT_DIR (default ``docs/api/html``; open ``index.html``). ``python -W error docs/api/build.py``
is what ``tests/test_api_docs.py`` runs: any pdoc warning (an annotation it cannot resolve, a
docstring it cannot parse) fails the build. Needs the ``test`` extra (pdoc).

Why pdoc and not MkDocs with mkdocstrings: pdoc builds straight from the importable package
with no configuration file or page list to keep in step with the modules, reads the Google
style ("Args:", "Returns:", "Raises:") the docstrings use, and is one dependency (with Jinja2,
already present) against four (mkdocs, mkdocstrings, mkdocstrings-python, griffe).

The package makes its public names report the public module (``Trajectory.__module__ ==
"rollout_trio"``, as Trio does, for tracebacks and reprs). pdoc resolves a name's string
annotations in the module ``__module__`` names, where the private module's imports (``Any``,
``Sequence``) are missing; so before building, this script points each public name back at
the module that defines it, in this process only.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "html"


def public_modules() -> list[str]:
    """``rollout_trio`` and every submodule whose dotted name has no ``_``-prefixed part."""
    import rollout_trio

    names = ["rollout_trio"]
    for info in pkgutil.walk_packages(rollout_trio.__path__, "rollout_trio.", onerror=lambda name: None):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def _defining_module(obj: Any, modules: list[Any]) -> str | None:
    """The module that defines ``obj`` (a function or a class), whatever ``__module__`` says."""
    if inspect.isfunction(obj):  # (a decorated one, such as a Hypothesis strategy: the function it wraps)
        return inspect.unwrap(obj).__globals__.get("__name__")
    if not inspect.isclass(obj):
        return None
    by_file = {getattr(m, "__file__", None): m.__name__ for m in modules}
    for value in vars(obj).values():
        fn = inspect.unwrap(value.__func__ if isinstance(value, (classmethod, staticmethod)) else value)
        if inspect.isfunction(fn) and fn.__code__.co_filename in by_file:
            return by_file[fn.__code__.co_filename]
    pattern = re.compile(rf"^class {re.escape(obj.__name__)}\b", re.M)
    for m in modules:
        if vars(m).get(obj.__name__) is obj and m.__file__ and pattern.search(Path(m.__file__).read_text()):
            return m.__name__
    return None


def restore_defining_modules() -> None:
    """Point every public function and class (and their methods) back at the module that defines them."""
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("rollout_trio") and getattr(m, "__file__", None)]
    seen: dict[int, Any] = {}  # id -> the object, kept alive so that no id is reused

    def fix(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen[id(obj)] = obj
        home = _defining_module(obj, modules)
        if home is not None and home.startswith("rollout_trio") and getattr(obj, "__module__", None) != home:
            obj.__module__ = home
        if inspect.isclass(obj):
            for value in vars(obj).values():
                if inspect.isfunction(value):
                    fix(value)

    for m in modules:
        for name, obj in list(vars(m).items()):
            if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj) or callable(obj)):
                fix(obj)


def build(out: Path) -> list[str]:
    """Write the reference to ``out``; returns the modules documented."""
    import pdoc
    import pdoc.extract
    import pdoc.render

    names = public_modules()
    for name in names:  # every public name, so that lazy packages load (and fix them up) now
        module = importlib.import_module(name)
        for public in getattr(module, "__all__", ()):
            getattr(module, public)
    restore_defining_modules()
    pdoc.render.configure(docformat="google", show_source=False, footer_text="rollout_trio")
    # pdoc walks a package it is given into some submodules itself (naming one again is a
    # warning): give it each module that no earlier one brings in.
    specs: list[str] = []
    covered: set[str] = set()
    for name in names:
        if name not in covered:
            specs.append(name)
            covered.update(pdoc.extract.walk_specs([name]))
    with warnings.catch_warnings():
        # Hypothesis' @st.composite replaces each strategy with a wrapper generated in a
        # module of Hypothesis' own (its signature's annotations, SearchStrategy[ForwardRef(...)],
        # resolve there, where our names are not): pdoc shows them as written. The only
        # warnings let through, and only for rollout_trio.testing.strategies.
        warnings.filterwarnings(
            "ignore", r"Error parsing type annotation .* for rollout_trio\.testing\.strategies\.", UserWarning
        )
        # A class we derive from a third party's (ArealOpenAI from openai.AsyncOpenAI) shows
        # its inherited members, whose annotations may not resolve in that library's own
        # modules: not ours to fix. Our own members still fail the build.
        warnings.filterwarnings("ignore", r"Error parsing type annotation .* for (?!rollout_trio\.)", UserWarning)
        warnings.filterwarnings(
            "ignore", r"Cannot determine where rollout_trio\.compat\.areal\.openai\.ArealOpenAI\.", UserWarning
        )
        pdoc.pdoc(*specs, output_directory=out)
    return names


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else DEFAULT_OUT
    names = build(out)
    print(f"API reference of {len(names)} modules in {out}/index.html")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main(sys.argv[1:]))

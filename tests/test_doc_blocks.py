"""Every ```python block of README.md and docs/*.md runs as pasted (issue 32 item 1).

Each block is a program on its own: it runs alone, in a fresh ``__main__`` namespace, in an
empty directory, exactly as a reader would paste it into ``python``. Nothing is shared
between blocks, no name is injected, and top-level ``await`` is refused (pasted into
``python`` it is a SyntaxError): async code goes under ``trio.run``.

A block that needs something outside itself says so in its fence's info string, in
pytest-markdown-docs' syntax: ```` ```python fixture:fleet ````. The block reads that
thing the way a reader's program would (an environment variable with a default, or a
file the README made before it), and the fixture of that name provides it here:

- ``fleet``: a running ``rollout-trio fleet --workers 2`` (tiny model); the block reads
  ``ROLLOUT_TRIO_ROUTER`` (the router) or ``ROLLOUT_TRIO_SERVERS`` (its workers,
  comma-separated), which default to what ``rollout-trio fleet --port 30000`` prints.
- ``run_dump``: the dump ``rollout-trio run --groups 4 --dump runs`` writes, in the block's
  directory.
- ``vision_run_dump``: the dump ``rollout-trio run --task vision --groups 2 --group-size 4
  --max-new-tokens 2 --dump runs`` writes, in the block's directory.

Why a collector of our own and not pytest-markdown-docs or pytest-codeblocks (measured on
pytest-markdown-docs 0.9.2 and pytest-codeblocks 0.18.0): both collect only files under
the paths given to pytest, so the README's test command (``pytest tests props``) would
never see README.md or docs/; pytest-markdown-docs runs top-level ``await`` only through
pytest-asyncio's asyncio loop (not Trio), with ``--markdown-docs`` it also re-imports
every test module to look for fences in docstrings, and it pins markdown-it-py < 4 where
rich already installed 4.3; pytest-codeblocks runs every ``bash`` block too (the README's
``pip install`` and a server bound to 0.0.0.0), has no fixtures, and runs Python blocks
with ``__name__`` unset, so an ``if __name__ == "__main__":`` block passes without running.
We keep pytest-markdown-docs' ``fixture:NAME`` info strings, so moving to it later is a
change of collector, not of the documents.
"""

from __future__ import annotations

import ast
import atexit
import gc
import inspect
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
#: docs/real_model.md is a walk-through whose blocks depend on each other (a server one block
#: starts, the next uses): tests/test_real_model_guide.py runs it in order instead.
FOLLOWED_IN_ORDER = {ROOT / "docs" / "real_model.md"}
DOCUMENTS = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p not in FOLLOWED_IN_ORDER),
    ROOT / "examples" / "README.md",
]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^`]*)$")
#: what a fence's info string may ask for (each is a fixture of this module)
FIXTURES = ("fleet", "run_dump", "vision_run_dump")


@attrs.frozen
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    options: tuple[str, ...]
    source: str

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def fixtures(self) -> tuple[str, ...]:
        return tuple(o.removeprefix("fixture:") for o in self.options if o.startswith("fixture:"))


def code_blocks(text: str, path: str = "<text>") -> list[Block]:
    """The fenced blocks of a Markdown text; indented ones (in list items) dedented."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        close = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        lang, *options = opening["info"].split() or [""]
        body = textwrap.dedent("\n".join(lines[i + 1 : close]))
        blocks.append(Block(path, i + 1, lang, tuple(options), body + "\n"))
        i = close + 1
    return blocks


BLOCKS = [b for doc in DOCUMENTS for b in code_blocks(doc.read_text(), str(doc.relative_to(ROOT)))]
PYTHON = [b for b in BLOCKS if b.lang in ("python", "py", "python3")]


def test_the_extractor_finds_indented_blocks_lines_and_options():
    found = code_blocks("a\n\n```python fixture:fleet\nx = 1\n```\n- item\n\n  ```bash\n  ls\n  ```\n")
    assert found == [Block("<text>", 3, "python", ("fixture:fleet",), "x = 1\n"), Block("<text>", 8, "bash", (), "ls\n")]
    assert found[0].fixtures == ("fleet",)


def test_the_documents_have_blocks_and_ask_only_for_known_fixtures():
    assert len(PYTHON) >= 25
    for block in PYTHON:
        unknown = set(block.fixtures) - set(FIXTURES)
        other = [o for o in block.options if not o.startswith("fixture:")]
        assert not unknown and not other, f"{block.name}: info string {block.options}"


def _unbound_names(source: str) -> set[str]:
    """Global names ``source`` reads but neither imports nor assigns (builtins excepted)."""
    import builtins
    import symtable

    top = symtable.symtable(source, "<block>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    used: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables += table.get_children()
        for s in table.get_symbols():
            if s.is_referenced() and (table is top or s.is_global()):
                used.add(s.get_name())
    return {n for n in used - bound if not hasattr(builtins, n)}


def test_the_unbound_names_check_sees_a_missing_import():
    assert _unbound_names("async def f():\n    await trio.sleep(0)\ntrio.run(f)\n") == {"trio"}
    assert _unbound_names("import trio\nasync def f():\n    await trio.sleep(0)\ntrio.run(f)\n") == set()


@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_a_block_imports_or_defines_every_name_it_uses(block):
    """Checked without running anything: a fragment that leans on an earlier block fails here."""
    assert _unbound_names(block.source) == set(), f"{block.name} uses names it does not import or define"


def _compile(block: Block):  # noqa: ANN202 - a code object
    code = compile(block.source, block.name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    if code.co_flags & inspect.CO_COROUTINE:
        pytest.fail(f"{block.name}: top-level await is a SyntaxError when pasted into python; use trio.run(main)")
    return code


@pytest.fixture
def pasted(tmp_path, monkeypatch) -> Iterator[Path]:
    """An empty working directory, and the process restored after the block (import hooks,
    modules named ``areal``, a frozen collector, ``sys.argv``, atexit callbacks run now)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["-"])  # what python says when a program comes on stdin
    # A user with the fleet's key exported (a fleet a block starts uses it; RemoteEngine reads it).
    monkeypatch.setenv("ROLLOUT_TRIO_API_KEY", "doc-block-key-" + tmp_path.name.replace("_", "-")[-24:].ljust(8, "x"))
    meta_path, modules = list(sys.meta_path), set(sys.modules)
    registered: list[tuple[object, tuple[object, ...]]] = []

    def register(fn, *args, **kwargs):  # noqa: ANN001, ANN202 - atexit's own signature
        registered.append((fn, args))
        return fn

    monkeypatch.setattr(atexit, "register", register)
    try:
        yield tmp_path
    finally:
        for fn, args in reversed(registered):
            fn(*args)  # type: ignore[operator]
        gc.unfreeze()
        sys.meta_path[:] = meta_path
        for name in set(sys.modules) - modules:
            if name == "areal" or name.startswith("areal."):
                del sys.modules[name]


@pytest.fixture(scope="module")
def _fleet_process():
    pytest.importorskip("sglang_router")
    from tests.fleet_helpers import fleet

    with fleet(workers=2) as process:
        yield process


@pytest.fixture
def fleet(_fleet_process, monkeypatch):
    """A two-worker tiny-model fleet, named by ``ROLLOUT_TRIO_ROUTER`` and ``ROLLOUT_TRIO_SERVERS``."""
    monkeypatch.setenv("ROLLOUT_TRIO_ROUTER", _fleet_process.router)
    monkeypatch.setenv("ROLLOUT_TRIO_SERVERS", ",".join(url for url, _ in _fleet_process.workers))
    return _fleet_process


@pytest.fixture
def run_dump(pasted, capsys):
    """``rollout-trio run --groups 4 --dump runs`` in the block's directory (in process)."""
    from rollout_trio.cli import main

    assert main(["run", "--groups", "4", "--dump", "runs", "--no-progress"]) == 0
    capsys.readouterr()
    return pasted / "runs"


@pytest.fixture
def vision_run_dump(pasted, capsys):
    """``rollout-trio run --task vision ... --dump runs`` (the tiny VLM) in the block's directory."""
    from rollout_trio.cli import main

    argv = ["run", "--task", "vision", "--groups", "2", "--group-size", "4", "--max-new-tokens", "2", "--dump", "runs", "--no-progress"]
    assert main(argv) == 0
    capsys.readouterr()
    return pasted / "runs"


@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_a_block_runs_as_pasted(block, pasted, request):
    for name in block.fixtures:
        request.getfixturevalue(name)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(_compile(block), namespace)  # noqa: S102 - the documents' own examples


def test_a_top_level_await_is_refused():
    block = Block("<text>", 1, "python", (), "import trio\nawait trio.sleep(0)\n")
    with pytest.raises(pytest.fail.Exception, match="top-level await"):
        _compile(block)

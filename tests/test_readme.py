"""Every block of README.md works as written (issue 11 item 16).

The ```python blocks of README.md and docs/ run in tests/test_doc_blocks.py, each alone, as
pasted. Each ```bash block parses, and every program, script and repository path it names exists (or is
made by an earlier README command, like `.venv`). The README's test command is the one CI runs.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)(?:[ \t]+[^`]*)?[ \t]*$")  # info: "python fixture:fleet"


@attrs.frozen
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    source: str
    section: str = ""  # the ``## `` heading above it

    @property
    def name(self) -> str:
        return f"README.md:{self.line}"


def code_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, indented ones (in list items) dedented."""
    blocks, lines, i, section = [], text.splitlines(), 0, ""
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        close = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = textwrap.dedent("\n".join(lines[i + 1 : close]))
        blocks.append(Block(opening["lang"], i + 1, body + "\n", section))
        i = close + 1
    return blocks


BLOCKS = code_blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b.lang == "python"]
BASH = [b for b in BLOCKS if b.lang in ("bash", "sh", "shell")]


def test_the_extractor_finds_indented_blocks_their_lines_and_sections():
    found = code_blocks("a\n\n```python\nx = 1\n```\n## B\n- item\n\n  ```bash\n  ls\n  ```\n")
    assert found == [Block("python", 3, "x = 1\n"), Block("bash", 9, "ls\n", "B")]


def test_the_readme_has_blocks_to_check():
    assert len(PYTHON) >= 4 and len(BASH) >= 2


def _commands(script: str) -> list[list[str]]:
    """Simple commands of a shell script: split on newlines, &&, ||, ;, | (comments dropped)."""
    out = []
    for line in script.splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, ";"]:
            if word in ("&&", "||", ";", "|"):
                if command:
                    out.append(command)
                command = []
            else:
                command.append(word)
    return out


def _made_by_the_readme(path: str, script: str) -> bool:
    """A path under a virtualenv that an earlier README command creates."""
    venvs = re.findall(r"-m venv (\S+)", script)
    return any(path == v or path.startswith(v.rstrip("/") + "/") for v in venvs)


_BUILTINS = {".", "source", "cd", "export", "set", "echo"}


@pytest.mark.parametrize("block", BASH, ids=[b.name for b in BASH])
def test_bash_block_parses_and_names_what_exists(block):
    syntax = subprocess.run(["bash", "-n"], input=block.source, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    everything = "\n".join(b.source for b in BASH)
    for argv in _commands(block.source):
        program = argv[0]
        if program in _BUILTINS:
            pass
        elif "/" in program:
            assert (ROOT / program).exists() or _made_by_the_readme(program, everything), argv
        else:
            # The venv running the tests provides rollout-trio and python, activated or not.
            venv_bin = os.path.dirname(sys.executable)
            found = shutil.which(program, path=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]))
            assert found is not None, f"{block.name}: no program {program!r}"
        for arg in argv[1:]:
            if arg.startswith(("-", "/", "$")) or "://" in arg or not (arg.endswith(".py") or "/" in arg):
                continue  # options, URLs, and absolute paths (the reader's own, like /ckpt/base)
            assert (ROOT / arg).exists() or _made_by_the_readme(arg, everything), f"{block.name}: {arg} is missing"


def _test_command() -> str:
    """The README's test command: the bash block that runs pytest on tests/ and props/."""
    found = [b.source.strip() for b in BASH if re.search(r"-m pytest tests props\b", b.source)]
    assert len(found) == 1, found
    return found[0]


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _test_command() in ci


def test_the_test_command_needs_no_activated_virtualenv():
    """A fresh shell has no virtualenv on PATH: the command names the interpreter itself."""
    program = _commands(_test_command())[0][0]
    assert program.startswith(".venv/bin/") and _made_by_the_readme(program, "\n".join(b.source for b in BASH))


def test_ci_installs_torch_as_the_readme_tells_a_newcomer():
    """The README's torch step (PyTorch's CPU index) is the one CI uses, so it is exercised."""
    install = [b.source for b in BASH if "rollout-trio run" in b.source and "-m venv" in b.source]
    assert len(install) == 1, install
    steps = [step.strip() for step in install[0].split("&&")]
    torch_step = next(step for step in steps if '"torch==' in step)
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in torch_step
    ci = (ROOT / ".ci" / "run").read_text()
    assert torch_step in ci, f"{torch_step!r} is not what .ci/run runs"


_UNPUBLISHED = re.compile(r"""pip install[^`\n]*['"]?rollout-trio\[""")


def test_no_document_installs_the_unpublished_package_by_name():
    """rollout-trio is not on PyPI: extras come from the checkout (pip install -e ".[fleet]")."""
    documents = [README, ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for path in documents:
        # join wrapped lines: the command can be broken across two lines of a paragraph
        text = " ".join(path.read_text().split())
        found += [f"{path.relative_to(ROOT)}: {m.group()}" for m in _UNPUBLISHED.finditer(text)]
    assert found == []

"""docs/real_model.md, followed from top to bottom on a checkpoint saved from a config (issue 32 item 6).

A reader of the guide runs its blocks in order in one shell: what a block exports, the
next sees; a server started in a ```` ```bash background ```` block stays up in "another
terminal" until the guide's section ends, when the reader presses Ctrl-C. So does this test:
every block runs as written, with two substitutions a shared CI machine needs, both in
the reader's power: ``$CKPT`` is the checkpoint tests/checkpoint_helpers.py saves (a
Qwen2-architecture one, bfloat16, with a generation config and a chat template: only small),
not a download, and the ports 30000/30001 become free ones.

A block's fence says what it needs:

- ``bash`` and ``python``: run here, in order (Python blocks as ``python -c``, in the shell's
  environment and directory);
- ``bash background``: one long-running command, started, waited on until it says it is ready,
  and interrupted (SIGINT) at the end of its section: it must exit 130 saying what it did;
- ``bash needs:cuda``: runs where CUDA is (servers started and interrupted once ready);
  elsewhere each command must answer at once with the guide's one-line refusal, exit 1;
- ``bash needs:network``: the download; only its syntax is checked, and that it sets ``CKPT``.

The guide's troubleshooting table is checked row by row against what the commands print.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_trio.cli import main

from .checkpoint_helpers import save_qwen2_checkpoint
from .fleet_helpers import Lines
from .test_doc_blocks import Block, code_blocks

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "real_model.md"
BLOCKS = [b for b in code_blocks(GUIDE.read_text(), "docs/real_model.md") if b.lang in ("bash", "python")]
KINDS = {(), ("background",), ("needs:cuda",), ("needs:network",)}
#: what a background command prints once it serves (on stdout)
READY = {"serve": r"listening on (http://\S+) \(model (.*), (\S+ on \S+), (.*)\)$", "fleet": r"^router: (http://\S+) "}
CUDA = torch.cuda.is_available()
DEADLINE = 180.0  # a step's limit: shared CI machines are slow, a real failure is not subtle


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sections(text: str) -> list[str]:
    """The ``## `` heading each line of ``text`` is under ('' before the first)."""
    current, out = "", []
    for line in text.splitlines():
        if line.startswith("## "):
            current = line
        out.append(current)
    return out


SECTION_OF_LINE = _sections(GUIDE.read_text())


def test_every_block_is_one_the_walk_knows_and_the_guide_covers_each_command():
    assert len(BLOCKS) >= 12
    for block in BLOCKS:
        assert block.options in KINDS, f"{block.name}: {block.options}"
        if block.options == ("background",):
            assert len(block.source.strip().splitlines()) == 1, f"{block.name}: one command per background block"
    text = "\n".join(b.source for b in BLOCKS)
    for command in ("rollout-trio run", "rollout-trio serve", "rollout-trio fleet", "LocalEngine.from_pretrained"):
        assert command in text
    cuda = [b.source for b in BLOCKS if b.options == ("needs:cuda",)]
    assert all(re.search(r"--devices? cuda", s) for s in cuda) and len(cuda) >= 3


class Reader:
    """The reader's shell: environment and directory carried from block to block."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd, self.env = cwd, env
        self.background: list[tuple[Block, subprocess.Popen[str], Lines, Lines]] = []

    def bash(self, source: str) -> subprocess.CompletedProcess[str]:
        dump = self.cwd / ".env"
        script = f"set -e -o pipefail\n{source}\nenv -0 > {dump}\n"
        done = subprocess.run(
            ["bash", "-c", script], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=DEADLINE
        )
        if done.returncode == 0:
            self.env = dict(entry.split("=", 1) for entry in dump.read_text().split("\0") if "=" in entry)
        return done

    def python(self, source: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", source], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=DEADLINE
        )

    def start(self, block: Block, source: str) -> re.Match[str]:
        """Start a background block's command; its ready line's match."""
        command = source.strip()
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = Lines(proc.stdout), Lines(proc.stderr)  # type: ignore[arg-type]
        self.background.append((block, proc, out, err))
        which = command.split()[1]
        try:
            return out.expect(READY[which], timeout=DEADLINE)
        except AssertionError as exc:
            raise AssertionError(f"{block.name}: {exc}; stderr: {err.tail()}") from None

    def interrupt_all(self) -> list[tuple[Block, int, list[str]]]:
        """Ctrl-C to every background command, as a reader would; ``(block, status, stderr)`` each."""
        stopped = []
        for block, proc, out, err in reversed(self.background):
            proc.send_signal(signal.SIGINT)
            status = proc.wait(timeout=DEADLINE)
            said = err.tail(20)
            out.close()
            err.close()
            stopped.append((block, status, said))
        self.background.clear()
        return stopped

    def kill_all(self) -> None:
        for _, proc, out, err in self.background:
            proc.kill()
            proc.wait()
            out.close()
            err.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_qwen2_checkpoint(tmp_path_factory.mktemp("models") / "Qwen2-shaped")


def _refused_for_cuda(done: subprocess.CompletedProcess[str], block: Block) -> None:
    """Without CUDA, each command of a needs:cuda block answers at once: one line, exit 1."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, (block.name, done.stderr)
    assert re.search(r"error: --device cuda(:\d+)?: CUDA is not available on this machine", lines[0]), lines


def test_the_guide_runs_from_top_to_bottom(checkpoint, tmp_path):
    ports = {"30000": str(_free_port()), "30001": str(_free_port())}
    venv_bin = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]), PYTHONUNBUFFERED="1")
    env.pop("ROLLOUT_TRIO_API_KEY", None)
    reader = Reader(tmp_path, env)
    seen: dict[str, Any] = {"stopped": []}
    try:
        section = None
        for block in BLOCKS:
            if SECTION_OF_LINE[block.line - 1] != section:  # a new section: Ctrl-C to the last one's servers
                seen["stopped"] += reader.interrupt_all()
                section = SECTION_OF_LINE[block.line - 1]
            source = block.source
            for guide_port, port in ports.items():
                source = source.replace(guide_port, port)
            if block.options == ("needs:network",):
                assert subprocess.run(["bash", "-n"], input=source, text=True).returncode == 0
                assert re.search(r"^export CKPT=", source, re.M), "the download sets the variable the guide uses"
                reader.env["CKPT"] = str(checkpoint)  # what the download would have left there
                continue
            if block.options == ("needs:cuda",):
                for line in filter(None, (ln.split("#")[0].strip() for ln in source.splitlines())):
                    if not CUDA:
                        _refused_for_cuda(reader.bash(line), block)
                    elif re.search(r"rollout-trio (serve|fleet)", line):
                        seen["stopped"] += reader.interrupt_all()  # the CPU one first: the same port
                        reader.start(block, line)
                        reader.interrupt_all()
                    else:
                        done = reader.bash(line)
                        assert done.returncode == 0, (block.name, done.stderr[-2000:])
                continue
            if block.options == ("background",):
                seen[block.source.split()[1]] = reader.start(block, source)
                seen[block.name] = "\n".join(reader.background[-1][2].seen)  # what it printed on stdout
                continue
            done = reader.python(source) if block.lang == "python" else reader.bash(source)
            assert done.returncode == 0, (block.name, done.stdout[-2000:], done.stderr[-2000:])
            seen[block.name] = done.stdout
        seen["stopped"] += reader.interrupt_all()
    finally:
        reader.kill_all()
    outputs = {b.name: seen.get(b.name, "") for b in BLOCKS}

    def output_of(fragment: str) -> str:
        (name,) = [b.name for b in BLOCKS if fragment in b.source and not b.options]
        return str(outputs[name])

    # What each step is for, as the guide says it.
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(output_of('ls "$CKPT"').split())
    ran = output_of("rollout-trio run --model")
    assert "4 groups kept, 0 dropped, 0 failed" in ran and "16 episodes" in ran, ran
    assert (tmp_path / "runs" / "run" / "seed0").is_dir()
    assert "trajectories" in output_of("rollout-trio inspect runs").lower()
    served = seen["serve"]
    assert served[2] == str(checkpoint) and served[3] == "float32 on cpu" and served[4] == "no api key", served.group(0)
    assert f'"model_path":"{checkpoint}"' in output_of("get_model_info").replace(" ", "")
    assert re.fullmatch(r"4 samples, rewards \[(\S+(, )?){4}\]\n", output_of("RemoteEngine([")), output_of("RemoteEngine([")
    assert re.fullmatch(r"2 workers; rewards \[(\S+(, )?){8}\]\n", output_of("RemoteEngine(router=")), output_of("RemoteEngine(router=")
    assert re.fullmatch(r"torch\.Size\(\[4, \d+\]\) torch\.float32 \[.*\]\n", output_of("LocalEngine.from_pretrained(")), output_of("LocalEngine.from_pretrained(")
    # the fleet's lines look like the guide's example of them (ports, pids and the key file aside)
    example = re.search(r"```text\n(.*?)```", GUIDE.read_text(), re.S)[1].strip().splitlines()  # type: ignore[index]
    printed = str(outputs[next(b.name for b in BLOCKS if "rollout-trio fleet" in b.source and b.options == ("background",))])
    assert [_shape(line) for line in printed.splitlines()] == [_shape(line) for line in example], printed
    stopped = {block.source.split()[1]: (status, err) for block, status, err in seen["stopped"] if block.options == ("background",)}
    assert stopped.keys() == {"serve", "fleet"}
    status, err = stopped["serve"]
    counts = [int(m[1]) for line in err if (m := re.search(r"interrupted; served (\d+) generate requests", line))]
    assert status == 130 and counts and counts[0] >= 4, err  # 4 samples, each one request or more (segments)
    status, err = stopped["fleet"]
    assert status == 130 and any("interrupted; stopped router" in line for line in err), err


def _shape(line: str) -> str:
    """A fleet line with its numbers and paths taken out."""
    return re.sub(r"/\S+\.key", "KEY", re.sub(r"\d+", "N", line))


# ------------------------------------------------------------------ the troubleshooting table


def _table_rows() -> list[str]:
    """The first cell of each row of the guide's table (the message, with DIR and ... in it)."""
    text = GUIDE.read_text().split("## When something goes wrong", 1)[1]
    cells = [m.group(1) for m in re.finditer(r"^\| (.+?) \|", text, re.M)]
    return [re.sub(r"^`([^`]+)`$", r"\1", c) for c in cells if c != "the command says" and not c.startswith("---")]


def _pattern(row: str) -> str:
    """A row's message as a regular expression: DIR is a path, ``...`` anything."""
    parts = re.split(r"(DIR|\.\.\.)", row)
    return "".join({"DIR": r"\S+", "...": ".*"}.get(p, re.escape(p)) for p in parts)


def _no_chat_template(tmp: Path) -> list[str]:
    return ["run", "--model", str(save_qwen2_checkpoint(tmp / "base", chat_template=False)), "--groups", "1", "--group-size", "1"]


def _weights_only(tmp: Path) -> list[str]:
    path = save_qwen2_checkpoint(tmp / "full")
    for name in path.iterdir():
        if name.name.startswith(("tokenizer", "chat_template")):
            name.unlink()
    return ["serve", "--model", str(path), "--port", "0"]


def _broken_weights(tmp: Path) -> list[str]:
    path = save_qwen2_checkpoint(tmp / "partial")
    (path / "model.safetensors").write_bytes(b"\0" * 64)  # a download cut short
    return ["run", "--model", str(path), "--groups", "1", "--group-size", "1"]


def _too_large(tmp: Path) -> list[str]:
    return ["serve", "--model", str(save_qwen2_checkpoint(tmp / "large")), "--port", "0", "--device", "cuda:0"]


def _as_on_a_full_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU that is there but full: the loader raises torch's own error, as from_pretrained
    does when the weights do not fit (no device here runs out, so it is patched in)."""
    import rollout_trio.models
    from rollout_trio.cli import _checkpoint

    def too_large(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 7.6 GiB total)")

    monkeypatch.setattr(_checkpoint, "resolve_device", lambda requested: requested)
    monkeypatch.setattr(rollout_trio.models, "load_model", too_large)


#: how to make each row happen: (argv, CUDA devices the driver reports)
SITUATIONS = {
    "--model DIR: no such checkpoint directory": (lambda tmp: ["run", "--model", str(tmp / "missing")], None),
    "--model DIR: no tokenizer in it (...)": (_weights_only, None),
    "--model DIR: cannot load a model and tokenizer from it: ...": (_broken_weights, None),
    "--model DIR: its tokenizer has no chat template, and the task's prompts are chat messages": (_no_chat_template, None),
    "--device cuda: CUDA is not available on this machine": (lambda tmp: ["run", "--device", "cuda"], 0),
    "--device cuda:2: this machine has 2 CUDA device(s), cuda:0 to cuda:1": (lambda tmp: ["serve", "--device", "cuda:2"], 2),
    "--model DIR: does not fit on cuda:0: CUDA out of memory. ...": (_too_large, 1),
}
#: what a row's situation needs patched in besides the devices
PATCHED = {"--model DIR: does not fit on cuda:0: CUDA out of memory. ...": _as_on_a_full_gpu}
#: rows no test here can make happen, and why
NOT_REPRODUCED = {
    "Task N: workflow failed; the task is counted as failed: OutOfMemoryError: CUDA out of memory. ...": (
        "needs a GPU whose memory a batch's KV cache exceeds; the line's form is tests/test_cli.py's "
        "test_a_failed_episode_s_line_says_why"
    )
}


def test_the_table_lists_what_the_tests_reproduce():
    assert set(_table_rows()) == set(SITUATIONS) | set(NOT_REPRODUCED)


@pytest.mark.parametrize("row", sorted(SITUATIONS))
def test_each_row_of_the_table_is_what_the_command_prints(row, tmp_path, capsys, monkeypatch):
    from rollout_trio.cli import _checkpoint

    make, devices = SITUATIONS[row]
    if devices is not None:  # the driver's answer, as a machine with that many GPUs gives it
        monkeypatch.setattr(_checkpoint, "_torch_lib_files", lambda: ["libtorch_cuda.so"])
        monkeypatch.setattr(_checkpoint.sys, "platform", "linux")
        monkeypatch.setattr(_checkpoint, "_cuda_device_count", lambda: devices)
    if row in PATCHED:
        PATCHED[row](monkeypatch)
    argv = make(tmp_path)
    capsys.readouterr()  # what saving the checkpoint printed
    assert main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"rollout-trio \w+: error: {_pattern(row)}", lines[0]), (row, lines)

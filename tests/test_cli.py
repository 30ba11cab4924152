"""The command line's manners (DESIGN turn 2, issue 11 items 13 and 15).

Usage errors: one line on stderr, exit 2. Runtime failures: one line, exit 1, a traceback
only with --debug. Ctrl-C: what finished is printed, exit 130. Every flag of every command
is tried with a bad value; the flags are read from the parsers, so a new flag without a
case here fails ``test_every_flag_has_a_bad_value_case``.
"""

import argparse
import importlib
import json
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
import trio

from rollout_trio.cli import COMMANDS, main
from rollout_trio.cli._checkpoint import resolve_device
from rollout_trio.cli._common import (
    CommandError,
    Parser,
    describe_exception,
    interruptible,
    log_level,
    port,
    run_command,
)

from . import warm_cli
from .warm_cli import WarmPopen

#: command -> long flag -> (argv that gives it a bad value, exit status, what stderr must say)
BAD: dict[str, dict[str, tuple[list[str], int, str]]] = {
    "run": {
        "--debug": (["--debug=yes"], 2, "--debug: ignored explicit argument 'yes'"),
        "--task": (["--task", "poetry"], 2, "--task: invalid choice: 'poetry'"),
        "--groups": (["--groups", "0"], 2, "--groups: must be an integer >= 1, got '0'"),
        "--group-size": (["--group-size", "two"], 2, "--group-size: must be an integer >= 1, got 'two'"),
        "--concurrency": (["--concurrency", "-3"], 2, "--concurrency: must be an integer >= 1"),
        "--consumer-batch-size": (["--consumer-batch-size", "0"], 2, "--consumer-batch-size: must be an integer >= 1"),
        "--max-head-offpolicyness": (["--max-head-offpolicyness", "-1"], 2, "must be an integer >= 0, got '-1'"),
        "--model": (["--model", "/nonexistent"], 1, "--model /nonexistent: no such checkpoint directory"),
        "--device": (["--device", "bogus"], 2, "--device: must be cpu, cuda, cuda:N or mps, got 'bogus'"),
        "--dtype": (["--dtype", "int8"], 2, "--dtype: invalid choice: 'int8'"),
        "--temperature": (["--temperature", "-1"], 2, "--temperature: must be a finite number >= 0"),
        "--max-new-tokens": (["--max-new-tokens", "0"], 2, "--max-new-tokens: must be an integer >= 1"),
        "--reward-normalization": (["--reward-normalization", "--group-size", "1"], 2, "needs --group-size >= 2"),
        "--metrics-port": (["--metrics-port", "70000"], 2, "--metrics-port: must be a port number 0-65535"),
        "--trace": (["--trace", "/nonexistent/trace.json"], 1, "--trace /nonexistent/trace.json: no such directory"),
        "--areal-compat": (["--areal-compat", "/nonexistent"], 1, "--areal-compat /nonexistent: no /nonexistent/areal/workflow/rlvr.py"),
        "--seed": (["--seed", "-1"], 2, "--seed: must be an integer >= 0"),
        "--episode-timeout": (["--episode-timeout", "inf"], 2, "--episode-timeout: must be a finite number > 0"),
        "--timeout": (["--timeout", "-1"], 2, "--timeout: must be a finite number > 0"),
        "--dump": (["--dump", "/dev/null/dumps"], 1, "--dump /dev/null/dumps: cannot create the directory: Not a directory"),
        "--no-progress": (["--no-progress=1"], 2, "--progress/--no-progress: ignored explicit argument '1'"),
    },
    "serve": {
        "--debug": (["--debug=1"], 2, "--debug: ignored explicit argument '1'"),
        "--host": (["--port", "0", "--host", "256.1.1.1", "--allow-unauthenticated"], 1, "--host 256.1.1.1 --port 0: cannot listen"),
        "--api-key": (["--api-key", " "], 2, "--api-key: must be a non-empty string"),
        "--allow-unauthenticated": (["--allow-unauthenticated=yes"], 2, "ignored explicit argument 'yes'"),
        "--port": (["--port", "65536"], 2, "--port: must be a port number 0-65535"),
        "--port-file": (["--port", "0", "--port-file", "/nonexistent/dir/port"], 1, "/nonexistent/dir/port"),
        "--model": (["--model", "/nonexistent"], 1, "--model /nonexistent: no such checkpoint directory"),
        "--device": (["--device", "cuda:x"], 2, "--device: must be cpu, cuda, cuda:N or mps, got 'cuda:x'"),
        "--dtype": (["--dtype", "float64"], 2, "--dtype: invalid choice: 'float64'"),
        "--seed": (["--seed", "1.5"], 2, "--seed: must be an integer >= 0, got '1.5'"),
        "--segment-tokens": (["--segment-tokens", "0"], 2, "--segment-tokens: must be an integer >= 1"),
        "--step-delay": (["--step-delay", "nan"], 2, "--step-delay: must be a finite number >= 0, got 'nan'"),
        "--max-batch-size": (["--max-batch-size", "0"], 2, "--max-batch-size: must be an integer >= 1"),
        "--threads": (["--threads", "0"], 2, "--threads: must be an integer >= 1"),
        "--max-body-bytes": (["--max-body-bytes", "0"], 2, "--max-body-bytes: must be an integer >= 1"),
        "--read-deadline": (["--read-deadline", "0"], 2, "--read-deadline: must be a finite number > 0"),
        "--keep-alive-timeout": (["--keep-alive-timeout", "-1"], 2, "--keep-alive-timeout: must be a finite number > 0"),
        "--max-connections": (["--max-connections", "0"], 2, "--max-connections: must be an integer >= 1"),
        "--graceful-timeout": (["--graceful-timeout", "nan"], 2, "--graceful-timeout: must be a finite number > 0"),
        "--log-level": (["--log-level", "bogus"], 2, "--log-level: must be one of DEBUG, INFO, WARNING"),
    },
    "fleet": {
        "--debug": (["--debug=1"], 2, "--debug: ignored explicit argument '1'"),
        "--workers": (["--workers", "0"], 2, "--workers: must be an integer >= 1, got '0'"),
        "--port": (["--port", "-1"], 2, "--port: must be a port number 0-65535"),
        "--policy": (["--policy", "manual"], 2, "--policy: invalid choice: 'manual'"),
        "--devices": (["--devices", "cuda:0,gpu"], 2, "--devices: must be cpu, cuda, cuda:N or mps, got 'gpu'"),
        "--startup-timeout": (["--startup-timeout", "0"], 2, "--startup-timeout: must be a finite number > 0"),
        "--stop-timeout": (["--stop-timeout", "inf"], 2, "--stop-timeout: must be a finite number > 0"),
        "--health-interval": (["--health-interval", "0.5"], 2, "--health-interval: must be an integer >= 1"),
        "--router-log-level": (["--router-log-level", "loud"], 2, "--router-log-level: invalid choice: 'loud'"),
        "--ray": (["--ray", "head"], 2, "--ray: must be 'auto', 'ray://HOST:PORT' or HOST:PORT, got 'head'"),
        "--ray-num-cpus": (["--ray-num-cpus", "-1"], 2, "--ray-num-cpus: must be a finite number >= 0"),
        "--ray-num-gpus": (["--ray-num-gpus", "inf"], 2, "--ray-num-gpus: must be a finite number >= 0"),
        "--key-file": (["--key-file", "/nonexistent/k"], 2, "--key-file: must be a file path in an existing directory"),
        "--api-key": (["--api-key", "short"], 2, "--api-key: must be 16-256 characters"),
        "--no-api-key": (["--no-api-key=1"], 2, "--no-api-key: ignored explicit argument '1'"),
    },
    # {dump} is a small real dump (the `dump` fixture)
    "inspect": {
        "DUMP_DIR": (["/nonexistent"], 1, "error: dump path '/nonexistent' does not exist"),
        "--debug": (["{dump}", "--debug=1"], 2, "--debug: ignored explicit argument '1'"),
        "--html": (["{dump}", "--html", "/nonexistent/dir/out.html"], 1, "'/nonexistent/dir/out.html'"),
        "--samples": (["{dump}", "--samples", "0"], 2, "--samples: must be an integer >= 1, got '0'"),
        "--bins": (["{dump}", "--bins", "x"], 2, "--bins: must be an integer >= 1, got 'x'"),
        "--max-line-bytes": (["{dump}", "--max-line-bytes", "0"], 2, "--max-line-bytes: must be an integer >= 1, got '0'"),
        "--tokenizer": (["{dump}", "--tokenizer", "/nonexistent"], 1, "--tokenizer /nonexistent: no such tokenizer"),
    },
    "replay": {
        "DUMP_DIR": (["/nonexistent"], 1, "error: dump path '/nonexistent' does not exist"),
        "--debug": (["{dump}", "--debug=1"], 2, "--debug: ignored explicit argument '1'"),
        "--workflow": (["{dump}", "--workflow", "no_colon"], 2, "--workflow: must be MODULE:NAME"),
        "--data": (["{dump}", "--data", "/nonexistent.jsonl"], 1, "'/nonexistent.jsonl'"),
        "--seed": (["{dump}", "--seed", "-1"], 2, "--seed: must be an integer >= 0, got '-1'"),
        "--task": (["{dump}", "--task", "x"], 2, "--task: must be an integer >= 0, got 'x'"),
        "--tokenizer": (["{dump}", "--tokenizer", "/nonexistent"], 1, "--tokenizer /nonexistent: no such tokenizer"),
        "--max-new-tokens": (["{dump}", "--max-new-tokens", "0"], 2, "--max-new-tokens: must be an integer >= 1"),
    },
    "top": {
        "ADDRESS": (["/nonexistent/dump"], 1, "/nonexistent/dump: no such dump directory"),
        "--debug": (["127.0.0.1:1", "--debug=1"], 2, "--debug: ignored explicit argument '1'"),
        "--interval": (["127.0.0.1:1", "--interval", "0"], 2, "--interval: must be a finite number > 0"),
        "--once": (["127.0.0.1:1", "--once=1"], 2, "--once: ignored explicit argument '1'"),
        "--timeout": (["127.0.0.1:1", "--timeout", "0"], 2, "--timeout: must be a finite number > 0, got '0'"),
        "--api-key": (["127.0.0.1:1", "--once", "--api-key", "k"], 1, "127.0.0.1:1/metrics: cannot scrape"),
    },
}


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    from tests.dump_helpers import write_dump_sync

    root = tmp_path_factory.mktemp("dump")
    write_dump_sync(root, groups=2, group_size=2, versions=1)
    return str(root)


def parser_of(command: str) -> argparse.ArgumentParser:
    module, _, _ = COMMANDS[command]
    return importlib.import_module(module, "rollout_trio.cli")._parser()


def long_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Each option's long flag, and each positional argument's name (its metavar or dest)."""
    return {
        max(action.option_strings, key=len) if action.option_strings else str(action.metavar or action.dest)
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction)
    }


def test_every_command_is_covered():
    assert set(BAD) == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_a_bad_value_case(command):
    assert long_flags(parser_of(command)) == set(BAD[command])


#: An error line that starts with an exception's type name.
TYPE_PREFIX = re.compile(r"rollout-trio \w+: error: (\[Errno \d+\] |[A-Z]\w*(Error|Exception): )")

CASES = [(command, flag, *case) for command, flags in BAD.items() for flag, case in flags.items()]


@pytest.mark.parametrize(("command", "flag", "argv", "status", "says"), CASES, ids=[f"{c[0]} {c[1]}" for c in CASES])
def test_a_bad_value_is_one_line_and_the_right_status(capsys, request, command, flag, argv, status, says):
    if "{dump}" in argv:
        argv = [request.getfixturevalue("dump") if arg == "{dump}" else arg for arg in argv]
    assert main([command, *argv]) == status
    out, err = capsys.readouterr()
    assert not flag.startswith("-") or any(arg.split("=")[0] == flag for arg in argv)  # it tries this flag
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"rollout-trio {command}: error: ") and says in lines[0], err
    assert not TYPE_PREFIX.match(lines[0]), err  # the message says it; "FileNotFoundError:" is noise
    if status == 2:
        assert lines[0].endswith(f"(see rollout-trio {command} --help)")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_shows_its_default_in_plain_text(capsys, command):
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert "``" not in text
    entries = re.split(r"\n  (?=-)", text.split("options:\n", 1)[1])  # one per option
    options = [a for a in parser_of(command)._actions if a.option_strings]
    assert len(entries) == len(options)
    for entry in entries:
        if not entry.lstrip().startswith("-h, --help"):
            assert "(default" in " ".join(entry.split()), entry


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_shows_its_default_once(capsys, command):
    assert main([command, "--help"]) == 0
    entries = re.split(r"\n  (?=-)", capsys.readouterr().out.split("options:\n", 1)[1])
    for entry in entries:
        if not entry.lstrip().startswith("-h, --help"):
            assert " ".join(entry.split()).count("default:") == 1, entry


def test_help_and_version_import_neither_torch_nor_transformers():
    """--help and --version answer at once: the heavy imports wait until a command runs."""
    code = (
        "import contextlib, io, json, sys\n"
        "from rollout_trio.cli import COMMANDS, main\n"
        "loaded = {}\n"
        "for argv in [['--help'], ['--version'], *([c, '--help'] for c in COMMANDS), *([c, '--version'] for c in COMMANDS)]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        main(argv)\n"
        "    loaded[' '.join(argv)] = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(json.dumps(loaded))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert len(loaded) == 2 + 2 * len(COMMANDS)
    assert {argv: mods for argv, mods in loaded.items() if mods} == {}


def test_top_level_help_lists_every_command_with_its_description(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, _, text) in COMMANDS.items():
        assert re.search(rf"^  {name}\s+{re.escape(text)}$", out, re.M), out


def test_version(capsys):
    from rollout_trio import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"rollout-trio {__version__}\n"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "a command is required: run, serve"),
        (["rnu"], "unknown command 'rnu'; did you mean 'run'?"),
        (["zzz"], "unknown command 'zzz'; the commands are run, serve"),
        (["--bogus"], "unknown option '--bogus' before the command"),
        (["run", "--bogus"], "unrecognized arguments: --bogus"),
        (["run", "--groups"], "--groups: expected one argument"),
    ],
)
def test_top_level_usage_errors_are_one_line(capsys, argv, says):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err, err


def test_argument_types_apply_the_library_rules():
    assert log_level("info") == "INFO"
    assert port("0") == 0 and port("65535") == 65535
    for bad in ("-1", "65536", "80.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="0-65535"):
            port(bad)


def test_run_and_serve_choose_the_device_the_same_way():
    run, serve = (next(a for a in parser_of(c)._actions if "--device" in a.option_strings) for c in ("run", "serve"))
    assert (run.type, run.default, run.help) == (serve.type, serve.default, serve.help)
    sources = [importlib.import_module(COMMANDS[c][0], "rollout_trio.cli").__dict__ for c in ("run", "serve")]
    assert all("load_model_and_tokenizer" in names for names in sources)


@pytest.mark.parametrize(
    ("gpus", "requested", "chosen"),
    [(0, None, "cpu"), (2, None, "cuda"), (2, "cuda:1", "cuda:1"), (0, "cpu", "cpu"), (2, "cpu", "cpu")],
)
def test_resolve_device_picks_cuda_when_present_and_keeps_what_exists(monkeypatch, gpus, requested, chosen):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert resolve_device(requested) == chosen


@pytest.mark.parametrize(
    ("gpus", "requested", "says"),
    [
        (0, "cuda", "--device cuda: CUDA is not available on this machine"),
        (2, "cuda:2", "--device cuda:2: this machine has 2 CUDA device(s), cuda:0 to cuda:1"),
    ],
)
def test_resolve_device_refuses_what_is_missing(monkeypatch, gpus, requested, says):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(CommandError) as caught:
        resolve_device(requested)
    assert str(caught.value) == says


def test_exception_groups_are_summarized_in_one_line():
    inner = ValueError("bad\nreward")
    inner.add_note("rollout_trio: raised in slot 3 of a group of 8")
    group = ExceptionGroup("outer", [ExceptionGroup("inner", [inner]), TimeoutError()])
    text = describe_exception(group)
    assert "\n" not in text
    assert text == "2 failures; the first: ValueError: bad reward (rollout_trio: raised in slot 3 of a group of 8)"
    assert describe_exception(ExceptionGroup("one", [KeyError("k")])) == "KeyError: 'k'"


def test_interruptible_turns_ctrl_c_into_a_cancelled_block_and_keeps_what_finished(capsys):
    finished = []

    async def main():
        async with interruptible("stopping") as interrupt:
            finished.append("first")
            signal.raise_signal(signal.SIGINT)  # delivered to the block's watcher, not as KeyboardInterrupt
            await trio.sleep_forever()  # cancelled by the interrupt
        return interrupt.received

    assert trio.run(main) is True
    assert finished == ["first"] and capsys.readouterr().err == "interrupted: stopping\n"


def test_interruptible_without_ctrl_c_changes_nothing():
    async def main():
        async with interruptible() as interrupt:
            await trio.sleep(0)
        return interrupt.received

    assert trio.run(main) is False


def test_run_command_maps_ctrl_c_to_130_and_failures_to_one_line(capsys):
    parser = Parser("prog", "a test command")

    def interrupted(args):
        raise KeyboardInterrupt

    def failing(args):
        raise ExceptionGroup("two", [ValueError("first\nline"), OSError("second")])

    assert run_command("prog", parser, [], interrupted) == 130
    assert capsys.readouterr().err == "prog: interrupted\n"
    assert run_command("prog", parser, [], failing) == 1
    assert capsys.readouterr().err == "prog: error: 2 failures; the first: ValueError: first line\n"
    assert run_command("prog", parser, ["--debug"], failing) == 1
    err = capsys.readouterr().err
    assert err.startswith("  + Exception Group Traceback") and err.endswith("the first: ValueError: first line\n")


# ------------------------------------------------------------------ as a real process


def rollout_trio(*argv, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "rollout_trio", *argv], capture_output=True, text=True, timeout=timeout
    )


def test_an_unavailable_device_is_one_line_exit_1_and_a_traceback_only_with_debug():
    # cuda:99 exists on no machine (with or without a GPU)
    plain = rollout_trio("run", "--device", "cuda:99")
    assert plain.returncode == 1, plain.stderr
    assert len(plain.stderr.strip().splitlines()) == 1 and "Traceback" not in plain.stderr
    assert plain.stderr.startswith("rollout-trio run: error: --device cuda:99: ")
    debug = rollout_trio("run", "--device", "cuda:99", "--debug")
    assert debug.returncode == 1
    assert debug.stderr.startswith("Traceback (most recent call last):")
    assert debug.stderr.strip().splitlines()[-1] == plain.stderr.strip()


def test_a_usage_error_exits_2_from_a_real_process():
    proc = rollout_trio("serve", "--segment-tokens", "0")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "--segment-tokens: must be an integer >= 1" in proc.stderr


async def _interrupt_once(argv, progress: re.Pattern[bytes], *, on_stdout=False, before_interrupt=None, signum=signal.SIGINT):
    """Start ``rollout-trio *argv``; once stderr (or stdout) matches ``progress``, await
    ``before_interrupt(match)`` if given, then send SIGINT; return (exit status, stdout, stderr).
    The process is forked from the warm CLI (tests/warm_cli.py); its pipes are read as Trio streams."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = WarmPopen([sys.executable, "-m", "rollout_trio", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    stdout, stderr = trio.lowlevel.FdStream(os.dup(proc.stdout.fileno())), trio.lowlevel.FdStream(os.dup(proc.stderr.fileno()))
    proc.stdout.close(), proc.stderr.close()
    out, err = bytearray(), bytearray()

    async def drain(stream, into):
        async for chunk in stream:
            into += chunk

    try:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                (watched, seen), (other, rest) = ((stderr, err), (stdout, out))[:: -1 if on_stdout else 1]
                nursery.start_soon(drain, other, rest)
                while (match := progress.search(seen)) is None:
                    chunk = await watched.receive_some()
                    assert chunk, f"exited before progress showed: {err.decode()}"
                    seen += chunk
                if before_interrupt is not None:
                    await before_interrupt(match)
                proc.send_signal(signum)
                nursery.start_soon(drain, watched, seen)
                await trio.to_thread.run_sync(proc.wait, abandon_on_cancel=True)
    finally:
        if proc.poll() is None:
            proc.kill()
            await trio.to_thread.run_sync(proc.wait)
        await stdout.aclose()
        await stderr.aclose()
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("level", ["INFO", None])
async def test_serve_logs_requests_at_info_and_exits_130_on_ctrl_c(level):
    async def request_health(match):
        async with httpx.AsyncClient() as client:
            assert (await client.get(match[1].decode() + "/health")).status_code == 200

    argv = ["serve", "--port", "0", *(["--log-level", level] if level else [])]
    rc, out, err = await _interrupt_once(
        argv, re.compile(rb"listening on (http://\S+)"), on_stdout=True, before_interrupt=request_health
    )
    assert rc == 130 and "Traceback" not in err, err
    logged = re.search(r"INFO .*GET /health.* 200\b", err)
    assert (logged is not None) == (level == "INFO"), err
    assert re.search(r"^rollout-trio serve: interrupted; served 0 generate requests, 0 output tokens over \d+\.\d s$", err, re.M), err


@pytest.mark.parametrize(("signum", "status", "how"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 0, "terminated")])
async def test_serve_says_what_it_served_when_stopped(signum, status, how):
    tokens = []

    async def generate(match):
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}
        async with httpx.AsyncClient(timeout=60) as client:
            for _ in range(2):
                answer = await client.post(match[1].decode() + "/generate", json=body)
                assert answer.status_code == 200, answer.text
                tokens.append(len(answer.json()["output_ids"]))

    rc, _, err = await _interrupt_once(
        ["serve", "--port", "0"], re.compile(rb"listening on (http://\S+)"), on_stdout=True,
        before_interrupt=generate, signum=signum,
    )  # fmt: skip
    assert rc == status, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"rollout-trio serve: {how}; served 2 generate requests \(2 finished\), {sum(tokens)} output tokens over \d+\.\d s", last
    ), err


# ------------------------------------------------------------------ answers before torch loads (issue 32 item 5)

#: argv -> (exit status, what the one line says); each is known without torch, so it is
#: reported before torch is imported (importing torch takes seconds; a loaded machine, 10+)
BEFORE_TORCH = {
    ("run", "--model", "/nonexistent"): (1, "--model /nonexistent: no such checkpoint directory"),
    ("run", "--device", "cuda:99"): (1, "--device cuda:99: "),  # cuda:99 exists on no machine
    ("run", "--device", "mps"): (1, "--device mps: MPS is not available on this machine"),
    ("serve", "--model", "/nonexistent"): (1, "--model /nonexistent: no such checkpoint directory"),
    ("serve", "--device", "cuda:99"): (1, "--device cuda:99: "),
    ("fleet", "--model", "/nonexistent"): (1, "--model /nonexistent: no such checkpoint directory"),
    ("fleet", "--device", "cuda:99"): (1, "--device cuda:99: "),
    ("inspect", "/nonexistent"): (1, "dump path '/nonexistent' does not exist"),
    ("replay", "/nonexistent"): (1, "dump path '/nonexistent' does not exist"),
    ("top", "/nonexistent/dump"): (1, "/nonexistent/dump: no such dump directory"),
    ("run", "--groups", "0"): (2, "--groups: must be an integer >= 1"),
    ("serve", "--host", "0.0.0.0"): (2, "refusing to bind 0.0.0.0 without an api key"),
    ("fleet", "--segment-tokens", "0"): (2, "--segment-tokens: must be an integer >= 1"),
    # issue 31: every command's unknown flag, and a missing argument, answer before torch too
    ("run", "--bogus"): (2, "unrecognized arguments: --bogus"),
    ("serve", "--bogus"): (2, "unrecognized arguments: --bogus"),
    ("fleet", "--bogus"): (2, "unrecognized arguments: --bogus"),
    ("inspect", "/tmp", "--bogus"): (2, "unrecognized arguments: --bogus"),
    ("replay", "/tmp", "--bogus"): (2, "unrecognized arguments: --bogus"),
    ("top", "/tmp", "--bogus"): (2, "unrecognized arguments: --bogus"),
    ("inspect",): (2, "the following arguments are required: DUMP_DIR"),
    ("top",): (2, "the following arguments are required: ADDRESS"),
}


@pytest.mark.skipif(sys.platform == "darwin", reason="mps may exist there")
def test_usage_errors_missing_paths_and_missing_devices_are_reported_before_torch_is_imported():
    code = (
        "import contextlib, io, json, sys\n"
        "from rollout_trio.cli import main\n"
        "said = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        status = main(argv)\n"
        "    said.append([status, err.getvalue(), sorted(m for m in ('torch', 'transformers') if m in sys.modules)])\n"
        "print(json.dumps(said))\n"
    )
    cases = list(BEFORE_TORCH)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for argv, (status, err, loaded) in zip(cases, json.loads(proc.stdout), strict=True):
        want_status, says = BEFORE_TORCH[argv]
        assert (status, loaded) == (want_status, []), (argv, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"rollout-trio {argv[0]}: error: ") and says in lines[0], (argv, err)
        assert not TYPE_PREFIX.match(lines[0]), err


def test_a_device_torch_can_use_passes_the_early_check(monkeypatch):
    from rollout_trio.cli import _checkpoint

    _checkpoint.check_device(None)
    _checkpoint.check_device("cpu")
    monkeypatch.setattr(_checkpoint, "_torch_lib_files", lambda: ["libtorch_cuda.so", "libc10_cuda.so"])
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(_checkpoint, "_cuda_device_count", lambda: 2)
    _checkpoint.check_device("cuda")
    _checkpoint.check_device("cuda:1")
    with pytest.raises(CommandError, match=r"^--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0 to cuda:1$"):
        _checkpoint.check_device("cuda:2")
    monkeypatch.setattr(_checkpoint, "_cuda_device_count", lambda: 0)
    with pytest.raises(CommandError, match="^--device cuda: CUDA is not available on this machine$"):
        _checkpoint.check_device("cuda")
    monkeypatch.setattr(_checkpoint, "_torch_lib_files", lambda: ["libtorch_hip.so"])  # ROCm: torch decides later
    _checkpoint.check_device("cuda")
    monkeypatch.setattr(_checkpoint, "_torch_lib_files", lambda: ["libtorch_cpu.so"])
    with pytest.raises(CommandError, match="this torch is built without CUDA"):
        _checkpoint.check_device("cuda")


# ------------------------------------------------------------------ error lines without type prefixes


def _raised(exc):
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001
        return caught


def test_an_error_written_for_users_has_no_type_prefix():
    from rollout_trio.executor import read_dump

    try:
        read_dump("/nonexistent")  # the library's FileNotFoundError
    except FileNotFoundError as exc:
        missing = exc
    assert describe_exception(missing) == "dump path '/nonexistent' does not exist"
    assert describe_exception(_raised(FileNotFoundError(2, "No such file or directory", "/x"))) == (
        "No such file or directory: '/x'"
    )
    assert describe_exception(_raised(PermissionError(13, "Permission denied"))) == "Permission denied"
    from rollout_trio import WorkflowContractError

    assert describe_exception(WorkflowContractError("slot 2: rewards must be floating")) == "slot 2: rewards must be floating"


def test_an_error_that_is_not_written_for_users_keeps_its_type():
    assert describe_exception(_raised(KeyError("k"))) == "KeyError: 'k'"
    assert describe_exception(_raised(ValueError("a user's workflow said so"))) == "ValueError: a user's workflow said so"
    assert describe_exception(_raised(AttributeError("x"))) == "AttributeError: x"
    assert describe_exception(_raised(TimeoutError())) == "TimeoutError"


def test_the_console_script_leaves_at_once_but_runs_atexit_and_flushes_a_pipe():
    """Once torch is loaded the process leaves with os._exit (its module teardown takes
    seconds); what the normal exit does that matters still happens."""
    code = (
        "import atexit, sys, torch\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "sys.argv = ['rollout-trio', 'top', '/nonexistent/dump']\n"
        "print('buffered, not flushed', end='')\n"
        "from rollout_trio.cli import console_main\n"
        "console_main()\n"
        "print('never reached')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout == "buffered, not flushedatexit ran\n"
    assert proc.stderr == "rollout-trio top: error: /nonexistent/dump: no such dump directory\n"
    light = subprocess.run(  # without torch: the ordinary exit (SystemExit)
        [sys.executable, "-c", "import sys; sys.argv = ['rollout-trio', '--version']\n"
         "from rollout_trio.cli import console_main\ntry:\n    console_main()\nexcept SystemExit as e:\n    print('exit', e.code)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert light.stdout.endswith("\nexit 0\n"), light.stdout + light.stderr


@pytest.mark.parametrize("module", ["rollout_trio", "rollout_trio.cli"])
def test_python_m_runs_the_command_and_a_bad_flag_is_its_one_usage_line(module):
    """Issue 31: ``python -m rollout_trio.cli`` is the command too (it was 'cannot be directly executed')."""
    version = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    from rollout_trio import __version__

    assert (version.returncode, version.stdout) == (0, f"rollout-trio {__version__}\n"), version.stderr
    bad = subprocess.run([sys.executable, "-m", module, "top", "/tmp", "--bogus"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == ["rollout-trio top: error: unrecognized arguments: --bogus (see rollout-trio top --help)"]


def test_a_bad_flag_imports_neither_trio_nor_httpx_nor_torch():
    """Issue 31: a usage error is argparse's work only; the event loop and the HTTP client wait for a command that runs."""
    code = (
        "import contextlib, io, json, sys\n"
        "from rollout_trio.cli import COMMANDS, main\n"
        "said = {}\n"
        "for command in COMMANDS:\n"
        "    argv = [command, *(['/tmp'] if command in ('inspect', 'replay', 'top') else []), '--bogus']\n"
        "    with contextlib.redirect_stderr(io.StringIO()):\n"
        "        status = main(argv)\n"
        "    said[command] = [status, sorted(m for m in ('torch', 'transformers', 'trio', 'httpx') if m in sys.modules)]\n"
        "print(json.dumps(said))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {command: [2, []] for command in COMMANDS}


def test_a_failed_episode_s_line_says_why():
    """`run` on a workflow that raises: each failed group's one line ends with the cause (a
    reward function's error, an out-of-memory), where it said only 'workflow failed'. Both
    slots of a group may fail before one cancels the other: then the line counts them."""
    code = (
        "import sys, rollout_trio.workflows as w\n"
        "def broken_reward(text, data):\n"
        "    raise RuntimeError('the reward server said 503')\n"
        "w.arithmetic_reward = broken_reward\n"
        "from rollout_trio.cli import main\n"
        "sys.exit(main(['run', '--groups', '2', '--group-size', '2', '--no-progress']))\n"
    )
    done = warm_cli.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    failed = sorted(line for line in done.stderr.splitlines() if "workflow failed" in line)
    said = (
        r"rollout-trio run: error: Task {}: workflow failed; the task is counted as failed: "
        r"(?:2 failures; the first: )?RuntimeError: the reward server said 503 \(rollout_trio: raised in slot [01] of a group of 2\)"
    )
    assert len(failed) == 2 and all(re.fullmatch(said.format(i), line) for i, line in enumerate(failed)), done.stderr
    assert "Traceback" not in done.stderr
    debug = warm_cli.run([sys.executable, "-c", code.replace("'--no-progress'", "'--no-progress', '--debug'")],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert debug.returncode == 0, debug.stderr
    assert debug.stderr.count("Traceback (most recent call last)") >= 2 and "in broken_reward" in debug.stderr, debug.stderr

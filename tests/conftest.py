import importlib.util
import logging
import signal

import pytest
import torch

# Bitwise-repeatable CPU arithmetic in every test process.
torch.set_num_threads(1)

# A suite started in the background of a script (`pytest … &`) inherits Ctrl-C ignored, and
# so would every program the tests start and then interrupt: the tests check what a Ctrl-C
# from a terminal does, so the processes they start get the default (a handled signal is
# reset to the default on exec; an ignored one stays ignored).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A skip's reason survives pytest-trio (tests/skip_reasons.py).
from .skip_reasons import pytest_pyfunc_call  # noqa: F401

@pytest.fixture(autouse=True)
def _root_logger_as_found():  # type: ignore[no-untyped-def]
    """A test that configures logging in process (``main(["serve", ...])`` runs
    ``logging.basicConfig(force=True)`` on the test's captured stderr) leaves the root logger
    as it found it. A handler left on a capture that has since closed turned every later
    record of that worker into a printed "Logging error" traceback: 184 of them, one per
    refused connection, held the event loop long enough that test_hostile_observers' 503s
    missed their 1 s send deadline. pytest's own capture handlers come and go by themselves."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if handler not in before and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    root.setLevel(level)


# One real vLLM server per test session for the live modules (started only when one asks).
from .vllm_server import vllm_checkpoints, vllm_server, vllm_url, vllm_vision_url  # noqa: F401


# Under pytest-xdist (the README's test command runs -n 4), each module of tests/ runs on one
# worker, so its module-scoped servers and clusters start once, and the live vLLM modules
# share a worker and so the session's one server; props/ is spread test by test. (A scheduler
# of our own: xdist's loadgroup marks do not reach its scheduler under pytest 9.2.)
LIVE_VLLM_MODULES = {"tests/test_vllm_live.py", "tests/test_vllm_group_props.py"}


def _scope(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    if module.startswith("props/"):
        return nodeid
    return "vllm" if module in LIVE_VLLM_MODULES else module


# The longest scopes start first, so that none of them is the run's tail.
LONGEST_FIRST = [
    "tests/test_ray_fleet.py", *sorted(LIVE_VLLM_MODULES), "tests/test_vllm_vision_live.py", "tests/test_fleet_router.py", "tests/test_hostile_http.py",
    "tests/test_areal_compat.py", "tests/test_reward_boundary.py", "tests/test_observe.py", "tests/test_run_command.py",
]  # fmt: skip


# Modules of subprocesses, servers and clusters (about 90% of the suite's time): marked slow,
# so that `-m "not slow"` is the edit loop's quick subset (README, "Developing").
SLOW_MODULES = {
    *LIVE_VLLM_MODULES, *(f"tests/test_{name}.py" for name in (
        "ray_fleet", "run_command", "hostile_http", "hostile_serve", "server", "areal_compat", "areal_differential",
        "areal_vision", "observe", "fleet_router", "fleet_cli", "fleet_bench", "run_vision",
        "reward_boundary", "sync_executor", "examples", "api_docs", "vision_example", "readme_executor", "main_job",
        "executor_engines", "cli", "cli_top_end", "public_api", "doc_blocks", "real_model_guide", "serve_vision", "server_app",
        "hostile_local", "layout", "process_isolation", "warm_cli", "vllm_vision_live", "claude_code_cli", "replay_vision", "own_deadline", "skip_reasons",
    )),
    "props/test_executor_machine.py", "props/test_group_local_props.py",
}  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow modules' tests ``slow``, and run the longest modules first (only the
    order changes; every test still runs)."""
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    for item in items:
        if item.nodeid.split("::", 1)[0] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


if importlib.util.find_spec("xdist") is not None:
    from xdist.scheduler import LoadScopeScheduling

    class _ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadScopeScheduling | None:
        """Our scheduling for the default ``--dist load``; any other --dist is xdist's own."""
        return _ModuleScheduling(config, log) if config.getvalue("dist") == "load" else None

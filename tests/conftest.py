from pathlib import Path

import pytest
import torch

# Bitwise-repeatable CPU arithmetic in every test process.
torch.set_num_threads(1)

# One real vLLM server per test session for the live modules (started only when one asks).
from .vllm_server import vllm_checkpoints, vllm_server, vllm_url  # noqa: F401


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist's ``--dist loadgroup`` (the README's test command), each module of
    tests/ runs on one worker, so its module-scoped servers and clusters start once; the live
    vLLM modules share one group, and so one server. props/ is spread test by test."""
    tests_dir = Path(__file__).parent
    for item in items:
        if item.get_closest_marker("xdist_group") is not None or tests_dir not in item.path.parents:
            continue
        group = "vllm" if item.get_closest_marker("vllm") else item.path.stem
        item.add_marker(pytest.mark.xdist_group(group))

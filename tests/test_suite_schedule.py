"""The suite's own schedule (tests/conftest.py): the modules it names exist, so that a renamed
module cannot silently leave the slow set, the first-run list or the shared vLLM worker."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from . import conftest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["SLOW_MODULES", "LONGEST_FIRST", "LIVE_VLLM_MODULES"])
def test_every_module_the_schedule_names_exists(name: str) -> None:
    missing = sorted(m for m in getattr(conftest, name) if not (ROOT / m).is_file())
    assert missing == []


def test_the_live_vllm_modules_share_one_scope_and_props_spread_test_by_test() -> None:
    scopes = {conftest._scope(f"{m}::test_x") for m in conftest.LIVE_VLLM_MODULES}
    assert scopes == {"vllm"}
    assert conftest._scope("props/test_group_props.py::test_a") != conftest._scope("props/test_group_props.py::test_b")
    assert conftest._scope("tests/test_cli.py::test_a") == conftest._scope("tests/test_cli.py::test_b[1]")


def test_a_test_may_configure_logging_in_process() -> None:
    """The first half of a pair (the next test checks): what ``serve`` does in process."""
    from rollout_trio.cli._common import setup_logging

    setup_logging("INFO")
    assert any(type(h) is logging.StreamHandler for h in logging.getLogger().handlers)


def test_the_next_test_finds_the_root_logger_as_it_was() -> None:
    """tests/conftest.py's ``_root_logger_as_found``: no stream handler the previous test left
    (it would write to that test's closed capture), and the level restored."""
    root = logging.getLogger()
    assert not any(type(h) is logging.StreamHandler for h in root.handlers), root.handlers
    assert root.level != logging.INFO

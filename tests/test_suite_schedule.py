"""The suite's own schedule (tests/conftest.py): the modules it names exist, so that a renamed
module cannot silently leave the slow set, the first-run list or the shared vLLM worker."""

from __future__ import annotations

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

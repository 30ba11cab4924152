"""RolloutConfig: keywords, dicts, YAML and JSON files; unknown keys refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_trio.executor import RolloutConfig


def test_defaults_follow_the_reference() -> None:
    c = RolloutConfig()
    assert (c.consumer_batch_size, c.max_head_offpolicyness, c.on_workflow_error) == (1, 0, "reject")
    assert (c.concurrency, c.queue_capacity) == (1, 16)
    c = RolloutConfig(consumer_batch_size=8, max_concurrent_rollouts=32)
    assert (c.concurrency, c.queue_capacity) == (32, 512)


def test_from_dict_and_unknown_keys() -> None:
    c = RolloutConfig.from_dict({"consumer_batch_size": 4, "max_head_offpolicyness": 2, "on_workflow_error": "raise"})
    assert c == RolloutConfig(consumer_batch_size=4, max_head_offpolicyness=2, on_workflow_error="raise")
    with pytest.raises(ValueError, match=r"unknown keys \['consumer_batchsize', 'zzz'\]"):
        RolloutConfig.from_dict({"consumer_batchsize": 4, "zzz": 1})


@pytest.mark.parametrize(
    "key,value,rule",
    [
        ("consumer_batch_size", 0, "integer >= 1"),
        ("max_head_offpolicyness", -1, "integer >= 0"),
        ("on_workflow_error", "ignore", "'reject' or 'raise'"),
        ("episode_timeout", 0, "seconds > 0"),
        ("queue_size", 0, "None or an integer >= 1"),
    ],
)
def test_bad_values_name_field_and_rule(key: str, value: object, rule: str) -> None:
    with pytest.raises(ValueError, match=f"RolloutConfig.{key}: must be .*{rule}"):
        RolloutConfig.from_dict({key: value})
    with pytest.raises(ValueError, match=f"RolloutConfig.{key}"):
        RolloutConfig(**{key: value})  # type: ignore[arg-type]


def test_yaml_and_json_files(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("rollout:\n  consumer_batch_size: 4\n  max_concurrent_rollouts: 16\n  episode_timeout: 2.5\n")
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"consumer_batch_size": 4, "max_concurrent_rollouts": 16, "episode_timeout": 2.5}))
    assert RolloutConfig.from_file(y) == RolloutConfig.from_file(j) == RolloutConfig(
        consumer_batch_size=4, max_concurrent_rollouts=16, episode_timeout=2.5
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_head_offpolicy: 1\n")
    with pytest.raises(ValueError, match="unknown keys \\['max_head_offpolicy'\\]"):
        RolloutConfig.from_file(bad)


def test_coerce_applies_overrides() -> None:
    base = RolloutConfig(consumer_batch_size=2)
    assert RolloutConfig.coerce(base, max_head_offpolicyness=3).max_head_offpolicyness == 3
    assert RolloutConfig.coerce({"consumer_batch_size": 2}, queue_size=5).queue_size == 5
    with pytest.raises(ValueError, match="unknown keys"):
        RolloutConfig.coerce(None, nope=1)

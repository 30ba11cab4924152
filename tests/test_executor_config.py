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


# ---------------------------------------------------------------- hostile files (issue 18 item 8)


def _bomb(levels: int) -> str:
    """The billion-laughs shape: each level is nine aliases of the one before, under ``fileroot``."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nfileroot: *l{levels - 1}\n"


@pytest.mark.parametrize("levels", [4, 12])  # 12 levels would expand to 9**12 strings
def test_a_yaml_alias_bomb_is_refused_before_anything_expands(tmp_path: Path, levels: int) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_bomb(levels))
    with pytest.raises(ValueError, match=rf"^{bomb}:1: YAML anchors and aliases \(&l0 / \*l0\) are not allowed"):
        RolloutConfig.from_file(bomb)


def test_a_lone_anchor_is_refused_too(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("rollout: &r\n  consumer_batch_size: 4\n")
    with pytest.raises(ValueError, match="anchors and aliases"):
        RolloutConfig.from_file(f)


@pytest.mark.parametrize(
    ("text", "field", "rule"),
    [
        ("consumer_batch_size: true", "consumer_batch_size", r"an integer, got True \(bool\)"),
        ("consumer_batch_size: '8'", "consumer_batch_size", r"an integer, got '8' \(str\)"),
        ("max_head_offpolicyness: 1.0", "max_head_offpolicyness", r"an integer, got 1.0 \(float\)"),
        ("queue_size: '64'", "queue_size", r"null or an integer, got '64' \(str\)"),
        ("fileroot: !!binary aGVsbG8=", "fileroot", r"null or a string, got b'hello' \(bytes\)"),
        ("experiment_name: 5", "experiment_name", r"null or a string, got 5 \(int\)"),
        ("dump_to_file: 1", "dump_to_file", r"true or false, got 1 \(int\)"),
        ("deterministic_sampling: 'yes'", "deterministic_sampling", r"true or false, got 'yes' \(str\)"),
        ("episode_timeout: '2.5'", "episode_timeout", r"null or a number, got '2.5' \(str\)"),
        ("version_poll_interval: false", "version_poll_interval", r"a number, got False \(bool\)"),
        ("on_workflow_error: [reject]", "on_workflow_error", r"a string, got \['reject'\] \(list\)"),
    ],
)
def test_values_of_the_wrong_type_are_refused_not_coerced(tmp_path: Path, text: str, field: str, rule: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text + "\n")
    with pytest.raises(ValueError, match=rf"^RolloutConfig\.{field}: must be {rule}$"):
        RolloutConfig.from_file(f)


def test_json_values_are_not_coerced_either(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text('{"consumer_batch_size": true}')
    with pytest.raises(ValueError, match=r"^RolloutConfig\.consumer_batch_size: must be an integer, got True"):
        RolloutConfig.from_file(f)
    with pytest.raises(ValueError, match=r"^RolloutConfig\.trial_name: must be null or a string, got 7"):
        RolloutConfig.from_dict({"trial_name": 7})


def test_an_integer_is_a_number_of_seconds(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("episode_timeout: 2\nversion_poll_interval: 1\n")
    assert RolloutConfig.from_file(f) == RolloutConfig(episode_timeout=2.0, version_poll_interval=1.0)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("c.yaml", "consumer_batch_size: [1\n", "not valid YAML"),
        ("c.json", '{"consumer_batch_size": ', "not valid JSON"),
        ("c.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_a_file_that_does_not_parse_is_a_value_error_naming_it(tmp_path: Path, name: str, text: str, message: str) -> None:
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ValueError, match=rf"^{f}: {message}"):
        RolloutConfig.from_file(f)

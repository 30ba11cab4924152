"""``RolloutConfig``: the executor's settings (the reference's ``InferenceEngineConfig`` keys)."""

from __future__ import annotations

import json
import numbers
import os
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import cattrs

from .._bounded import read_text_file
from .._convert import converter
from .._validate import is_int, is_real

__all__ = ["RolloutConfig"]


def _check(text: str, predicate: Any) -> Any:
    """An attrs validator raising ``ValueError`` that names the field and the rule."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not predicate(value):
            raise ValueError(f"RolloutConfig.{attribute.name}: must be {text}, got {value!r}")

    return check


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# The type rule of a scalar field read from a file: no coercion (true is not 1, '8' is not 8).
_TYPE_RULES: dict[Any, tuple[str, Callable[[Any], bool]]] = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("an integer", is_int),
    float: ("a number", _is_number),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _type_rule(annotation: Any) -> tuple[str, Callable[[Any], bool]] | None:
    """``(rule, check)`` for a scalar or optional scalar annotation, else None."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    kinds = [a for a in args if a is not type(None)]
    if len(kinds) != 1 or kinds[0] not in _TYPE_RULES:
        return None
    text, check = _TYPE_RULES[kinds[0]]
    if len(kinds) == len(args):
        return text, check
    return f"null or {text}", lambda v: v is None or check(v)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


_pos_int = _check("an integer >= 1", lambda v: is_int(v) and v >= 1)
_opt_pos_int = _check("None or an integer >= 1", lambda v: v is None or (is_int(v) and v >= 1))
_flag = _check("a bool", lambda v: isinstance(v, bool))
_opt_name = _check("None or a string", lambda v: v is None or isinstance(v, str))


@attrs.frozen(kw_only=True)
class RolloutConfig:
    """How the executor schedules rollouts.

    Build it with keywords, :meth:`from_dict`, or :meth:`from_file` (YAML or JSON);
    unknown keys are refused by name.

    Attributes:
        consumer_batch_size: trajectories the trainer consumes per version step (b).
        max_concurrent_rollouts: episodes in flight at once (default: ``consumer_batch_size``).
        max_head_offpolicyness: versions a trajectory may lag the trainer (s).
        queue_size: the most results of ``submit`` waiting for ``wait()``, counting their
            running episodes (default ``16 * max_concurrent_rollouts``); results a call
            owns (``rollout_batch``'s, ``prepare_batch``'s) are not limited by it.
        on_workflow_error: ``"reject"`` counts a raising workflow as a failed task;
            ``"raise"`` stops the executor (``ExecutorFailed``) on the first one.
        episode_timeout: seconds one task may run; a timed-out task counts as failed.
        check_trajectory_format: validate every result with ``check_trajectory_format``
            and require the keys of the first one in every later one.
        deterministic_sampling: ``wait`` returns results in task-id order instead of
            task start order.
        version_poll_interval: how often a capacity-starved executor re-reads the
            engine's version (bumps made through :meth:`RolloutExecutor.set_version`
            are seen at once).
        dump_to_file, fileroot, experiment_name, trial_name: JSONL trajectory dumps under
            ``{fileroot}/{experiment_name}/{trial_name}/``.
        seed: seed every task's sampling as :func:`workflow_context.use_seed` does (a
            ``use_seed`` around the submitting call wins), and hand ``prepare_batch``
            results out in the source's order: every run gets the same batches.
        max_consecutive_rejections: a consumer call whose tasks end this many times in a
            row without a trajectory (rejected or failed) raises ``ExecutorStalled``
            (default 1000; None never stops: AReaL's behaviour, resubmitting forever).
        stall_warning_s: seconds a consumer call may wait without progress before one log
            line, a metric and ``top`` say what it waits on (None: never).
        drop_stale: drop an accepted training result whose oldest token falls more than
            ``max_head_offpolicyness`` versions behind before a call takes it (the
            per-trajectory bound; statistics count ``stale`` and ``stale_tokens``).
            False is AReaL's rule: admission by the staleness budget only, nothing
            dropped, so a consumed trajectory may be older than the bound.
    """

    consumer_batch_size: int = attrs.field(default=1, validator=_pos_int)
    max_concurrent_rollouts: int | None = attrs.field(default=None, validator=_opt_pos_int)
    max_head_offpolicyness: int = attrs.field(
        default=0, validator=_check("an integer >= 0", lambda v: is_int(v) and v >= 0)
    )
    queue_size: int | None = attrs.field(default=None, validator=_opt_pos_int)
    on_workflow_error: str = attrs.field(  # "reject" | "raise" (validated, so the error names the field)
        default="reject", validator=_check("'reject' or 'raise'", lambda v: v in ("reject", "raise"))
    )
    episode_timeout: float | None = attrs.field(
        default=None, validator=_check("None or a number of seconds > 0", lambda v: v is None or (is_real(v) and v > 0))
    )
    check_trajectory_format: bool = attrs.field(default=False, validator=_flag)
    deterministic_sampling: bool = attrs.field(default=False, validator=_flag)
    version_poll_interval: float = attrs.field(
        default=0.05, validator=_check("a number of seconds > 0", lambda v: is_real(v) and v > 0)
    )
    dump_to_file: bool = attrs.field(default=False, validator=_flag)
    fileroot: str | None = attrs.field(default=None, validator=_opt_name)
    experiment_name: str | None = attrs.field(default=None, validator=_opt_name)
    trial_name: str | None = attrs.field(default=None, validator=_opt_name)
    seed: int | None = attrs.field(
        default=None, validator=_check("None or an integer >= 0", lambda v: v is None or (is_int(v) and v >= 0))
    )
    max_consecutive_rejections: int | None = attrs.field(default=1000, validator=_opt_pos_int)
    stall_warning_s: float | None = attrs.field(
        default=60.0, validator=_check("None or a number of seconds > 0", lambda v: v is None or (is_real(v) and v > 0))
    )
    drop_stale: bool = attrs.field(default=True, validator=_flag)

    @property
    def concurrency(self) -> int:
        """``max_concurrent_rollouts``, defaulting to ``consumer_batch_size`` (before DP scaling)."""
        return self.max_concurrent_rollouts or self.consumer_batch_size

    @property
    def queue_capacity(self) -> int:
        """``queue_size``, defaulting to ``16 * concurrency`` (never DP-scaled)."""
        return self.queue_size or self.concurrency * 16

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RolloutConfig:
        """Build from a plain mapping (e.g. a parsed config file).

        Raises:
            ValueError: an unknown key (named), or a value breaking a field's rule.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"RolloutConfig: expected a mapping of settings, got {type(data).__name__}")
        fields = {a.name: a for a in attrs.fields(cls)}
        unknown = sorted(str(k)[:80] for k in data if k not in fields)
        if unknown:
            raise ValueError(f"RolloutConfig: unknown keys {unknown}; known keys are {sorted(fields)}")
        # Scalars are taken as they are, so a wrong type is an error naming the field, never
        # coerced (the converter would turn true into 1, '8' into 8 and bytes into "b'...'").
        for name, value in data.items():
            rule = _type_rule(fields[name].type)
            if rule is not None and not rule[1](value):
                raise ValueError(f"RolloutConfig.{name}: must be {rule[0]}, got {_shown(value)} ({type(value).__name__})")
        try:
            return converter.structure(dict(data), cls)
        except cattrs.BaseValidationError as exc:
            raise ValueError(f"RolloutConfig: {exc}") from exc
        except (TypeError, ValueError) as exc:
            if str(exc).startswith("RolloutConfig"):
                raise
            raise ValueError(f"RolloutConfig: {exc}") from exc

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> RolloutConfig:
        """Read a YAML (``.yaml``/``.yml``) or JSON file.

        A top-level ``rollout:`` section is used when present, so one trainer config
        file can hold it next to other sections. YAML anchors and aliases are refused
        (an alias bomb would expand without bound), and values keep their own types.

        Raises:
            OSError: the file cannot be opened.
            ValueError: naming the file, for one that is not a regular file, is over
                ``MAX_CONFIG_BYTES``, is not UTF-8 or does not parse; else as :meth:`from_dict`.
        """
        path = os.fspath(path)
        text = read_text_file(path)  # a regular file, size-bounded, UTF-8 (never a FIFO or /dev/zero)
        try:
            data = _load_yaml(text, path) if path.endswith((".yaml", ".yml")) else json.loads(text)
        except RecursionError:
            raise ValueError(f"{path}: nested too deeply to be a RolloutConfig file") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        if isinstance(data, Mapping) and isinstance(data.get("rollout"), Mapping) and len(data) == 1:
            data = data["rollout"]
        return cls.from_dict(data if data is not None else {})

    @classmethod
    def coerce(cls, config: RolloutConfig | Mapping[str, Any] | None, **overrides: Any) -> RolloutConfig:
        """``config`` (a RolloutConfig, a mapping or None) with keyword ``overrides`` applied."""
        if config is None:
            config = {}
        if isinstance(config, Mapping):
            return cls.from_dict({**config, **overrides})
        if not isinstance(config, cls):
            raise TypeError(f"config: expected a RolloutConfig or a mapping, got {type(config).__name__}")
        return attrs.evolve(config, **overrides) if overrides else config


def _load_yaml(text: str, path: str) -> Any:
    """``text`` parsed by PyYAML's safe loader, refusing anchors and aliases."""
    import yaml  # type: ignore[import-untyped,unused-ignore]

    class NoAliasLoader(yaml.SafeLoader):  # type: ignore[misc,unused-ignore]
        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                line = event.start_mark.line + 1
                raise ValueError(
                    f"{path}:{line}: YAML anchors and aliases (&{event.anchor} / *{event.anchor}) are not allowed "
                    "in a RolloutConfig file; write each value out"
                )
            return super().compose_node(parent, index)

    try:
        return yaml.load(text, Loader=NoAliasLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None


# Resolved here, while __module__ still names this module (the package re-exports it).
attrs.resolve_types(RolloutConfig)

"""``rollout-trio replay DUMP_DIR``: re-run dumped episodes through a workflow, without a model.

Each task's dataset item goes through the workflow once per dumped row, against a
:class:`~rollout_trio.engines.ReplayEngine` that answers with the recorded tokens; the
rows the workflow builds are compared with the dumped ones (tokens, loss mask,
logprobs, versions, truncation, raw reward, and for vision rows the image placeholders
and the ``multi_modal_input`` tensors, bit for bit). A row that differs points at the
part of the workflow that is not a pure function of the model's output: the prompt, the
images, the packing, or the reward.

A vision dump (rows with ``multi_modal_input``) is replayed by default with the vision
main job's workflow, tasks and processor (``rollout-trio run --task vision``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from .._util import LazyModule
from ._checkpoint import load_tokenizer
from ._common import (
    Parser,
    check_dump_path,
    import_name,
    import_object,
    interrupted_status,
    interruptible,
    non_negative_int,
    positive_int,
    run_command,
    run_trio,
    starting,
)

if TYPE_CHECKING:  # at run time these load inside the functions: `replay --help` imports no torch
    import trio

    from .._trajectory import Trajectory
    from .._workflow import RolloutWorkflow
    from ..engines import ReplayEngine
    from ..executor import DumpRecord
else:  # a usage error answers without importing trio (issue 31)
    trio = LazyModule("trio", globals())

__all__ = ["compare_row", "load_workflow", "replay_main", "replay_task"]


@attrs.frozen
class TaskReplay:
    """What replaying one task found: ``problems`` is empty when every row reproduced."""

    is_eval: bool
    task_id: int
    versions: tuple[int, ...]
    rows: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def _rows_like_the_dumper(traj: Trajectory) -> list[dict[str, Any]]:
    """The rows a dump would hold for ``traj`` (same skip rules), as plain lists."""
    if traj.loss_mask is None or traj.rewards is None:
        raise ValueError("the workflow's trajectory has no loss_mask or rewards; a dump of it would be empty")
    raw = traj.original_rewards if traj.original_rewards is not None else traj.rewards
    mm_rows = traj.extras.get("multi_modal_input")
    types = traj.extras.get("mm_token_type_ids")
    out = []
    for i, seqlen in enumerate(traj.attention_mask.sum(dim=1).tolist()):
        mask = traj.loss_mask[i, :seqlen].tolist()
        if seqlen == 0 or mask[-1] != 1:
            continue
        out.append(
            {
                "input_ids": traj.input_ids[i, :seqlen].tolist(),
                "loss_mask": mask,
                "logprobs": None if traj.logprobs is None else traj.logprobs[i, :seqlen].tolist(),
                "versions": None if traj.versions is None else traj.versions[i, :seqlen].tolist(),
                "reward": float(raw[i]),
                "is_truncated": None if traj.is_truncated is None else bool(traj.is_truncated[i]),
                "multi_modal_input": mm_rows[i] if isinstance(mm_rows, list) else None,
                "mm_token_type_ids": None if types is None else types[i, :seqlen].tolist(),
            }
        )
    return out


def _first_difference(a: Sequence[Any], b: Sequence[Any], close: bool = False) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if (abs(x - y) > 1e-6) if close else (x != y):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_row(row: Mapping[str, Any], record: DumpRecord, tokenizer: Any = None) -> list[str]:
    """How a replayed row differs from its dumped record (empty when it reproduces).

    Args:
        row: a rebuilt row: ``input_ids``, ``loss_mask``, ``logprobs``, ``versions``,
            ``reward``, ``is_truncated``, and optionally ``mm_token_type_ids`` and
            ``multi_modal_input`` (a vision row's processor tensors).
        record: the dumped row (with ``tokens``).
        tokenizer: shows differing tokens as text when given.

    Returns:
        One line per difference, each naming the row (``row #k: ...``).
    """
    from ._replay_vision import compare_multi_modal

    assert record.tokens is not None
    t = record.tokens
    where = f"row #{record.sample_idx}"
    problems = []
    at = _first_difference(row["input_ids"], t.input_ids)
    if at is not None:
        part = "prompt" if at < record.prompt_len else "completion"
        shown = ""
        if tokenizer is not None:
            got = tokenizer.decode(row["input_ids"][at:at + 10], skip_special_tokens=False)
            want = tokenizer.decode(list(t.input_ids[at:at + 10]), skip_special_tokens=False)
            shown = f": {got!r} vs dumped {want!r}"
        problems.append(f"{where}: input_ids differ from token {at} ({part}){shown}")
    else:
        compared: tuple[tuple[str, Sequence[Any] | None, bool], ...] = (
            ("loss_mask", t.loss_mask, False),
            ("versions", t.versions, False),
            ("logprobs", t.logprobs, True),
            ("mm_token_type_ids", t.mm_token_type_ids, False),
        )
        for key, dumped, close in compared:
            if row.get(key) is None or dumped is None:
                continue
            at = _first_difference(row[key], dumped, close)
            if at is not None:
                problems.append(f"{where}: {key} differ at token {at}: {row[key][at]} vs dumped {dumped[at]}")
    problems.extend(compare_multi_modal(where, row.get("multi_modal_input"), record.multi_modal_input))
    if not math.isclose(row["reward"], record.raw_reward, rel_tol=1e-6, abs_tol=1e-6):
        problems.append(f"{where}: reward {row['reward']:.6g} vs dumped {record.raw_reward:.6g}")
    if row["is_truncated"] is not None and record.is_truncated is not None and row["is_truncated"] != record.is_truncated:
        problems.append(f"{where}: is_truncated {row['is_truncated']} vs dumped {record.is_truncated}")
    return problems


def _as_trajectory(result: Any) -> Trajectory | None:
    from .._interaction import Interaction, interactions_to_trajectory
    from .._trajectory import Trajectory

    if result is None or isinstance(result, Trajectory):
        return result
    if isinstance(result, Mapping) and result and all(isinstance(v, Interaction) for v in result.values()):
        return interactions_to_trajectory(result)
    if isinstance(result, Mapping):
        return Trajectory.from_dict(result) if result else None
    raise TypeError(f"the workflow returned {type(result).__name__}; expected a Trajectory, a dict or None")


async def replay_task(
    workflow: RolloutWorkflow, engine: ReplayEngine, data: Any, records: Sequence[DumpRecord], tokenizer: Any = None
) -> TaskReplay:
    """Run ``workflow`` on ``data`` until it has rebuilt as many rows as ``records`` (one task's dump)."""
    from .. import workflow_context
    from ..engines import ReplayMismatchError

    first = records[0]
    report = TaskReplay(first.is_eval, first.task_id, tuple(sorted({r.version for r in records})), len(records), [])
    pending = list(records)
    slot = 0
    while pending:
        ctx = workflow_context.WorkflowContext(
            is_eval=first.is_eval, task_id=first.task_id, sample_idx=slot, group_size=len(records)
        )
        before = engine.answered
        try:
            with workflow_context.use(ctx):
                traj = _as_trajectory(await workflow.arun_episode(engine, data))
            rows = [] if traj is None else _rows_like_the_dumper(traj)
        except ReplayMismatchError as exc:
            report.problems.append(f"slot {slot}: {exc}")
            break
        except Exception as exc:  # the report says which task failed and how; the others still run
            report.problems.append(f"slot {slot}: the workflow raised {type(exc).__name__}: {exc}")
            break
        if not rows:
            report.problems.append(f"slot {slot}: the workflow returned no row to compare (None, or rows a dump skips)")
            break
        for row in rows:
            if not pending:
                report.problems.append(f"slot {slot}: the workflow built more rows than the {len(records)} dumped")
                break
            report.problems.extend(compare_row(row, pending.pop(0), tokenizer))
        if engine.answered == before:  # a workflow that never asks the engine would loop forever
            report.problems.append(f"slot {slot}: the workflow made no generation request")
            break
        slot += 1
    return report


def _takes_processor(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return "processor" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def load_workflow(spec: str | None, tokenizer: Any, max_new_tokens: int, processor: Any = None) -> RolloutWorkflow:
    """The workflow named ``module:attribute``, or by default the main job's: RLVR on toy
    arithmetic, or with a ``processor`` (a vision dump) the vision main job's
    :class:`~rollout_trio.workflows.VisionRLVRWorkflow` on the image's colour.

    A synchronous function is a factory called with the tokenizer (and ``processor=`` when
    there is one and it takes that keyword). The module may lie in the current directory,
    as for ``python -m``."""
    from .._config import GenerationConfig
    from .._workflow import resolve_workflow

    if spec is None:
        if processor is not None:
            from ._replay_vision import default_vision_workflow

            return resolve_workflow(default_vision_workflow(processor, max_new_tokens))
        from ..workflows import arithmetic_reward, rlvr_workflow

        return resolve_workflow(rlvr_workflow(tokenizer, arithmetic_reward, GenerationConfig(max_new_tokens=max_new_tokens)))
    obj = import_object(spec)
    if inspect.isfunction(obj) and not inspect.iscoroutinefunction(obj):
        obj = obj(tokenizer, processor=processor) if processor is not None and _takes_processor(obj) else obj(tokenizer)
    return resolve_workflow(obj)


def load_data(path: str | None, task_ids: Sequence[int], seed: int, vision: bool = False) -> Callable[[int], Any]:
    """``task_id -> dataset item``: line ``k`` of a JSONL file (or item ``k`` of a JSON list),
    or by default the main job's prompts for ``seed`` (arithmetic, or with ``vision`` the
    coloured images of ``run --task vision``)."""
    if path is None:
        from ..workflows import arithmetic_prompts
        from ._replay_vision import default_vision_data

        make = default_vision_data if vision else arithmetic_prompts
        items: list[Any] = make(max(task_ids) + 1, seed=seed) if task_ids else []
    else:
        text = Path(path).read_text(encoding="utf-8")
        items = json.loads(text) if path.endswith(".json") else [json.loads(line) for line in text.splitlines() if line.strip()]
        if not isinstance(items, list):
            raise ValueError(f"--data {path}: expected a JSON list or JSON lines")

    def item(task_id: int) -> Any:
        if not 0 <= task_id < len(items):
            raise ValueError(f"--data has {len(items)} items; task {task_id} has none")
        return items[task_id]

    return item


def _parser() -> Parser:
    p = Parser(
        "rollout-trio replay",
        "Re-run dumped episodes through a workflow against the recorded generations (no model) "
        "and report, per task, whether the tokens and rewards reproduce. Exit status 0 when all do, 1 otherwise.",
    )
    p.add_argument("dump_dir", metavar="DUMP_DIR", help="a dump directory (any level of the layout) or one .jsonl file")
    p.add_argument(
        "--workflow",
        type=import_name,
        metavar="MODULE:NAME",
        help="the workflow (or a factory taking the tokenizer) (default: the main job's RLVR arithmetic workflow)",
    )
    p.add_argument(
        "--data",
        metavar="FILE",
        help="dataset items, one per task id, JSON lines or a JSON list (default: the main job's prompts for --seed)",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="the main job's --seed, for its default prompts")
    p.add_argument(
        "--task",
        type=non_negative_int,
        action="append",
        metavar="ID",
        help="replay only this task id, repeatable (default: every task)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a local tokenizer directory, for a vision dump a processor (checkpoint) directory "
        "(default: the built-in tiny model's, or tiny VLM's)",
    )
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=8, help="the default workflow's limit, as the main job's"
    )
    return p


def _read(args: argparse.Namespace) -> dict[tuple[bool, int], list[DumpRecord]]:
    """The records of the tasks asked for, by task (image files read and checked)."""
    from ..executor._dump import iter_dump

    by_task: dict[tuple[bool, int], list[DumpRecord]] = {}
    seen = 0
    for r in iter_dump(args.dump_dir):  # keep only the tasks asked for
        seen += 1
        if args.task is None or r.task_id in args.task:
            by_task.setdefault((r.is_eval, r.task_id), []).append(r)
    if not seen:
        raise ValueError(f"no dump records under {args.dump_dir}")
    if not by_task:
        raise ValueError(f"tasks {args.task} are not in the dump")
    return by_task


async def _replay(
    args: argparse.Namespace, tokenizer: Any, processor: Any, by_task: dict[tuple[bool, int], list[DumpRecord]]
) -> int:
    from ..engines import ReplayEngine

    workflow = load_workflow(args.workflow, tokenizer, args.max_new_tokens, processor)
    data = load_data(args.data, [task for _, task in by_task], args.seed, vision=processor is not None)
    engine = ReplayEngine([r for rows in by_task.values() for r in rows], tokenizer=tokenizer)
    reports = []
    async with engine, interruptible("stopping; the tasks replayed so far follow") as interrupt:
        for (is_eval, task_id), rows in sorted(by_task.items()):
            rows.sort(key=lambda r: r.sample_idx)
            try:
                item = data(task_id)
            except ValueError as exc:
                report = TaskReplay(is_eval, task_id, tuple(sorted({r.version for r in rows})), len(rows), [str(exc)])
            else:
                report = await replay_task(workflow, engine, item, rows, tokenizer)
            reports.append(report)
            name = f"{'eval ' if is_eval else ''}task {task_id}"
            versions = ",".join(map(str, report.versions))
            if report.ok:
                print(f"{name:<16} v{versions:<6} {report.rows} rows reproduce")
            else:
                print(f"{name:<16} v{versions:<6} DIFFERS")
                for problem in report.problems:
                    print(f"    {problem}")
    bad = sum(not r.ok for r in reports)
    left = f", {len(by_task) - len(reports)} not replayed ({interrupt.how})" if interrupt.received else ""
    print(f"\n{len(reports)} tasks replayed: {len(reports) - bad} reproduce, {bad} differ{left}")
    if interrupt.received:
        return interrupted_status(interrupt)
    return 1 if bad else 0


def _main(args: argparse.Namespace) -> int:
    check_dump_path(args.dump_dir)  # before transformers and torch load: this answers at once
    with starting():  # transformers loads here, once the options parsed
        by_task = _read(args)  # a missing or tampered image file ends here, in one line
        processor = None
        if any(r.multi_modal_input is not None for rows in by_task.values() for r in rows):
            from ._replay_vision import load_processor

            processor = load_processor(args.tokenizer)
            tokenizer = processor.tokenizer
        elif args.tokenizer is not None:
            tokenizer = load_tokenizer(args.tokenizer)
        else:
            from ..models import byte_tokenizer

            tokenizer = byte_tokenizer()
    return run_trio(_replay, args, tokenizer, processor, by_task)


def replay_main(argv: Sequence[str]) -> int:
    """Entry point of ``rollout-trio replay``; returns the exit status (1 when a row differs)."""
    return run_command("rollout-trio replay", _parser(), argv, _main)

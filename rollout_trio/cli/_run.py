"""``rollout-trio run``: grouped rollouts of toy arithmetic on the embedded engine."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from .._util import LazyModule
from ._checkpoint import (
    TINY_VLM,
    add_model_options,
    check_chat_template,
    check_device,
    check_model_dir,
    load_model_and_tokenizer,
    load_vision_model,
)
from ._common import (
    CommandError,
    Parser,
    UsageError,
    interrupted_status,
    interruptible,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    run_command,
    run_trio,
    starting,
)

if TYPE_CHECKING:
    import torch
    import trio

    from ..engines import LocalEngine
    from ..executor import TaskOutcome
else:  # a usage error answers without importing trio (issue 31)
    trio = LazyModule("trio", globals())

__all__ = ["run_main"]


def _parser() -> Parser:
    p = Parser(
        "rollout-trio run",
        "Run grouped rollouts of toy arithmetic on the embedded engine through the executor, "
        "printing each group as it finishes, then group statistics. Ctrl-C stops new work, "
        "aborts the episodes in flight, prints the summary and exits 130.",
    )
    p.add_argument(
        "--task",
        choices=("arithmetic", "vision"),
        default="arithmetic",
        help="arithmetic: toy addition on the tiny model; vision: the colour of a generated image on the tiny "
        "VLM (VisionRLVRWorkflow; --model then names a vision checkpoint)",
    )
    p.add_argument("--groups", type=positive_int, default=16, help="prompts (one group each)")
    p.add_argument("--group-size", type=positive_int, default=8, help="samples per prompt (G)")
    p.add_argument("--concurrency", type=positive_int, default=4, help="groups in flight at once")
    p.add_argument(
        "--consumer-batch-size",
        type=positive_int,
        default=None,
        help="groups the consumer takes per batch (default: --concurrency)",
    )
    p.add_argument(
        "--max-head-offpolicyness",
        type=non_negative_int,
        default=1000,
        help="versions a batch may lag (the run never bumps the version)",
    )
    add_model_options(p, "a local Hugging Face checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--temperature", type=non_negative_float, default=1.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--max-new-tokens", type=positive_int, default=8, help="tokens generated per sample at most")
    p.add_argument(
        "--reward-normalization",
        action="store_true",
        help="normalize rewards within each group (needs --group-size >= 2); prints both rewards",
    )
    p.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="seeds the prompts and sampling; the same seed gives the same samples whatever the scheduling",
    )
    p.add_argument(
        "--episode-timeout",
        type=positive_float,
        default=None,
        help="seconds one group may take; a group past it counts as failed (default: no limit)",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        help="seconds before the whole run stops as if interrupted (default: no limit)",
    )
    p.add_argument(
        "--dump",
        metavar="DIR",
        default=None,
        help="write every trajectory as JSONL under DIR/run/<trial>/, see docs/dumps.md (default: no dump)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar of the finished groups on stderr (default: when stderr is a terminal)",
    )
    p.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics and the live page at /live "
        "while the run lasts; 0 picks a free port (default: off)",
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        default=None,
        help="write each episode's lifecycle as Chrome trace JSON to FILE, for https://ui.perfetto.dev (default: off)",
    )
    p.add_argument(
        "--areal-compat",
        metavar="DIR",
        default=None,
        help="run AReaL's own areal/workflow/rlvr.py from DIR (an unpacked AReaL wheel) unchanged, under the "
        "rollout_trio.compat.areal import hook, instead of the built-in workflow (docs/areal.md)",
    )
    return p


def _build_engine(args: argparse.Namespace) -> tuple[LocalEngine, Any]:
    """The engine, and the processor for ``--task vision`` (else None)."""
    from ..engines import LocalEngine

    if args.task == "vision":
        vision = load_vision_model(args.model or TINY_VLM, args.device, args.dtype)
        if vision is None:
            raise CommandError(f"--model {args.model}: --task vision needs a vision-language checkpoint (config.json with vision_config)")
        model, processor, _ = vision
        return LocalEngine(model, processor.tokenizer, seed=args.seed), processor
    model, tokenizer, _ = load_model_and_tokenizer(args.model, args.device, args.dtype)
    check_chat_template(tokenizer, args.model)  # the arithmetic prompts are chat messages (AReaL's rlvr.py too)
    return LocalEngine(model, tokenizer, seed=args.seed), None


def _shown(rewards: torch.Tensor) -> str:
    return f"[{' '.join(f'{r:.1f}' for r in rewards.tolist())}]  mean {rewards.mean():.2f}"


class _Summary:
    """Streams one line per finished group, counts the outcomes, and moves the progress bar."""

    def __init__(self, group_size: int, groups: int) -> None:
        self.group_size = group_size
        self.groups = groups
        self.counts: dict[str, int] = {"accepted": 0, "dropped": 0, "failed": 0}
        self.episodes = 0
        self._bar: Any = None

    def header(self) -> None:
        print(f"group  question     per-slot rewards (G={self.group_size})", flush=True)

    @contextmanager
    def progress_bar(self, show: bool) -> Iterator[None]:
        """A tqdm bar of the finished groups on stderr while the block runs (when ``show``)."""
        if not show:
            yield
            return
        from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

        with tqdm(total=self.groups, unit="group", file=sys.stderr, dynamic_ncols=True, leave=False) as bar:
            self._bar = bar
            try:
                yield
            finally:
                self._bar = None

    def _say(self, line: str) -> None:
        if self._bar is None:
            print(line, flush=True)
            return
        with self._bar.external_write_mode(file=sys.stdout):  # the bar steps aside for the line
            print(line, flush=True)
        self._bar.update(1)

    def on_outcome(self, outcome: TaskOutcome) -> None:
        from .._trajectory import Trajectory

        if outcome.status == "cancelled":
            return
        k = outcome.data["index"]
        question = outcome.data["messages"][0]["content"]
        if not isinstance(question, str):  # a vision task: the answer stands for the image
            question = f"<{outcome.data.get('answer', '?')}> image"
        traj = outcome.trajectory
        if outcome.status == "accepted" and isinstance(traj, Trajectory):
            assert traj.rewards is not None
            line = f"{k:>3}  {question:<12} rewards "
            if traj.original_rewards is not None:  # --reward-normalization: both, so the change shows
                line += f"{_shown(traj.original_rewards)}  normalized {_shown(traj.rewards)}"
            else:
                line += _shown(traj.rewards)
            self.counts["accepted"] += 1
        elif outcome.status == "failed":
            line = f"{k:>3}  {question:<12} failed ({outcome.reason})"
            self.counts["failed"] += 1
        else:
            line = f"{k:>3}  {question:<12} dropped"
            self.counts["dropped"] += 1
        self.episodes += self.group_size
        self._say(line)


async def _run(args: argparse.Namespace) -> int:
    with starting():  # torch and transformers load here, once the options parsed
        from .. import workflow_context
        from .._config import GenerationConfig
        from .._stats import StatsRecorder
        from ..executor import RolloutConfig, open_executor
        from ..workflows import (
            VisionRLVRWorkflow,
            arithmetic_prompts,
            arithmetic_reward,
            colour_prompts,
            colour_reward,
            rlvr_workflow,
        )
    make_prompts = colour_prompts if args.task == "vision" else arithmetic_prompts
    prompts = [dict(p, index=k) for k, p in enumerate(make_prompts(args.groups, seed=args.seed))]
    stats = StatsRecorder()
    summary = _Summary(args.group_size, len(prompts))
    batch_size = args.consumer_batch_size or args.concurrency
    config = RolloutConfig(
        consumer_batch_size=batch_size,
        max_concurrent_rollouts=args.concurrency,
        max_head_offpolicyness=args.max_head_offpolicyness,
        queue_size=max(batch_size, args.concurrency) * 16,
        episode_timeout=args.episode_timeout,
        dump_to_file=args.dump is not None,
        fileroot=args.dump,
        experiment_name="run" if args.dump is not None else None,
        trial_name=f"seed{args.seed}" if args.dump is not None else None,
    )
    started = time.perf_counter()
    async with AsyncExitStack() as stack:
        observers: list[Any] = []
        if args.metrics_port is not None:
            from ..observe import ExecutorMetrics, open_metrics_server

            metrics = ExecutorMetrics()
            try:
                url = await stack.enter_async_context(open_metrics_server(metrics, port=args.metrics_port))
            except OSError as exc:
                raise CommandError(f"--metrics-port {args.metrics_port}: cannot listen: {exc}") from exc
            observers.append(metrics)
            from ..phases import phase_metrics, remove_phase_listener

            stack.callback(remove_phase_listener, phase_metrics(metrics.registry))  # rollout_trio_phase_seconds
            print(f"rollout-trio run: metrics at {url}/metrics, live page at {url}/live", file=sys.stderr, flush=True)
        recorder = None
        if args.trace is not None:
            from ..observe import TraceRecorder
            from ..phases import add_phase_listener, remove_phase_listener

            recorder = TraceRecorder()
            observers.append(recorder)
            add_phase_listener(recorder.phase)  # each traced phase as a slice on its slot's track
            stack.callback(remove_phase_listener, recorder.phase)
            stack.callback(_write_trace, recorder, args.trace)  # written however the run ends
        with starting():  # a Ctrl-C while the model loads lands at the checkpoint, once it has
            engine, processor = await trio.to_thread.run_sync(_build_engine, args)
            await trio.lowlevel.checkpoint()
        async with engine:
            traced: Any = engine
            if recorder is not None:
                from ..observe import TracedEngine

                traced = TracedEngine(engine, recorder)
            gconfig = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
            if processor is not None:
                workflow: Any = VisionRLVRWorkflow(colour_reward, gconfig, processor=processor)
            elif args.areal_compat is not None:
                from ..compat.areal._cli import areal_rlvr_workflow

                workflow = areal_rlvr_workflow(
                    args.areal_compat, engine.tokenizer, max_new_tokens=args.max_new_tokens, temperature=args.temperature
                )
            else:
                workflow = rlvr_workflow(engine.tokenizer, arithmetic_reward, gconfig)
            summary.header()
            show_bar = sys.stderr.isatty() if args.progress is None else args.progress
            with summary.progress_bar(show_bar):
                async with interruptible("stopping new work and aborting episodes in flight") as interrupt:
                    with trio.move_on_after(math.inf if args.timeout is None else args.timeout) as work:
                        # Sampling follows (seed, task id, slot), whatever order the executor runs tasks in.
                        with workflow_context.use_seed(args.seed):
                            async with open_executor(
                                traced, config, tokenizer=engine.tokenizer, stats=stats, observers=observers
                            ) as ex:
                                remaining = len(prompts)
                                while remaining:
                                    n = min(batch_size, remaining)
                                    await ex.prepare_batch(
                                        prompts, workflow, batch_size=n, dynamic_bs=True, cycle=False, progress=False,
                                        callback=summary.on_outcome, group_size=args.group_size,
                                        reward_normalization=args.reward_normalization,
                                    )  # fmt: skip
                                    remaining -= n
    if work.cancelled_caught and not interrupt.received:
        print(f"rollout-trio run: stopped after --timeout {args.timeout} s", file=sys.stderr)
    elapsed = time.perf_counter() - started
    c = summary.counts
    print(f"\n{c['accepted']} groups kept, {c['dropped']} dropped, {c['failed']} failed"
          f"{f', {len(prompts) - sum(c.values())} not finished' if sum(c.values()) < len(prompts) else ''}")  # fmt: skip
    print(f"\ngroup statistics (mean over {sum(c.values())} groups):")
    for key, value in stats.export().items():
        print(f"  {key:<40} {value:.3f}")
    print(f"\n{summary.episodes} episodes in {elapsed:.1f} s")
    if args.dump is not None:
        print(f"trajectories dumped under {os.path.join(args.dump, 'run', f'seed{args.seed}')}")
    return interrupted_status(interrupt)


def _main(args: argparse.Namespace) -> int:
    if args.reward_normalization and args.group_size < 2:
        raise UsageError("--reward-normalization needs --group-size >= 2 (it normalizes within a group)")
    check_model_dir(args.model)  # before torch loads: these answer at once
    check_device(args.device)
    if args.trace is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.trace))):
        raise CommandError(f"--trace {args.trace}: no such directory for the trace file")
    if args.task == "vision" and args.areal_compat is not None:
        raise UsageError("--areal-compat runs AReaL's text rlvr.py: it does not go with --task vision")
    if args.areal_compat is not None:
        from ..compat.areal._cli import check_sources

        if (why := check_sources(args.areal_compat)) is not None:
            raise CommandError(f"--areal-compat {args.areal_compat}: {why}")
    if args.dump is not None:
        try:
            os.makedirs(args.dump, exist_ok=True)
        except OSError as exc:
            raise CommandError(f"--dump {args.dump}: cannot create the directory: {exc.strerror}") from exc
    return run_trio(_run, args)


def run_main(argv: Sequence[str]) -> int:
    """Entry point of ``rollout-trio run``; returns the exit status."""
    return run_command("rollout-trio run", _parser(), argv, _main)


def _write_trace(recorder: Any, path: str) -> None:
    """Write the trace; an observer's failure (a full disk) is logged, never the run's."""
    try:
        recorder.write(path)
    except Exception as exc:  # noqa: BLE001 - an observer never ends the run
        logging.getLogger("rollout_trio.observe").warning("--trace %s: could not write the trace: %s", path, exc)

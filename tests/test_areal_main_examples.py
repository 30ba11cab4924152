"""The workflow classes of AReaL main's examples (countdown, multi_turn_math), unchanged, under the hook.

AReaL main is not published on the package index, so these run where a checkout of it is
at hand: ``AREAL_MAIN_CHECKOUT=/path/to/AReaL python -m pytest tests/test_areal_main_examples.py``
(otherwise they skip, saying so). The example files also start trainers and load datasets
at module level (``PPOTrainer``, ``datasets``, their own config modules), which are not a
workflow author's names; so each file's import statements run one by one under the hook,
the ones for those trainer-side names are left out (and listed), and the workflow classes
and functions run from the file's own source, unchanged.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest

from rollout_trio import check_trajectory_format
from rollout_trio.compat import areal as compat
from rollout_trio.engines import LocalEngine
from rollout_trio.executor import open_executor
from rollout_trio.models import tiny_model

from .test_areal_compat import areal_sources  # noqa: F401 (the 1.0.4 wheel: the hook's source of AReaL files)

CHECKOUT = os.environ.get("AREAL_MAIN_CHECKOUT")
pytestmark = pytest.mark.skipif(
    not CHECKOUT or not Path(CHECKOUT, "examples").is_dir(),
    reason="AREAL_MAIN_CHECKOUT does not name a checkout of AReaL main (it is not on the package index)",
)
TRAINER_SIDE = {"PPOTrainer", "load_dataset", "split_dataset_by_node", "get_custom_dataset", "MultiTurnGRPOConfig",
                "get_math_verify_worker", "compute_score", "load_expr_config", "GRPOConfig"}  # fmt: skip


def load_workflow_module(path: Path, names: set[str], extra: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The file's imports (those that are not trainer-side) and its definitions ``names``, from its own source."""
    tree = ast.parse(path.read_text(), str(path))
    namespace: dict[str, Any] = {"__name__": f"areal_main_{path.stem}", **extra}
    left_out: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("examples", "reward_score", "datasets")):
                left_out.append(ast.unparse(node))
                continue
            kept = [a for a in node.names if (a.asname or a.name) not in TRAINER_SIDE]
            left_out += [a.name for a in node.names if a not in kept]
            if kept:
                node.names = kept
                exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    missing = names - set(namespace)
    assert not missing, f"{path}: no {missing}"
    return namespace, left_out


@pytest.fixture
def hook(areal_sources):  # noqa: F811
    assert compat.install(areal_sources)
    yield
    compat.uninstall()


def exact_reward(result: Any = None, answer: Any = None, **_: Any) -> float:
    return float(str(result).strip() == str(answer))


async def test_countdown_workflow_class_runs_unchanged(hook) -> None:
    from areal.api.cli_args import GenerationHyperparameters

    model, tok = tiny_model()
    ns, left_out = load_workflow_module(
        Path(CHECKOUT, "examples/countdown/train.py"), {"CountDownWorkflow"},
        {"compute_score": lambda completion, data: float(len(completion) % 2)},  # its reward_score module's role
    )  # fmt: skip
    assert any("PPOTrainer" in line for line in left_out), left_out
    wf = ns["CountDownWorkflow"](GenerationHyperparameters(max_new_tokens=4), tok)
    data = {"query": "Using 1 2 3 4 make 10."}
    async with LocalEngine(model, tok) as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        (single,) = await ex.rollout_batch([data], wf)
        (group,) = await ex.rollout_batch([data], wf, group_size=3)
    assert check_trajectory_format(single.to_dict(), batch_size=1)
    assert check_trajectory_format(group.to_dict(), batch_size=3)


@pytest.mark.parametrize("export_style", ["concat", "individual"])
async def test_multi_turn_math_workflow_classes_run_unchanged(hook, export_style: str) -> None:
    from areal.api.cli_args import GenerationHyperparameters

    model, tok = tiny_model()
    ns, _ = load_workflow_module(
        Path(CHECKOUT, "examples/multi_turn_math/gsm8k_rl_mt.py"), {"MultiTurnMathAgent", "MultiturnRLVRWorkflow"}, {},
    )  # fmt: skip
    wf = ns["MultiturnRLVRWorkflow"](exact_reward, GenerationHyperparameters(max_new_tokens=3), tok, export_style=export_style, max_turns=2)
    data = {"messages": [{"role": "user", "content": "What is 1+2?"}], "answer": "never"}  # wrong: two turns
    async with LocalEngine(model, tok) as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        (single,) = await ex.rollout_batch([data], wf)
        (group,) = await ex.rollout_batch([data], wf, group_size=2)
    rows_per_episode = 1 if export_style == "concat" else 2  # concat: the leaf; individual: one row per turn
    assert check_trajectory_format(single.to_dict(), batch_size=rows_per_episode)
    assert check_trajectory_format(group.to_dict(), batch_size=2 * rows_per_episode)

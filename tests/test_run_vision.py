"""`rollout-trio run --task vision`: VisionRLVRWorkflow groups on the tiny VLM through the executor."""

from __future__ import annotations

from pathlib import Path

from rollout_trio.executor import read_dump
from rollout_trio.workflows import colour_prompts, colour_reward
from tests.test_run_command import run_cli


def test_run_task_vision_streams_groups_and_dumps_their_rows(tmp_path: Path) -> None:
    proc = run_cli("--task", "vision", "--groups", "3", "--group-size", "4", "--max-new-tokens", "2",
                   "--reward-normalization", "--dump", str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> image    rewards [") == 3, proc.stdout
    assert "3 groups kept" in proc.stdout
    assert len(read_dump(tmp_path / "run" / "seed0")) == 12


def test_run_task_vision_refuses_a_text_checkpoint_and_areal_compat(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tokenizer.json").write_text("{}")  # the early check looks for a tokenizer file, not in it
    proc = run_cli("--task", "vision", "--model", str(tmp_path), "--groups", "1")
    assert proc.returncode == 1 and "--task vision needs a vision-language checkpoint" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli("--task", "vision", "--areal-compat", str(tmp_path))
    assert proc.returncode == 2 and "does not go with --task vision" in proc.stderr


def test_colour_prompts_are_seeded_and_the_reward_reads_the_first_letter() -> None:
    a, b = colour_prompts(5, seed=3), colour_prompts(5, seed=3)
    assert [t["answer"] for t in a] == [t["answer"] for t in b]
    assert all(t["images"][0].size == (56, 56) and t["answer"] in "rgb" for t in a)
    assert colour_reward("", " g\\n", [], [], answer="g") == 1.0 and colour_reward("", "r", [], [], answer="g") == 0.0


async def test_a_vision_dump_replays_with_the_images_rebuilt_from_the_task(tmp_path: Path) -> None:
    from rollout_trio import GenerationConfig, Trajectory, VisionRLVRWorkflow, run_group, workflow_context
    from rollout_trio.engines import ReplayEngine
    from rollout_trio.workflow_context import WorkflowContext
    from tests.vision_helpers import vlm

    proc = run_cli("--task", "vision", "--groups", "2", "--group-size", "3", "--max-new-tokens", "2", "--dump", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    records = read_dump(tmp_path / "run" / "seed0")
    _, processor = vlm()
    wf = VisionRLVRWorkflow(colour_reward, GenerationConfig(max_new_tokens=2), processor=processor)
    replay = ReplayEngine(records, tokenizer=processor.tokenizer)
    for task_id, data in enumerate(colour_prompts(2, seed=0)):  # the run's tasks (seeded the same)
        with workflow_context.use(WorkflowContext(task_id=task_id)):
            result = await run_group(wf, replay, data, 3)
        traj = result if isinstance(result, Trajectory) else Trajectory.from_dict(result)
        recorded = sorted(tuple(r.tokens.input_ids) for r in records if r.task_id == task_id)
        assert sorted(tuple(row[m.bool()].tolist()) for row, m in zip(traj.input_ids, traj.attention_mask)) == recorded
        assert traj.extras["multi_modal_input"][0]["image_grid_thw"].tolist() == [[1, 4, 4]]

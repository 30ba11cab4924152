"""bench/vision_bench.py runs (small sizes; its numbers are the bench's, not asserted here)."""

from __future__ import annotations

import trio

from bench import vision_bench as vb
from rollout_trio.models_vision import tiny_vlm


def test_both_cases_run_and_count_every_token() -> None:
    model, processor = tiny_vlm()
    shared = vb.VisionRLVRWorkflow(vb.reward, vb.GenerationConfig(max_new_tokens=2), processor=processor)
    per_slot = vb.PerSlotVision(vb.reward, vb.GenerationConfig(max_new_tokens=2), processor=processor)
    assert trio.run(vb.episodes_per_second, shared, 1, 2) > 0
    assert trio.run(vb.episodes_per_second, per_slot, 1, 2) > 0
    reqs, batch = vb.engine_requests(processor, 3)
    assert trio.run(vb.engine_tokens_per_second, model, processor, reqs) > 0
    assert vb.generate_tokens_per_second(model, batch, 3) > 0

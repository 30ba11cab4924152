"""Properties of trajectory dumps: what is written reads back exactly, and the derived fields agree."""

import json
import tempfile
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

from rollout_trio import Trajectory
from rollout_trio.executor import read_dump
from rollout_trio.executor._dump import compute_output_versions, split_trajectory_for_dump, trajectory_lines
from rollout_trio.testing import strategies as rst


class CharTok:
    """One character per id, so segment texts concatenate to the row's text."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x21 + i % 90) for i in ids)


@st.composite
def multi_turn_trajectories(draw):
    """Rows with any mask pattern (prompt, several generations, context), versions -1 off the mask."""
    rows = draw(st.integers(1, 4))
    lengths = [draw(st.integers(0, 12)) for _ in range(rows)]
    width = max(max(lengths), 1) + draw(st.integers(0, 2))
    ids = torch.zeros(rows, width, dtype=torch.int64)
    attn = torch.zeros(rows, width, dtype=torch.bool)
    mask = torch.zeros(rows, width, dtype=torch.int64)
    logp = torch.zeros(rows, width, dtype=torch.float32)
    vers = torch.full((rows, width), -1, dtype=torch.int64)
    for r, n in enumerate(lengths):
        m = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        ids[r, :n] = torch.tensor(draw(st.lists(st.integers(0, 500), min_size=n, max_size=n)), dtype=torch.int64)
        attn[r, :n] = True
        mask[r, :n] = torch.tensor(m, dtype=torch.int64)
        for k in range(n):
            if m[k]:
                logp[r, k] = draw(st.floats(-20.0, 0.0, width=32))
                vers[r, k] = draw(st.integers(0, 5))
    return Trajectory(
        input_ids=ids, attention_mask=attn, loss_mask=mask, logprobs=logp, versions=vers,
        rewards=torch.tensor(draw(st.lists(rst.rewards(), min_size=rows, max_size=rows)), dtype=torch.float32),
        original_rewards=torch.tensor(draw(st.lists(rst.rewards(), min_size=rows, max_size=rows)), dtype=torch.float32)
        if draw(st.booleans()) else None,
    )


def _dump_and_read(traj: Trajectory, accepted: bool):
    tail, lines = trajectory_lines(traj, task_id=5, tokenizer=CharTok(), accepted=accepted)
    with tempfile.TemporaryDirectory() as root:
        path = Path(root, "rollout", str(tail), "5.jsonl")
        path.parent.mkdir(parents=True)
        path.write_text("".join(lines))
        return tail, lines, read_dump(root)


@given(st.one_of(multi_turn_trajectories(), rst.trajectories(optional_keys=True)), st.booleans())
def test_dump_read_round_trip_keeps_exactly_the_rows_ending_in_a_generated_token(traj, accepted):
    """read_dump(dump(traj)) gives back every row whose last attended token was generated, exactly."""
    tail, lines, records = _dump_and_read(traj, accepted)
    assert tail == int(traj.versions.max())
    kept = [i for i in range(traj.batch_size) if traj.attention_mask[i].any() and traj.loss_mask[i][traj.attention_mask[i]][-1] == 1]
    assert [r.sample_idx for r in records] == kept
    for r in records:
        i, n = r.sample_idx, r.seqlen
        assert n == int(traj.attention_mask[i].sum())
        assert list(r.tokens.input_ids) == traj.input_ids[i, :n].tolist()
        assert list(r.tokens.loss_mask) == traj.loss_mask[i, :n].tolist()
        assert list(r.tokens.versions) == traj.versions[i, :n].tolist()
        assert list(r.tokens.logprobs) == traj.logprobs[i, :n].tolist()
        assert r.reward == traj.rewards[i].item() and r.accepted == accepted and r.version == tail
        rebuilt = r.to_trajectory()
        assert rebuilt.input_ids.tolist() == [traj.input_ids[i, :n].tolist()]
        assert rebuilt.logprobs.tolist() == [traj.logprobs[i, :n].float().tolist()]
    assert all(json.loads(line)["task_id"] == 5 for line in lines)


@given(multi_turn_trajectories())
def test_version_rle_expands_back_to_the_generated_tokens_versions(traj):
    """Each record's version_rle, expanded, is the versions of its generated tokens; head/tail their min/max."""
    _, _, records = _dump_and_read(traj, True)
    for r in records:
        generated = [v for v, m in zip(r.tokens.versions, r.tokens.loss_mask) if m == 1]
        assert [v for v, count in r.version_rle for _ in range(count)] == generated
        assert all(a[0] != b[0] for a, b in zip(r.version_rle, r.version_rle[1:]))  # runs are maximal
        assert (r.head_version, r.tail_version) == (min(generated), max(generated))


@given(st.lists(st.integers(0, 1), min_size=1, max_size=20), st.data())
def test_segments_partition_the_row_into_alternating_runs(mask, data):
    """Segments (2+ generations) cover the row in order, alternate gen / not gen, and 'prompt' only starts it."""
    ids = data.draw(st.lists(st.integers(0, 89), min_size=len(mask), max_size=len(mask)))
    split = split_trajectory_for_dump(ids, mask, CharTok())
    text = CharTok().decode(ids)
    assert split.prompt_text + split.completion_text == text
    assert split.prompt_end == (mask.index(1) if 1 in mask else len(mask))
    generations = sum(1 for k, m in enumerate(mask) if m == 1 and (k == 0 or mask[k - 1] == 0))
    if generations < 2:
        assert split.segments is None
        return
    assert "".join(s.text for s in split.segments) == text
    assert sum(s.len for s in split.segments) == len(ids)
    assert all((a.role == "gen") != (b.role == "gen") for a, b in zip(split.segments, split.segments[1:]))
    assert [s.role for s in split.segments[1:]].count("prompt") == 0
    assert split.segments[0].role == ("gen" if mask[0] == 1 else "prompt")


@given(st.lists(st.integers(-1, 9), max_size=20), st.data())
def test_compute_output_versions_matches_a_direct_count(versions, data):
    """head/tail/rle equal min/max and a run count of the versions at mask == 1."""
    mask = data.draw(st.lists(st.integers(0, 1), min_size=len(versions), max_size=len(versions)))
    head, tail, rle = compute_output_versions(versions, mask)
    kept = [v for v, m in zip(versions, mask) if m]
    assert (head, tail) == ((min(kept), max(kept)) if kept else (-1, -1))
    assert [v for v, c in rle for _ in range(c)] == kept

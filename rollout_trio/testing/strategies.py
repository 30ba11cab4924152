"""Hypothesis strategies for the rollout_trio contract, for testing your own workflows.

Every value these strategies generate passes validation; :func:`corrupted_trajectory_dicts`
generates dicts that break exactly one rule, with a description ``"<key>: <what>"``::

    from hypothesis import given
    from rollout_trio.testing import strategies as rst

    @given(rst.trajectories())
    def test_my_packer_accepts_valid_rows(traj): ...
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "rollout_trio.testing.strategies needs Hypothesis, which is an extra: "
        'pip install -e ".[testing]" in the rollout_trio checkout'
    ) from exc

from .._config import GenerationConfig
from .._interaction import Interaction
from .._io import ModelResponse
from .._rollout_group import RolloutGroup
from .._trajectory import SEQUENCE_KEYS, Trajectory

__all__ = [
    "any_rewards",
    "corrupted_trajectory_dicts",
    "generation_configs",
    "group_options",
    "interactions",
    "model_responses",
    "rewards",
    "rollout_groups",
    "trajectories",
    "trajectory_groups",
]

INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float64)


def rewards(*, min_value: float = -100.0, max_value: float = 100.0) -> st.SearchStrategy[float]:
    """Finite rewards exactly representable in float32 (so tensors round-trip)."""
    return st.floats(min_value, max_value, allow_nan=False, allow_infinity=False, width=32)


#: Magnitudes where float32 arithmetic breaks: overflow of squares, float32's edge, subnormals.
EDGE_MAGNITUDES = (1e20, 1e30, 3.4028234663852886e38, 3.5e38, 1e300, 1e-20, 1e-38, 1.4e-45, 5e-324)


def any_rewards() -> st.SearchStrategy[float]:
    """Any float a workflow might hand back as a reward: ordinary values, NaN, infinities,
    magnitudes at and beyond float32's range, and tiny or subnormal ones."""
    edges = st.sampled_from(EDGE_MAGNITUDES).flatmap(lambda m: st.sampled_from([m, -m]))
    return st.one_of(rewards(), edges, st.floats(allow_nan=True, allow_infinity=True))


def group_options(group_size: int) -> st.SearchStrategy[dict[str, Any]]:
    """Valid :class:`~rollout_trio.GroupedRolloutWorkflow` options for ``group_size``
    slots, with ``reward_normalization`` on or off."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        normalize = group_size > 1 and draw(st.booleans())
        low = 2 if normalize else 1
        opts: dict[str, Any] = {
            "reward_normalization": normalize,
            "drop_incomplete_group": draw(st.booleans()),
            "min_usable_group_size": draw(st.integers(low, max(low, group_size))),
        }
        if normalize:
            opts["reward_normalization_use_std"] = draw(st.booleans())
        return opts

    return build()


def generation_configs() -> st.SearchStrategy[GenerationConfig]:
    """Valid :class:`GenerationConfig` values."""
    return st.builds(
        GenerationConfig,
        max_new_tokens=st.integers(1, 4096),
        min_new_tokens=st.integers(0, 16),
        max_tokens=st.integers(1, 1 << 16),
        greedy=st.booleans(),
        top_p=st.floats(0.0, 1.0, exclude_min=True),
        top_k=st.integers(1, 1 << 27),
        temperature=st.floats(0.0, 4.0),
        stop_token_ids=st.lists(st.integers(0, 1 << 17), max_size=4),
        frequency_penalty=st.floats(-2.0, 2.0),
        seed=st.none() | st.integers(0, 2**32 - 1),
    )


@st.composite
def model_responses(draw: st.DrawFn, *, max_prompt: int = 8, max_output: int = 8, vocab: int = 300) -> ModelResponse:
    """Valid :class:`ModelResponse` values (non-empty prompt)."""
    n_in = draw(st.integers(1, max_prompt))
    n_out = draw(st.integers(0, max_output))
    token = st.integers(0, vocab - 1)
    return ModelResponse(
        input_tokens=draw(st.lists(token, min_size=n_in, max_size=n_in)),
        output_tokens=draw(st.lists(token, min_size=n_out, max_size=n_out)),
        output_logprobs=draw(st.lists(st.floats(-20.0, 0.0, width=32), min_size=n_out, max_size=n_out)),
        output_versions=draw(st.lists(st.integers(0, 5), min_size=n_out, max_size=n_out)),
        stop_reason=draw(st.sampled_from(["stop", "length"])),
        latency=draw(st.floats(0.0, 10.0)),
        ttft=draw(st.floats(0.0, 10.0)),
    )


@st.composite
def rollout_groups(draw: st.DrawFn, *, rows: int | None = None, with_rewards: bool = True) -> RolloutGroup:
    """Valid :class:`RolloutGroup` values, summing to ``rows`` when given."""
    total = rows if rows is not None else draw(st.integers(1, 6))
    counts: list[int] = []
    left = total
    while left:
        c = draw(st.integers(1, left))
        counts.append(c)
        left -= c
    refs = [draw(st.none() | rewards()) if with_rewards else None for _ in counts]
    return RolloutGroup(tuple(counts), tuple(refs))


@st.composite
def trajectories(
    draw: st.DrawFn,
    *,
    min_rows: int = 1,
    max_rows: int = 4,
    max_len: int = 8,
    optional_keys: bool | None = None,
    int_dtype: torch.dtype | None = None,
    float_dtype: torch.dtype | None = None,
    extras: bool = True,
) -> Trajectory:
    """Valid :class:`Trajectory` values: right-padded rows of prompt then completion.

    ``optional_keys`` None draws whether the optional keys are present; the dtypes are
    drawn when not given.
    """
    rows = draw(st.integers(min_rows, max_rows))
    lengths = [draw(st.integers(1, max_len)) for _ in range(rows)]
    width = max(lengths) + draw(st.integers(0, 2))
    prompts = [draw(st.integers(1, n)) for n in lengths]
    idt = int_dtype or draw(st.sampled_from(INT_DTYPES))
    fdt = float_dtype or draw(st.sampled_from(FLOAT_DTYPES))
    ids = torch.zeros(rows, width, dtype=idt)
    attn = torch.zeros(rows, width, dtype=torch.bool)
    loss = torch.zeros(rows, width, dtype=idt)
    logp = torch.zeros(rows, width, dtype=fdt)
    vers = torch.full((rows, width), -1, dtype=idt)
    for r, (n, p) in enumerate(zip(lengths, prompts)):
        ids[r, :n] = torch.tensor(draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n)), dtype=idt)
        attn[r, :n] = True
        loss[r, p:n] = 1
        out = n - p
        logp[r, p:n] = torch.tensor(draw(st.lists(st.floats(-20.0, 0.0, width=32), min_size=out, max_size=out)), dtype=fdt)
        vers[r, p:n] = torch.tensor(draw(st.lists(st.integers(0, 9), min_size=out, max_size=out)), dtype=idt)
    fields: dict[str, Any] = {"input_ids": ids, "attention_mask": attn}
    with_optional = draw(st.booleans()) if optional_keys is None else optional_keys
    if with_optional:
        fields.update(
            loss_mask=loss,
            logprobs=logp,
            versions=vers,
            rewards=torch.tensor(draw(st.lists(rewards(), min_size=rows, max_size=rows)), dtype=fdt),
            is_truncated=torch.tensor(draw(st.lists(st.booleans(), min_size=rows, max_size=rows)), dtype=torch.bool),
        )
        grouping = draw(st.sampled_from(["none", "reward", "group"]))
        if grouping == "reward":
            fields["rollout_reward"] = draw(rewards())
        elif grouping == "group":
            fields["rollout_group"] = draw(rollout_groups(rows=rows))
    extra: dict[str, Any] = {}
    if extras and draw(st.booleans()):
        extra["turn_ids"] = torch.where(loss.bool(), 0, -1).to(torch.int32)
        extra["uid"] = [f"row-{r}" for r in range(rows)]
    return Trajectory(**fields, extras=extra)


@st.composite
def trajectory_groups(draw: st.DrawFn, /, *, min_size: int = 1, max_size: int = 4, **kwargs: Any) -> list[Trajectory]:
    """Lists of trajectories that can be joined: same keys and dtypes, as slots of one group produce."""
    with_optional = draw(st.booleans())
    idt = draw(st.sampled_from(INT_DTYPES))
    fdt = draw(st.sampled_from(FLOAT_DTYPES))
    has_extras = draw(st.booleans())
    n = draw(st.integers(min_size, max_size))
    return [
        draw(trajectories(optional_keys=with_optional, int_dtype=idt, float_dtype=fdt, extras=False, **kwargs))
        if not has_extras
        else _with_extras(draw(trajectories(optional_keys=with_optional, int_dtype=idt, float_dtype=fdt, extras=False, **kwargs)))
        for _ in range(n)
    ]


def _with_extras(t: Trajectory) -> Trajectory:
    d = t.to_dict()
    d["turn_ids"] = torch.where(t.attention_mask, 0, -1).to(torch.int32)
    d["uid"] = [f"row-{r}" for r in range(t.batch_size)]
    return Trajectory.from_dict(d)


@st.composite
def interactions(draw: st.DrawFn, *, reward: st.SearchStrategy[float | None] | None = None) -> Interaction:
    """Interactions with a model response and a reward."""
    resp = draw(model_responses())
    return Interaction(model_response=resp, reward=draw(reward if reward is not None else rewards()))


def _corruptions(d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every single-field corruption of the valid dict ``d``, with its description."""
    rows, width = d["input_ids"].shape
    out: list[tuple[str, dict[str, Any]]] = []

    def put(desc: str, key: str, value: Any) -> None:
        bad = dict(d)
        bad[key] = value
        out.append((desc, bad))

    def drop(desc: str, key: str) -> None:
        bad = dict(d)
        del bad[key]
        out.append((desc, bad))

    drop("input_ids: missing", "input_ids")
    drop("attention_mask: missing", "attention_mask")
    put("input_ids: float", "input_ids", d["input_ids"].float())
    put("input_ids: 1-D", "input_ids", d["input_ids"][0])
    put("input_ids: list", "input_ids", d["input_ids"].tolist())
    put("input_ids: negative", "input_ids", torch.full_like(d["input_ids"], -1))
    empty = dict(d)
    for key in SEQUENCE_KEYS:
        if key in d:
            empty[key] = d[key][:, :0]
    out.append(("input_ids: 0-length sequences", empty))
    put("attention_mask: float", "attention_mask", d["attention_mask"].float())
    put("attention_mask: 2s", "attention_mask", d["attention_mask"].long() * 2)
    put("attention_mask: shape", "attention_mask", torch.ones(rows, width + 1, dtype=torch.bool))
    put("attention_mask: on another device", "attention_mask", d["attention_mask"].to("meta"))
    nowhere = dict(d)
    nowhere["attention_mask"] = d["attention_mask"].clone()
    nowhere["attention_mask"][0] = False
    for key, pad in (("loss_mask", 0), ("versions", -1)):
        if key in d:
            nowhere[key] = d[key].clone()
            nowhere[key][0] = pad
    out.append(("attention_mask: a row attending nowhere", nowhere))
    for key in ("loss_mask", "versions"):
        if key in d:
            put(f"{key}: float", key, d[key].float())
            put(f"{key}: shape", key, d[key][:, :-1] if width > 1 else d[key][:-1])
    if "loss_mask" in d:
        put("loss_mask: value 2", "loss_mask", torch.full_like(d["loss_mask"], 2))
    if "loss_mask" in d and "versions" in d:
        # Every generated row has a prompt, so some position has loss_mask 0.
        put("versions: a version where loss_mask is 0", "versions", torch.where(d["loss_mask"] == 0, 5, d["versions"]))
    if "logprobs" in d:
        put("logprobs: int", "logprobs", d["logprobs"].long())
        put("logprobs: positive", "logprobs", torch.ones_like(d["logprobs"]))
        put("logprobs: nan", "logprobs", torch.full_like(d["logprobs"], float("nan")))
    if "rewards" in d:
        put("rewards: 0-d", "rewards", d["rewards"][0])
        put("rewards: 2-D", "rewards", d["rewards"][:, None])
        put("rewards: int", "rewards", d["rewards"].long())
        put("rewards: inf", "rewards", torch.full_like(d["rewards"], float("inf")))
        put("rewards: beyond float32", "rewards", torch.full(d["rewards"].shape, 1e39, dtype=torch.float64))
    if "is_truncated" in d:
        put("is_truncated: int", "is_truncated", d["is_truncated"].long())
        put("is_truncated: shape", "is_truncated", torch.zeros(rows + 1, dtype=torch.bool))
    put("rollout_reward: bool", "rollout_reward", True)
    put("rollout_reward: nan", "rollout_reward", float("nan"))
    put("rollout_reward: beyond float32", "rollout_reward", -1e39)
    put("rollout_reward: vector", "rollout_reward", torch.zeros(2))
    put("rollout_reward: str", "rollout_reward", "1.0")
    put("rollout_group: wrong rows", "rollout_group", RolloutGroup((rows + 1,)))
    put("extra_tensor: rows", "extra_tensor", torch.zeros(rows + 1))
    put("extra_list: rows", "extra_list", list(range(rows + 1)))
    return out


@st.composite
def corrupted_trajectory_dicts(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid trajectory dict with exactly one rule broken, and ``"<key>: <what was broken>"``."""
    valid = draw(trajectories()).to_dict()
    valid.pop("rollout_group", None)  # keep rollout_reward corruptions unambiguous
    return draw(st.sampled_from(_corruptions(valid)))

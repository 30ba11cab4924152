"""``rollout-trio inspect DUMP_DIR``: what a trajectory dump holds, in the terminal or as one HTML page."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from .._limits import MAX_DUMP_LINE_BYTES as MAX_LINE_BYTES
from .._terminal import terminal_safe
from ._checkpoint import load_tokenizer
from ._common import (
    CommandError,
    Parser,
    check_dump_path,
    positive_int,
    run_command,
    starting,
)

if TYPE_CHECKING:  # at run time the reader loads inside _inspect: `inspect --help` imports no torch
    from ..executor import DumpRecord

__all__ = ["DumpSummary", "VersionSummary", "histogram", "inspect_main", "summarize"]


def histogram(values: Sequence[float], lo: float, hi: float, bins: int) -> list[int]:
    """Counts of ``values`` in ``bins`` equal bins over ``[lo, hi]`` (the last bin closed)."""
    counts = [0] * bins
    width = (hi - lo) / bins
    for v in values:
        # round() first: 0.3 / 0.1 is 2.9999999999999996, which belongs in bin 3
        k = bins - 1 if width <= 0 else min(bins - 1, max(0, math.floor(round((v - lo) / width, 9))))
        counts[k] += 1
    return counts


def number(x: float, spec: str) -> str:
    """``format(x, spec)``, never "-0" (nor "-0.000") for a value that rounds to zero."""
    text = format(x, spec)
    return text.removeprefix("-") if math.isfinite(x) and float(text) == 0 else text


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    mean = math.fsum(values) / len(values)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def completion_tokens(r: DumpRecord) -> int:
    """Generated tokens of a row (counted from ``version_rle``, which every dump line has)."""
    return sum(count for _, count in r.version_rle)


@attrs.frozen
class VersionSummary:
    """The rows of one ``(scope, version)`` directory."""

    is_eval: bool
    version: int
    rows: int
    tasks: int
    accepted: int
    truncated: int
    reward_mean: float
    reward_std: float
    reward_hist: list[int]
    length_mean: float
    nonfinite: int = 0  # rows whose reward is NaN or infinite (left out of mean, std and histogram)


@attrs.frozen
class DumpSummary:
    """Everything ``inspect`` prints; rewards are raw (``original_reward`` where recorded)."""

    rows: int
    tasks: int
    versions: list[VersionSummary]
    reward_range: tuple[float, float]
    length_range: tuple[int, int]
    length_hist: list[int]
    length_bins: tuple[float, float]
    truncation_known: bool
    normalized: bool
    nonfinite: int = 0


def grid_bins(values: Sequence[float], bins: int | None = None, default: int = 10) -> tuple[float, float, int]:
    """``(lo, hi, bins)`` for a histogram of ``values``.

    Values on a regular grid (rewards 0, 0.1, ..., 1; token counts) get one bin centred
    on each grid value, so no bin edge splits them; otherwise ``bins`` (else
    ``default``) equal bins over the range.
    """
    lo, hi = min(values), max(values)
    if lo == hi:
        return lo - 0.5, hi + 0.5, bins or 1
    distinct = sorted(set(values))
    if bins is None and len(distinct) <= 30:
        step = min(b - a for a, b in zip(distinct, distinct[1:]))
        slots = (hi - lo) / step
        if slots <= 40 and all(abs((v - lo) / step - round((v - lo) / step)) < 1e-3 for v in distinct):
            return lo - step / 2, hi + step / 2, round(slots) + 1
    return lo, hi, bins or default


def summarize(records: Sequence[DumpRecord], *, bins: int | None = None) -> DumpSummary:
    """Per-version counts, reward statistics and histograms (shared bins), and lengths.

    A NaN or infinite reward (a dump is data from elsewhere) is counted in ``nonfinite``
    and left out of the means, deviations, ranges and histograms.
    """
    if not records:
        raise ValueError("records: the dump holds no records")
    rewards = [x for x in (r.raw_reward for r in records) if math.isfinite(x)]
    lengths = [completion_tokens(r) for r in records]
    lo_r, hi_r, bins_r = grid_bins(rewards or [0.0], bins)
    lo_l, hi_l, bins_l = grid_bins(lengths, None, 20)
    reward_range = (lo_r, hi_r)
    lo_len, hi_len = min(lengths), max(lengths)
    by_key: dict[tuple[bool, int], list[DumpRecord]] = {}
    for r in records:
        by_key.setdefault((r.is_eval, r.version), []).append(r)
    versions = []
    for (is_eval, version), rows in sorted(by_key.items()):
        values = [r.raw_reward for r in rows if math.isfinite(r.raw_reward)]
        mean, std = _mean_std(values)
        versions.append(
            VersionSummary(
                is_eval=is_eval,
                version=version,
                rows=len(rows),
                tasks=len({r.task_id for r in rows}),
                accepted=sum(r.accepted for r in rows),
                truncated=sum(bool(r.is_truncated) for r in rows),
                reward_mean=mean,
                reward_std=std,
                reward_hist=histogram(values, lo_r, hi_r, bins_r),
                length_mean=math.fsum(completion_tokens(r) for r in rows) / len(rows),
                nonfinite=len(rows) - len(values),
            )
        )
    return DumpSummary(
        rows=len(records),
        tasks=len({(r.is_eval, r.task_id) for r in records}),
        versions=versions,
        reward_range=reward_range,
        length_range=(lo_len, hi_len),
        length_hist=histogram(lengths, lo_l, hi_l, bins_l),
        length_bins=(lo_l, hi_l),
        truncation_known=any(r.is_truncated is not None for r in records),
        normalized=any(r.original_reward is not None for r in records),
        nonfinite=len(records) - len(rewards),
    )


_BARS = " ▁▂▃▄▅▆▇█"


def sparkline(counts: Sequence[int]) -> str:
    """Counts as block characters scaled to the largest."""
    top = max(counts, default=0) or 1
    return "".join(_BARS[0 if c == 0 else max(1, round(c / top * 8))] for c in counts)


def _percentile(sorted_values: Sequence[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def format_summary(summary: DumpSummary, records: Sequence[DumpRecord], source: str) -> str:
    """The terminal report."""
    rewards = [x for x in (r.raw_reward for r in records) if math.isfinite(x)] or [math.nan]
    lo, hi, bins = min(rewards), max(rewards), len(summary.versions[0].reward_hist)
    out = [f"{terminal_safe(source)}: {summary.rows} rows from {summary.tasks} tasks"]
    if summary.normalized:
        out.append("rewards are raw (original_reward, before normalization)")
    if summary.nonfinite:
        out.append(f"{summary.nonfinite} rows have a NaN or infinite reward: counted, left out of the reward statistics")
    header = f"{'scope':<13}{'version':>7}{'tasks':>7}{'rows':>7}{'accepted':>9}{'rejected':>9}{'truncated':>10}{'reward':>9}{'std':>7}{'tokens':>8}  reward histogram ({bins} bins, {lo:.3g} .. {hi:.3g})"
    out += ["", header, "-" * len(header)]
    for v in summary.versions:
        shown = str(v.truncated) if summary.truncation_known else "-"
        out.append(
            f"{'eval-rollout' if v.is_eval else 'rollout':<13}{v.version:>7}{v.tasks:>7}{v.rows:>7}{v.accepted:>9}"
            f"{v.rows - v.accepted:>9}{shown:>10}{number(v.reward_mean, '.3f'):>9}{number(v.reward_std, '.3f'):>7}{v.length_mean:>8.1f}  "
            f"|{sparkline(v.reward_hist)}|"
        )
    lengths = sorted(completion_tokens(r) for r in records)
    accepted = sum(v.accepted for v in summary.versions)
    truncated = sum(v.truncated for v in summary.versions)
    a, b = summary.length_range
    out += [
        "",
        f"completion tokens: min {a}  median {_percentile(lengths, 0.5)}  p90 {_percentile(lengths, 0.9)}  max {b}"
        f"   |{sparkline(summary.length_hist)}|",
        f"accepted {accepted}, rejected {summary.rows - accepted}"
        + (f", truncated {truncated}" if summary.truncation_known else ", truncation not recorded"),
    ]
    return "\n".join(out)


def _parser() -> Parser:
    p = Parser(
        "rollout-trio inspect",
        "Summarize a trajectory dump: rows per version, reward statistics, lengths, rejections.",
    )
    p.add_argument("dump_dir", metavar="DUMP_DIR", help="a dump directory (any level of the layout) or one .jsonl file")
    p.add_argument(
        "--html",
        metavar="OUT.html",
        help="also write one self-contained HTML page with the figures and samples (default: none)",
    )
    p.add_argument("--samples", type=positive_int, default=60, help="rows shown in the page's sample table")
    p.add_argument(
        "--bins",
        type=positive_int,
        default=None,
        help="histogram bins (default: one per value for rewards on a grid, else 10)",
    )
    p.add_argument(
        "--max-line-bytes",
        type=positive_int,
        default=MAX_LINE_BYTES,
        help=f"refuse a dump line longer than this (default: {MAX_LINE_BYTES}); bounds the memory one line takes",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a local tokenizer directory to show completions token by token (default: none)",
    )
    return p


def _inspect(args: argparse.Namespace) -> int:
    check_dump_path(args.dump_dir)  # before the reader and torch load: this answers at once
    with starting():
        from ..executor._dump import iter_dump

        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer is not None else None
    # Statistics from light records (no tokens or texts), so a big dump fits in memory;
    # only the rows the page shows are read in full, in a second pass.
    records = list(iter_dump(args.dump_dir, light=True, max_line_bytes=args.max_line_bytes))
    if not records:
        raise CommandError(f"{args.dump_dir}: no dump records there")
    summary = summarize(records, bins=args.bins)
    print(format_summary(summary, records, args.dump_dir))
    if args.html:
        from ._inspect_html import pick_samples, render_page

        shown = list(
            iter_dump(args.dump_dir, only=set(pick_samples(records, args.samples)), max_line_bytes=args.max_line_bytes)
        )
        page = render_page(records, summary, shown, source=args.dump_dir, tokenizer=tokenizer)
        Path(args.html).write_text(page, encoding="utf-8")
        print(f"wrote {args.html}")
    return 0


def inspect_main(argv: Sequence[str]) -> int:
    """Entry point of ``rollout-trio inspect``; returns the exit status."""
    return run_command("rollout-trio inspect", _parser(), argv, _inspect)

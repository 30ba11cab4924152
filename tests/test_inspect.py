"""`rollout-trio inspect`: the terminal summary, the HTML page's figures and samples, escaping, a real browser."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from rollout_trio.cli import main
from rollout_trio.cli._inspect import grid_bins, histogram, inspect_main, summarize
from rollout_trio.executor import read_dump
from rollout_trio.models import byte_tokenizer

from .dump_helpers import write_dump_sync


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dump")
    write_dump_sync(root, groups=10, group_size=4, versions=4, normalize=True)
    return root


class Page(HTMLParser):
    """Every element with its attributes and the text inside it, in document order."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[dict] = []
        self._open: list[dict] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        el = {"tag": tag, "attrs": dict(attrs), "text": ""}
        self.elements.append(el)
        if tag not in ("meta", "input", "br", "circle", "line", "rect", "polygon", "polyline"):
            self._open.append(el)

    def handle_endtag(self, tag):
        while self._open:
            if self._open.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        for el in self._open:
            el["text"] += data

    def find(self, tag=None, **attrs) -> list[dict]:
        return [
            e for e in self.elements
            if (tag is None or e["tag"] == tag) and all(e["attrs"].get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]


def render(dump: Path, tmp_path: Path, *extra: str) -> tuple[str, Page]:
    out = tmp_path / "page.html"
    assert inspect_main([str(dump), "--html", str(out), *extra]) == 0
    text = out.read_text(encoding="utf-8")
    return text, Page(text)


# ---------------------------------------------------------------- summary numbers


def test_histogram_bins_values_and_closes_the_last_bin():
    assert histogram([0.0, 0.25, 0.5, 0.99, 1.0], 0.0, 1.0, 4) == [1, 1, 1, 2]
    assert histogram([0.3], 0.0, 1.0, 10) == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]  # 0.3 / 0.1 < 3 in floats


def test_rewards_on_a_grid_get_one_bin_per_value():
    assert grid_bins([0.0, 1.0, 1.0]) == (-0.5, 1.5, 2)
    lo, hi, bins = grid_bins([0.0, 0.1, 0.30000001, 1.0])
    assert bins == 11 and lo == pytest.approx(-0.05) and hi == pytest.approx(1.05)
    assert grid_bins([0.0, 0.123, 0.5, 1.0]) == (0.0, 1.0, 10)  # not a grid
    assert grid_bins([0.0, 0.1, 1.0], bins=4) == (0.0, 1.0, 4)  # an explicit count wins


def test_summary_matches_the_records(dump_dir):
    records = read_dump(dump_dir)
    summary = summarize(records)
    assert summary.rows == len(records) == 40 and summary.tasks == 10 and summary.normalized
    for v in summary.versions:
        rows = [r for r in records if r.version == v.version and r.is_eval == v.is_eval]
        raw = [r.original_reward for r in rows]
        assert v.rows == len(rows) == sum(v.reward_hist)
        assert v.reward_mean == pytest.approx(statistics.fmean(raw))
        assert v.reward_std == pytest.approx(statistics.pstdev(raw))
        assert v.accepted == sum(r.accepted for r in rows) and v.tasks == len({r.task_id for r in rows})
    assert sum(v.rows - v.accepted for v in summary.versions) == 8  # tasks 4 and 9 were filter-rejected


def test_terminal_summary(dump_dir, capsys):
    assert inspect_main([str(dump_dir)]) == 0
    out = capsys.readouterr().out
    records = read_dump(dump_dir)
    assert f"{len(records)} rows from 10 tasks" in out
    for v in summarize(records).versions:
        row = next(line for line in out.splitlines() if line.startswith("rollout ") and line.split()[1] == str(v.version))
        cols = row.split()
        assert [int(c) for c in cols[2:7]] == [v.tasks, v.rows, v.accepted, v.rows - v.accepted, v.truncated]
        assert float(cols[7]) == pytest.approx(v.reward_mean, abs=6e-4)
    assert "accepted 32, rejected 8, truncated" in out
    assert "completion tokens: min" in out


def test_usage_and_runtime_errors_are_one_line(tmp_path, capsys):
    assert main(["inspect"]) == 2
    assert main(["inspect", str(tmp_path), "--samples", "0"]) == 2
    assert inspect_main([str(tmp_path / "missing")]) == 1
    assert inspect_main([str(tmp_path)]) == 1  # a directory without records
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("rollout-trio inspect: ") for line in err)
    assert "does not exist" in err[2] and "no dump records" in err[3]


# ---------------------------------------------------------------- the page


def test_page_is_self_contained(dump_dir, tmp_path):
    text, page = render(dump_dir, tmp_path)
    assert not page.find("link") and not page.find("img") and not page.find("iframe")
    assert all("src" not in e["attrs"] for e in page.elements)
    assert "http://" not in text and "https://" not in text and "@import" not in text and "url(" not in text
    assert len(page.find("script")) == 1 and len(page.find("style")) == 1


def test_reward_histograms_hold_each_versions_rewards(dump_dir, tmp_path):
    _, page = render(dump_dir, tmp_path)
    records = read_dump(dump_dir)
    panels = page.find("svg", data_figure="reward-histogram")
    assert sorted(int(p["attrs"]["data-version"]) for p in panels) == sorted({r.version for r in records})
    bars = [e for e in page.elements if e["tag"] == "rect" and "data-count" in e["attrs"]]
    # Bars follow their panel in document order: regroup them by the preceding panel.
    by_version: dict[int, list[dict]] = {}
    current = None
    for e in page.elements:
        if e["tag"] == "svg":
            current = int(e["attrs"]["data-version"]) if e["attrs"].get("data-figure") == "reward-histogram" else None
        elif e in bars and current is not None:
            by_version.setdefault(current, []).append(e["attrs"])
    for version, attrs in by_version.items():
        raw = [r.original_reward for r in records if r.version == version]
        for bar in attrs:
            lo, hi = float(bar["data-lo"]), float(bar["data-hi"])
            last = bar is attrs[-1]
            inside = [x for x in raw if lo <= x < hi or (last and x == hi)]
            assert int(bar["data-count"]) == len(inside), (version, lo, hi)
        assert sum(int(b["data-count"]) for b in attrs) == len(raw)


def test_reward_over_versions_points_are_the_means(dump_dir, tmp_path):
    _, page = render(dump_dir, tmp_path)
    records = read_dump(dump_dir)
    points = page.find("circle", data_scope="rollout")
    assert [int(p["attrs"]["data-version"]) for p in points] == sorted({r.version for r in records})
    for p in points:
        raw = [r.original_reward for r in records if r.version == int(p["attrs"]["data-version"])]
        assert float(p["attrs"]["data-mean"]) == pytest.approx(statistics.fmean(raw))
        assert float(p["attrs"]["data-std"]) == pytest.approx(statistics.pstdev(raw))
        assert int(p["attrs"]["data-rows"]) == len(raw)


def test_length_histogram_counts_every_row(dump_dir, tmp_path):
    _, page = render(dump_dir, tmp_path)
    records = read_dump(dump_dir)
    lengths = [sum(r.tokens.loss_mask) for r in records]
    svg_at = page.elements.index(page.find("svg", data_figure="length-histogram")[0])
    bars = [e["attrs"] for e in page.elements[svg_at:] if e["tag"] == "rect"][: len(set(range(min(lengths), max(lengths) + 1)))]
    for bar in bars:
        centre = (float(bar["data-lo"]) + float(bar["data-hi"])) / 2  # token counts get one bin per count
        assert int(bar["data-count"]) == lengths.count(round(centre))


def test_sample_tokens_are_coloured_by_version_with_logprob_hovers(dump_dir, tmp_path):
    _, page = render(dump_dir, tmp_path, "--samples", "12")
    records = {(r.task_id, r.sample_idx): r for r in read_dump(dump_dir)}
    rows = page.find("tr", **{"class": "sample"})
    assert len(rows) == 12
    assert len({row["attrs"]["data-version"] for row in rows}) == 4  # spread over the versions
    i = 0
    for row in rows:
        start = page.elements.index(row, i)
        end = next((k for k in range(start + 1, len(page.elements)) if page.elements[k]["tag"] == "tr"), len(page.elements))
        i = end
        task = int(row["attrs"]["data-task"])
        sample = int(row["attrs"]["data-sample"])
        r = records[(task, sample)]
        assert float(row["attrs"]["data-reward"]) == r.original_reward
        spans = [e for e in page.elements[start:end] if e["tag"] == "span" and "data-lp" in e["attrs"]]
        generated = [k for k in range(r.prompt_len, r.seqlen) if r.tokens.loss_mask[k] == 1]
        assert len(spans) == len(generated) > 0
        tok = byte_tokenizer()
        for span, k in zip(spans, generated):
            assert int(span["attrs"]["data-v"]) == r.tokens.versions[k]
            assert float(span["attrs"]["data-lp"]) == r.tokens.logprobs[k]
            assert f"logprob {r.tokens.logprobs[k]:.4f}" in span["attrs"]["title"]
            assert span["text"] == tok.decode([r.tokens.input_ids[k]], skip_special_tokens=False)


HOSTILE = '<script>alert(1)</script></script>"><img src=x onerror=alert(2)>&amp;\x00\x1b[31m\ud800\u2028end'


def write_hostile_dump(root: Path) -> Path:
    """A dump whose texts (and, through the byte tokenizer, whose tokens) try to break the page."""
    tok = byte_tokenizer()
    d = root / "exp" / "trial" / "rollout" / "3"
    d.mkdir(parents=True)
    prompt_ids = tok.encode("<b>prompt</b>", add_special_tokens=False)
    completion_ids = tok.encode("</script><svg onload=alert(3)>\x07", add_special_tokens=False)
    ids = prompt_ids + completion_ids
    base = {
        "task_id": 0, "sample_idx": 0, "seqlen": len(ids), "prompt_len": len(prompt_ids), "head_version": 3,
        "tail_version": 3, "version_rle": [[3, len(completion_ids)]], "reward": 1.0,
        "prompt": tok.decode(prompt_ids, skip_special_tokens=False),
        "completion": tok.decode(completion_ids, skip_special_tokens=False), "accepted": True,
        "tokens": {"input_ids": ids, "loss_mask": [0] * len(prompt_ids) + [1] * len(completion_ids),
                   "logprobs": [0.0] * len(prompt_ids) + [-0.5] * len(completion_ids),
                   "versions": [-1] * len(prompt_ids) + [3] * len(completion_ids)},
    }
    plain = {**base, "sample_idx": 1, "prompt": HOSTILE, "completion": HOSTILE, "tokens": None}
    (d / "0.jsonl").write_text(json.dumps(base) + "\n" + json.dumps(plain) + "\n")
    return root


def test_hostile_text_is_escaped(tmp_path):
    dump = write_hostile_dump(tmp_path / "dump")
    text, page = render(dump, tmp_path, "--samples", "5")
    assert len(page.find("script")) == 1 and not page.find("img")
    assert not [e for e in page.find("b") if "prompt" in e["text"]]  # the prompt's <b> stayed text
    assert [e for e in page.elements if e["tag"] == "svg" and "onload" in e["attrs"]] == []
    assert "alert" not in page.find("script")[0]["text"]
    assert not any(ch in text for ch in "\x00\x1b\x07")
    text.encode("utf-8")  # no lone surrogate reached the file
    cells = [e["text"] for e in page.find("div", **{"class": "plain"})]
    assert any('</script>"><img src=x onerror=alert(2)>&amp;\\x00\\x1b[31m\\ud800' in c for c in cells)
    tokens = "".join(e["text"] for e in page.find("span") if "data-lp" in e["attrs"])
    assert tokens == "</script><svg onload=alert(3)>\\x07"


# ---------------------------------------------------------------- a real browser


def _browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def test_page_renders_in_headless_chromium(dump_dir, tmp_path):
    browser = _browser()
    if browser is None:
        print("no chromium on PATH: the page is checked by parsing only")
        pytest.skip("no chromium binary on PATH (apt-get install chromium to run this test)")
    image = pytest.importorskip("PIL.Image", reason="Pillow is needed to look at the screenshot")
    _, _ = render(dump_dir, tmp_path)
    page, png = tmp_path / "page.html", tmp_path / "page.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert 'data-ready="1"' in dom.stdout  # the page's script ran to its end without an error
    subprocess.run([browser, *flags, "--window-size=1400,1600", f"--screenshot={png}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    with image.open(png) as shot:
        assert shot.size == (1400, 1600)
        rgb = shot.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200  # text, charts and version colours, not a blank page
    most = max(count for count, _ in colours)
    assert most < 0.8 * 1400 * 1600  # no single colour covers the page
    # The version colours of the figures are on screen (the reward-over-versions points).
    assert sum(1 for _, (r, g, b) in colours if abs(r - g) > 60 or abs(g - b) > 60) > 20


def test_samples_and_panels_spread_over_many_versions():
    from rollout_trio.cli._inspect_html import pick_samples, spread
    from rollout_trio.executor import DumpRecord

    def rec(version):
        return DumpRecord(task_id=version, sample_idx=0, seqlen=2, prompt_len=1, head_version=version, tail_version=version,
                          version_rle=((version, 1),), reward=0.0, prompt="", completion="", version=version, is_eval=False)

    records = [rec(v) for v in range(200) for _ in range(3)]
    picked = pick_samples(records, 60)
    assert len(picked) == len(set(picked)) == 60
    versions = [records[k].version for k in picked]
    assert versions[0] == 0 and versions[-1] == 199 and len(set(versions)) == 60  # one row of each of 60 versions
    few = pick_samples(records[:9], 7)  # 3 versions of 3 rows: 3 + 2 + 2
    assert [records[k].version for k in few] == [0, 0, 0, 1, 1, 2, 2]
    assert spread(list(range(10)), 4) == [0, 3, 6, 9] and spread([1, 2], 5) == [1, 2]


# ---------------------------------------------------------------- readable figures


def write_reward_dump(root: Path, rewards: dict[int, list[float]], *, tokens: dict[int, list[int]] | None = None) -> Path:
    """A dump of plain rows (no token ids): ``rewards[version]`` one row each, with
    ``tokens[version]`` completion tokens (default 3)."""
    for version, values in rewards.items():
        d = root / "exp" / "trial" / "rollout" / str(version)
        d.mkdir(parents=True)
        lines = []
        for k, reward in enumerate(values):
            n = (tokens or {}).get(version, [3] * len(values))[k]
            lines.append(json.dumps({
                "task_id": k, "sample_idx": 0, "seqlen": 2 + n, "prompt_len": 2, "head_version": version,
                "tail_version": version, "version_rle": [[version, n]], "reward": reward,
                "prompt": "p", "completion": "c" * n, "accepted": True, "tokens": None,
            }))
        (d / "0.jsonl").write_text("\n".join(lines) + "\n")
    return root


def tick_labels(page: Page, figure: str, *, axis: str) -> list[str]:
    """The tick labels of the first ``figure``: ``axis`` "y" (right-aligned) or "x" (centred)."""
    at = page.elements.index(page.find("svg", data_figure=figure)[0])
    end = next(k for k in range(at + 1, len(page.elements)) if page.elements[k]["tag"] == "svg" or k == len(page.elements) - 1)
    anchor = "end" if axis == "y" else "middle"
    return [e["text"] for e in page.elements[at:end]
            if e["tag"] == "text" and e["attrs"].get("class") == "tick" and e["attrs"].get("text-anchor") == anchor]


def test_count_axes_have_whole_number_ticks(tmp_path):
    # One or two rows per bin: the old ticks were 0, 0.5, 1 (and 0, 2.5, 5 for longer axes).
    dump = write_reward_dump(tmp_path / "dump", {0: [0.0, 1.0, 1.0], 1: [0.0, 0.0, 1.0]}, tokens={0: [1, 2, 3], 1: [4, 5, 7]})
    _, page = render(dump, tmp_path)
    for figure, axis in [("reward-histogram", "y"), ("length-histogram", "y"), ("length-histogram", "x")]:
        labels = tick_labels(page, figure, axis=axis)
        assert labels and all(label.lstrip("-").isdigit() for label in labels), (figure, axis, labels)


def test_ticks_of_a_count_axis_are_integers_at_every_scale():
    from rollout_trio.cli._inspect_html import _ticks

    for hi in (1, 2, 3, 7, 13, 99, 1001):
        ticks = _ticks(0, hi, 3, integer=True)
        assert ticks[0] == 0 and ticks[-1] <= hi and len(ticks) >= 2 and all(t == int(t) for t in ticks), (hi, ticks)
    assert 0.5 in _ticks(0, 1, 3)  # a reward axis keeps its fractions


def test_the_std_band_stays_within_the_observed_rewards(tmp_path):
    # 0/1 rewards: mean 0.25 ± 0.43 reaches below 0, mean 0.75 ± 0.43 above 1.
    dump = write_reward_dump(tmp_path / "dump", {0: [0.0, 0.0, 0.0, 1.0], 1: [0.0, 1.0, 1.0, 1.0], 2: [0.0, 1.0, 0.0, 1.0]})
    text, page = render(dump, tmp_path)
    svg = text[text.index('data-figure="reward-over-versions"'):]
    svg = svg[: svg.index("</svg>")]
    # The plot maps rewards to y linearly: recover the y of reward 0 and 1 from the means.
    points = page.find("circle", data_scope="rollout")
    (m0, y0), (m1, y1) = [(float(p["attrs"]["data-mean"]), float(p["attrs"]["cy"])) for p in points[:2]]
    y_of = lambda reward: y0 + (reward - m0) * (y1 - y0) / (m1 - m0)  # noqa: E731
    band = page.find("polygon", **{"class": "band train"})[0]["attrs"]["points"]
    ys = [float(xy.split(",")[1]) for xy in band.split()]
    assert max(ys) <= y_of(0.0) + 0.01 and min(ys) >= y_of(1.0) - 0.01, (ys, y_of(0.0), y_of(1.0))
    assert "<polygon" in svg


def test_one_version_is_a_point_with_a_whisker_and_its_numbers(tmp_path):
    dump = write_reward_dump(tmp_path / "dump", {5: [0.0, 1.0, 1.0, 1.0]})
    text, page = render(dump, tmp_path)
    at = text.index('data-figure="reward-over-versions"')
    svg = text[at : text.index("</svg>", at)]
    assert "<polygon" not in svg and "<polyline" not in svg  # no band or line through one point
    assert "one version: no trend" in svg
    whisker = page.find("g", **{"class": "whisker train"})
    assert len(whisker) == 1
    assert float(whisker[0]["attrs"]["data-lo"]) == pytest.approx(0.75 - statistics.pstdev([0, 1, 1, 1]))
    assert float(whisker[0]["attrs"]["data-hi"]) == 1.0  # clipped to the largest reward
    labels = [e["text"] for e in page.find("text", **{"class": "value"})]
    assert labels == ["train v5: mean 0.75 ± 0.433 (4 rows)"]


def test_no_negative_zero_is_printed(tmp_path):
    dump = write_reward_dump(tmp_path / "dump", {0: [-0.0, -0.0], 1: [-0.0, 1.0]})
    text, _ = render(dump, tmp_path)
    import re

    shown = re.sub(r"<[^>]*>", " ", text[text.index("<body>"):])  # what a reader sees (data-* may keep -0.0)
    assert re.findall(r"(?<![\w.#-])-0(?:\.0*)?(?![\d.e])", shown) == []
    assert "· mean 0<" in text  # version 0's panel title


def test_every_numeric_column_sorts_by_a_number(dump_dir, tmp_path):
    _, page = render(dump_dir, tmp_path, "--samples", "12")
    headers = page.find("th")
    numeric = [k for k, e in enumerate(page.find("td")[:7]) if e["attrs"].get("class") == "num"]
    assert [headers[k]["text"] for k in numeric] == ["task", "version", "reward", "tokens"]
    keys = [headers[k]["attrs"].get("data-key") for k in numeric]
    assert None not in keys, keys  # a header without a key does not sort
    records = {(r.task_id, r.sample_idx): r for r in read_dump(dump_dir)}
    for row in page.find("tr", **{"class": "sample"}):
        values = {key: float(row["attrs"][f"data-{key}"]) for key in keys}
        r = records[(int(row["attrs"]["data-task"]), int(row["attrs"]["data-sample"]))]
        assert values["tokens"] == sum(count for _, count in r.version_rle)


def test_the_table_orders_numbers_as_numbers_in_node():
    """The page's sort comparator, run by node: 9 before 10, NaN last (skipped without node)."""
    import re

    from rollout_trio.cli._inspect_html import _JS

    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on PATH")
    order = re.search(r"function order\(x,y\)\{.*?\n  \}", _JS, re.S)
    assert order is not None, "the page has no order(x, y) comparator"
    program = order.group() + '\nconsole.log(JSON.stringify(["10","9","nan","-1.5","2","1e-3"].sort(order)));'
    out = subprocess.run([node, "-e", program], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == ["-1.5", "1e-3", "2", "9", "10", "nan"]


def test_the_terminal_summary_prints_no_negative_zero(tmp_path, capsys):
    """A mean that rounds to zero from below is printed as 0.000."""
    import re

    dump = write_reward_dump(tmp_path / "dump", {0: [-1e-9, 0.0], 1: [-0.0, 1.0]})
    assert inspect_main([str(dump)]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"(?<![\w.])-0\.0+(?![\d])", out) == [], out
    assert " 0.000" in out

"""The page ``rollout-trio inspect --html`` writes: one self-contained file, figures as inline SVG.

Nothing is fetched when the page is viewed (no CDN, no fonts, no images). Every piece of
dump text goes through :func:`esc`, which also makes control characters and lone
surrogates visible, so a hostile completion cannot close a tag or break the file. The
figures carry their numbers as ``data-*`` attributes (the tests read them back).
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from typing import Any, TypeVar

import attrs

from ..executor import DumpRecord
from ._inspect import DumpSummary, completion_tokens, number

__all__ = ["esc", "render_page"]

# C0 and C1 controls (but tab and newline), DEL, and lone surrogates (JSON allows them; UTF-8 does not).
_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def esc(text: str) -> str:
    """``text`` safe as HTML content or a quoted attribute value; controls shown as ``\\xNN``."""
    visible = _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)
    return html.escape(visible, quote=True)


def _num(x: float) -> str:
    return number(x, ".3g") if math.isfinite(x) else "–"


def version_colours(versions: Sequence[int]) -> dict[int, tuple[str, str]]:
    """``version -> (tint, solid)``: blue for the oldest weights through to orange for the newest."""
    ordered = sorted(set(versions))
    out = {}
    for k, v in enumerate(ordered):
        t = k / (len(ordered) - 1) if len(ordered) > 1 else 1.0
        hue = round(215 - 190 * t)
        out[v] = (f"hsl({hue} 85% 86%)", f"hsl({hue} 65% 45%)")
    return out


# ---------------------------------------------------------------- SVG figures


def _ticks(lo: float, hi: float, n: int = 5, *, integer: bool = False) -> list[float]:
    """At most about ``n`` round values in ``[lo, hi]``; whole numbers only if ``integer`` (counts)."""
    span = hi - lo
    step = 10 ** math.floor(math.log10(span / n)) if span > 0 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if integer and (step * m < 1 or step * m != round(step * m)):
            continue  # a count axis has no tick at 0.5 or 2.5
        if span / (step * m) <= n:
            step *= m
            break
    else:
        step = max(step * 10, 1.0) if integer else step * 10
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]


class _Plot:
    """A plot area with linear scales, for hand-built SVG."""

    def __init__(self, width: int, height: int, x: tuple[float, float], y: tuple[float, float], margin: tuple[int, int, int, int] = (14, 14, 34, 46)) -> None:
        self.width, self.height = width, height
        self.top, self.right, self.bottom, self.left = margin
        self.x0, self.x1 = x
        self.y0, self.y1 = y

    def sx(self, x: float) -> float:
        span = (self.x1 - self.x0) or 1.0
        return round(self.left + (x - self.x0) / span * (self.width - self.left - self.right), 2)

    def sy(self, y: float) -> float:
        span = (self.y1 - self.y0) or 1.0
        return round(self.height - self.bottom - (y - self.y0) / span * (self.height - self.top - self.bottom), 2)

    def frame(self, x_label: str, y_label: str, x_ticks: Sequence[tuple[float, str]], y_ticks: Sequence[float]) -> list[str]:
        out = []
        for y in y_ticks:
            out.append(f'<line class="grid" x1="{self.left}" x2="{self.width - self.right}" y1="{self.sy(y)}" y2="{self.sy(y)}"/>')
            out.append(f'<text class="tick" x="{self.left - 6}" y="{self.sy(y) + 4}" text-anchor="end">{_num(y)}</text>')
        base = self.height - self.bottom
        out.append(f'<line class="axis" x1="{self.left}" x2="{self.width - self.right}" y1="{base}" y2="{base}"/>')
        for x, label in x_ticks:
            out.append(f'<text class="tick" x="{self.sx(x)}" y="{base + 15}" text-anchor="middle">{esc(label)}</text>')
        out.append(f'<text class="label" x="{(self.left + self.width - self.right) / 2}" y="{self.height - 4}" text-anchor="middle">{esc(x_label)}</text>')
        out.append(f'<text class="label" transform="translate(12 {(self.top + base) / 2}) rotate(-90)" text-anchor="middle">{esc(y_label)}</text>')
        return out

    def svg(self, body: list[str], figure: str, title: str) -> str:
        return (
            f'<svg class="fig" data-figure="{figure}" viewBox="0 0 {self.width} {self.height}" width="{self.width}" '
            f'height="{self.height}" role="img" aria-label="{esc(title)}">' + "".join(body) + "</svg>"
        )


def reward_over_versions(
    summary: DumpSummary, colours: dict[int, tuple[str, str]], *, bounds: tuple[float, float] | None = None
) -> str:
    """Mean raw reward per version with a ±1 std band; eval rollouts dashed.

    The band is clipped to ``bounds``, the rewards' observed ``(min, max)``: a std band of
    0/1 rewards would otherwise reach below 0 and above 1. A dump of one version has no
    trend to draw: its mean is a point with a ±1 std whisker and its numbers as a label.
    """
    lo_r, hi_r = bounds if bounds is not None else (-math.inf, math.inf)
    finite = [v for v in summary.versions if math.isfinite(v.reward_mean)]  # NaN/inf rewards are left out
    if not finite:
        return '<p class="note">no finite reward to draw</p>'
    summary = attrs.evolve(summary, versions=finite)

    def clip(y: float) -> float:
        return min(max(y, lo_r), hi_r)

    versions = [v.version for v in summary.versions]
    lows = [clip(v.reward_mean - v.reward_std) for v in summary.versions]
    highs = [clip(v.reward_mean + v.reward_std) for v in summary.versions]
    y0, y1 = min(lows), max(highs)
    if y0 == y1:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad = (y1 - y0) * 0.08
    x0, x1 = min(versions), max(versions)
    single = x0 == x1
    if single:
        x0, x1 = x0 - 1, x1 + 1
    plot = _Plot(760, 260, (x0, x1), (y0 - pad, y1 + pad))
    step = max(1, math.ceil(len(set(versions)) / 16))
    x_ticks = [(v, str(v)) for v in sorted(set(versions))[::step]]
    body = plot.frame("weight version", "reward (mean ± std)", x_ticks, _ticks(y0 - pad, y1 + pad))
    radius = 5 if len(versions) <= 40 else 3
    if single:
        body.append(
            f'<text class="label" x="{plot.width - plot.right}" y="{plot.top + 4}" text-anchor="end">'
            "one version: no trend to draw</text>"
        )
    for is_eval in (False, True):
        series = [v for v in summary.versions if v.is_eval == is_eval]
        if not series:
            continue
        kind = "eval" if is_eval else "train"
        if single:
            v = series[0]
            x = plot.sx(v.version) + (12 if is_eval else 0)  # train and eval side by side
            top, bottom = plot.sy(clip(v.reward_mean + v.reward_std)), plot.sy(clip(v.reward_mean - v.reward_std))
            body.append(
                f'<g class="whisker {kind}" data-lo="{clip(v.reward_mean - v.reward_std)!r}" '
                f'data-hi="{clip(v.reward_mean + v.reward_std)!r}">'
                f'<line x1="{x}" x2="{x}" y1="{top}" y2="{bottom}"/><line x1="{x - 8}" x2="{x + 8}" y1="{top}" y2="{top}"/>'
                f'<line x1="{x - 8}" x2="{x + 8}" y1="{bottom}" y2="{bottom}"/></g>'
            )
            body.append(
                f'<text class="value" x="{x + 14}" y="{plot.sy(v.reward_mean) + (18 if is_eval else 4)}">'
                f"{kind} v{v.version}: mean {_num(v.reward_mean)} ± {_num(v.reward_std)} ({v.rows} rows)</text>"
            )
        else:
            upper = [f"{plot.sx(v.version)},{plot.sy(clip(v.reward_mean + v.reward_std))}" for v in series]
            lower = [f"{plot.sx(v.version)},{plot.sy(clip(v.reward_mean - v.reward_std))}" for v in reversed(series)]
            body.append(f'<polygon class="band {kind}" points="{" ".join(upper + lower)}"/>')
            line = " ".join(f"{plot.sx(v.version)},{plot.sy(v.reward_mean)}" for v in series)
            body.append(f'<polyline class="mean {kind}" points="{line}"/>')
        for v in series:
            x = plot.sx(v.version) + (12 if single and is_eval else 0)
            body.append(
                f'<circle class="pt {kind}" cx="{x}" cy="{plot.sy(v.reward_mean)}" r="{radius}" '
                f'fill="{colours[v.version][1]}" data-scope="{"eval-rollout" if is_eval else "rollout"}" data-version="{v.version}" '
                f'data-mean="{v.reward_mean!r}" data-std="{v.reward_std!r}" data-rows="{v.rows}">'
                f"<title>{kind} v{v.version}: mean {_num(v.reward_mean)} ± {_num(v.reward_std)} over {v.rows} rows</title></circle>"
            )
    return plot.svg(body, "reward-over-versions", "mean reward per weight version")


def bar_histogram(counts: Sequence[int], lo: float, hi: float, *, figure: str, colour: str, title: str, x_label: str,
                  width: int = 300, height: int = 170, extra: str = "", integer_x: bool = False) -> str:
    """Bars over equal bins of ``[lo, hi]``, each carrying its bin and count; the count axis
    has whole-number ticks, and so has the x axis if ``integer_x`` (token counts)."""
    plot = _Plot(width, height, (lo, hi), (0, max(max(counts, default=0), 1)), margin=(24, 10, 34, 40))
    edges = [lo + (hi - lo) * k / len(counts) for k in range(len(counts) + 1)]
    x_ticks = [(t, _num(t)) for t in _ticks(lo, hi, 4, integer=integer_x)]
    body = [f'<text class="panel-title" x="{plot.left}" y="15">{esc(title)}</text>']
    body += plot.frame(x_label, "rows", x_ticks, _ticks(0, max(max(counts, default=0), 1), 3, integer=True))
    for k, c in enumerate(counts):
        x, w = plot.sx(edges[k]), plot.sx(edges[k + 1]) - plot.sx(edges[k])
        y = plot.sy(c)
        body.append(
            f'<rect class="bar" x="{x + 1}" y="{y}" width="{max(w - 2, 1)}" height="{round(plot.sy(0) - y, 2)}" fill="{colour}" '
            f'data-bin="{k}" data-lo="{edges[k]!r}" data-hi="{edges[k + 1]!r}" data-count="{c}">'
            f"<title>[{_num(edges[k])}, {_num(edges[k + 1])}{']' if k == len(counts) - 1 else ')'}: {c} rows</title></rect>"
        )
    return plot.svg(body, figure, title).replace("<svg ", f"<svg {extra} ", 1) if extra else plot.svg(body, figure, title)


# ---------------------------------------------------------------- samples


def _verified_tokenizer(records: Sequence[DumpRecord], tokenizer: Any) -> Any:
    """``tokenizer`` (or the built-in byte tokenizer) if it reproduces the dumped completions, else None."""
    candidates = [tokenizer] if tokenizer is not None else []
    if tokenizer is None:
        from ..models import byte_tokenizer

        candidates.append(byte_tokenizer())
    probe = [r for r in records if r.tokens is not None][:8]
    for tok in candidates:
        try:
            if probe and all(tok.decode(list(r.tokens.input_ids[r.prompt_len:]), skip_special_tokens=False) == r.completion for r in probe if r.tokens):
                return tok
        except Exception:  # a tokenizer that cannot decode these ids is simply not the right one
            continue
    return None


T = TypeVar("T")

#: Reward histogram panels at most (a long run has hundreds of versions).
MAX_PANELS = 24


def spread(items: Sequence[T], n: int) -> list[T]:
    """``items`` if there are at most ``n``, else ``n`` of them evenly spaced, first and last included."""
    if len(items) <= n:
        return list(items)
    if n == 1:
        return [items[-1]]
    return [items[round(k * (len(items) - 1) / (n - 1))] for k in range(n)]


def pick_samples(records: Sequence[DumpRecord], n: int) -> list[int]:
    """Positions of up to ``n`` rows spread evenly over the versions (and within each version)."""
    by_version: dict[tuple[bool, int], list[int]] = {}
    for k, r in enumerate(records):
        by_version.setdefault((r.is_eval, r.version), []).append(k)
    keys = spread(sorted(by_version), n)
    out: list[int] = []
    for i, key in enumerate(keys):
        out += spread(by_version[key], n // len(keys) + (1 if i < n % len(keys) else 0))
    return out


def _token_spans(r: DumpRecord, tok: Any, colours: dict[int, tuple[str, str]]) -> str:
    assert r.tokens is not None
    t = r.tokens
    parts = []
    for i in range(r.prompt_len, len(t.input_ids)):
        tid = t.input_ids[i]
        text = tok.decode([tid], skip_special_tokens=False) if tok is not None else f"·{tid}"
        if t.loss_mask[i] != 1:
            parts.append(f'<span class="ctx" title="context (not generated) · id {tid}">{esc(text)}</span>')
            continue
        v = t.versions[i]
        lp = None if t.logprobs is None else t.logprobs[i]
        hover = f"v{v} · logprob {lp:.4f} · p {math.exp(lp):.3f} · id {tid}" if lp is not None else f"v{v} · no logprob · id {tid}"
        low = " low" if lp is not None and lp < math.log(0.1) else ""
        parts.append(
            f'<span class="tok{low}" style="background:{colours.get(v, ("#eee", ""))[0]}" data-v="{v}" '
            f'data-lp="{"" if lp is None else repr(lp)}" title="{esc(hover)}">{esc(text)}</span>'
        )
    return "".join(parts)


def _sample_row(r: DumpRecord, tok: Any, colours: dict[int, tuple[str, str]]) -> str:
    if r.tokens is not None:
        completion = f'<div class="tokens">{_token_spans(r, tok, colours)}</div>'
        if tok is None:
            completion += f'<div class="plain">{esc(r.completion)}</div>'
    else:
        completion = f'<div class="plain">{esc(r.completion)}</div>'
    tail = r.prompt[-160:]
    prompt = (
        f'<details><summary>{"…" if len(r.prompt) > len(tail) else ""}{esc(tail)}</summary>'
        f'<div class="plain">{esc(r.prompt)}</div></details>'
    )
    status = "accepted" if r.accepted else "rejected"
    flags = f'<span class="badge {status}">{status}</span>'
    if r.is_truncated:
        flags += '<span class="badge truncated">truncated</span>'
    scope = "eval-rollout" if r.is_eval else "rollout"
    return (
        f'<tr class="sample" data-task="{r.task_id}" data-sample="{r.sample_idx}" data-version="{r.version}" data-scope="{scope}" data-reward="{r.raw_reward!r}" data-tokens="{completion_tokens(r)}" '
        f'data-accepted="{int(r.accepted)}" data-truncated="{int(bool(r.is_truncated))}">'
        f'<td class="num">{r.task_id}<small>#{r.sample_idx}</small></td>'
        f'<td class="num"><span class="vdot" style="background:{colours[r.version][1]}"></span>{r.version}'
        f'{"<small>eval</small>" if r.is_eval else ""}</td>'
        f'<td class="num">{_num(r.raw_reward)}</td><td class="num">{completion_tokens(r)}</td><td>{flags}</td>'
        f"<td>{prompt}</td><td>{completion}</td></tr>"
    )


# ---------------------------------------------------------------- the page


_CSS = """
:root{--fg:#1d2330;--muted:#667085;--line:#e4e7ec;--bg:#f6f7f9;--card:#fff;--accent:#3b5bdb}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg)}
header{background:#1d2330;color:#fff;padding:22px 32px}
header h1{margin:0;font-size:21px;font-weight:600}
header p{margin:4px 0 0;color:#b8c0cc;font-family:ui-monospace,Menlo,monospace;font-size:12.5px;word-break:break-all}
main{max-width:1320px;margin:0 auto;padding:22px 32px 60px}
h2{font-size:15px;margin:0 0 10px;font-weight:600}
section{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:18px 20px;margin:0 0 18px}
.note{color:var(--muted);font-size:12.5px;margin:-4px 0 10px}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(150px,1fr));gap:12px;background:none;border:0;padding:0}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:12px 16px}
.card b{display:block;font-size:22px;font-weight:600;font-variant-numeric:tabular-nums}
.card span{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.row{display:flex;flex-wrap:wrap;gap:18px;align-items:stretch}.row>section{flex:0 1 auto}.row>section.grow{flex:1 1 640px}
.panels{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,340px));gap:8px 24px}.panels svg.fig{width:100%;height:auto}
svg.fig{max-width:100%;height:auto;font-size:11px}
svg .grid{stroke:#eef0f3}svg .axis{stroke:#98a2b3}
svg .tick{fill:var(--muted)}svg .label{fill:var(--muted);font-size:11.5px}
svg .panel-title{font-weight:600;fill:var(--fg);font-size:12px}
svg .band{fill:#3b5bdb;opacity:.12}svg .band.eval{fill:#c2410c}
svg .mean{fill:none;stroke:#3b5bdb;stroke-width:2}svg .mean.eval{stroke:#c2410c;stroke-dasharray:5 4}
svg .pt{stroke:#fff;stroke-width:1.5}
svg .whisker line{stroke:#3b5bdb;stroke-width:2}svg .whisker.eval line{stroke:#c2410c}svg .value{fill:var(--fg);font-size:12px}
svg .bar:hover,svg .pt:hover{opacity:.75}
.legend{display:flex;flex-wrap:wrap;gap:6px 14px;font-size:12px;color:var(--muted);margin:0 0 12px;align-items:center}
.legend i{display:inline-block;width:14px;height:14px;border-radius:3px;vertical-align:-2px;margin-right:4px}
.controls{display:flex;flex-wrap:wrap;gap:10px 16px;align-items:center;margin:0 0 10px;font-size:13px}
.controls input[type=search]{padding:5px 9px;border:1px solid var(--line);border-radius:6px;min-width:220px}
.controls select{padding:4px 6px;border:1px solid var(--line);border-radius:6px}
table{border-collapse:collapse;width:100%}
th{text-align:left;font-weight:600;font-size:12px;color:var(--muted);border-bottom:1px solid var(--line);padding:6px 8px;cursor:pointer;user-select:none;white-space:nowrap}
th:hover{color:var(--fg)}
td{border-bottom:1px solid var(--line);padding:7px 8px;vertical-align:top}
td.num{font-variant-numeric:tabular-nums;white-space:nowrap}
td small{color:var(--muted);margin-left:3px}
tr.sample:hover{background:#fafbfc}
.vdot{display:inline-block;width:9px;height:9px;border-radius:50%;margin-right:5px}
.badge{display:inline-block;font-size:11px;padding:1px 7px;border-radius:9px;margin:0 4px 2px 0}
.badge.accepted{background:#e6f4ea;color:#1e7a3c}.badge.rejected{background:#fdecea;color:#b42318}
.badge.truncated{background:#fff4e5;color:#b54708}
details summary{cursor:pointer;color:var(--muted);font-family:ui-monospace,Menlo,monospace;font-size:12px;white-space:pre-wrap;word-break:break-word;max-width:330px}
.plain{font-family:ui-monospace,Menlo,monospace;font-size:12px;white-space:pre-wrap;word-break:break-word;color:#344054;margin-top:4px}
.tokens{font-family:ui-monospace,Menlo,monospace;font-size:13px;white-space:pre-wrap;word-break:break-word;line-height:1.75}
.tok{border-radius:3px;padding:1px 0;margin-right:1px;box-shadow:inset 0 -1px 0 rgba(0,0,0,.08)}
.tok:hover{outline:1.5px solid #1d2330}
.tok.low{box-shadow:inset 0 -2px 0 #d92d20}
.ctx{color:#98a2b3;background:#f2f4f7;border-radius:3px}
footer{color:var(--muted);font-size:12px;text-align:center;margin-top:10px}
"""

_JS = """
(function(){
  var table=document.getElementById('samples'), body=table.tBodies[0];
  var q=document.getElementById('q'), ver=document.getElementById('ver'), st=document.getElementById('status');
  function apply(){
    var text=q.value.toLowerCase(), v=ver.value, s=st.value;
    Array.prototype.forEach.call(body.rows,function(tr){
      var ok=(!v||tr.dataset.version===v)&&(!text||tr.textContent.toLowerCase().indexOf(text)>=0)
        &&(!s||(s==='rejected'?tr.dataset.accepted==='0':s==='accepted'?tr.dataset.accepted==='1':tr.dataset.truncated==='1'));
      tr.style.display=ok?'':'none';
    });
  }
  // numbers as numbers (9 before 10); NaN and text after them, text in text order
  function order(x,y){
    var a=Number(x), b=Number(y), na=x===''||isNaN(a), nb=y===''||isNaN(b);
    if(!na&&!nb)return a-b; if(na!==nb)return na?1:-1; return x<y?-1:x>y?1:0;
  }
  [q,ver,st].forEach(function(el){el.addEventListener('input',apply);el.addEventListener('change',apply);});
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th){
    var key=th.dataset.key; if(!key)return; var dir=1;
    th.addEventListener('click',function(){
      var rows=Array.prototype.slice.call(body.rows);
      rows.sort(function(a,b){return order(a.dataset[key],b.dataset[key])*dir;});
      rows.forEach(function(r){body.appendChild(r);}); dir=-dir;
    });
  });
  document.body.dataset.ready='1';
})();
"""


def render_page(
    records: Sequence[DumpRecord], summary: DumpSummary, shown: Sequence[DumpRecord], *, source: str, tokenizer: Any = None
) -> str:
    """The whole HTML page: figures from ``records`` (summarized as ``summary``; they may be
    light records), and a table of the full records ``shown``."""
    colours = version_colours([r.version for r in records])
    accepted = sum(v.accepted for v in summary.versions)
    truncated = sum(v.truncated for v in summary.versions)
    lengths = sorted(completion_tokens(r) for r in records)
    all_rewards = [x for x in (r.raw_reward for r in records) if math.isfinite(x)] or [math.nan]
    mean = math.fsum(all_rewards) / len(all_rewards)
    versions = sorted({r.version for r in records})
    cards = [
        (f"{summary.rows}", "rows"),
        (f"{summary.tasks}", "tasks"),
        (f"{versions[0]}–{versions[-1]}" if len(versions) > 1 else f"{versions[0]}", "weight versions" if len(versions) > 1 else "weight version"),
        (_num(mean), "mean reward" + (" (raw)" if summary.normalized else "")),
        (f"{100 * accepted / summary.rows:.0f}%", "accepted"),
        (f"{100 * truncated / summary.rows:.0f}%" if summary.truncation_known else "–", "truncated"),
        (f"{lengths[len(lengths) // 2]}", "median tokens"),
    ]
    lo, hi = summary.reward_range
    panels = []
    panel_versions = spread(summary.versions, MAX_PANELS)
    for v in panel_versions:
        scope = "eval " if v.is_eval else ""
        panels.append(
            bar_histogram(
                v.reward_hist, lo, hi, figure="reward-histogram", colour=colours[v.version][1],
                title=f"{scope}v{v.version} · {v.rows} rows · mean {_num(v.reward_mean)}", x_label="reward",
                extra=f'data-scope="{"eval-rollout" if v.is_eval else "rollout"}" data-version="{v.version}"',
            )
        )
    a, b = summary.length_range
    length_fig = bar_histogram(summary.length_hist, *summary.length_bins, figure="length-histogram", colour="#667085",
                               title="completion tokens per row", x_label="tokens", width=440, height=260, integer_x=True)
    tok = _verified_tokenizer(shown, tokenizer)
    legend = "".join(
        f'<span><i style="background:{colours[v][0]};border:1px solid {colours[v][1]}"></i>v{v}</span>' for v in spread(versions, 16)
    ) + (f"<span>(colours run from v{versions[0]} to v{versions[-1]})</span>" if len(versions) > 16 else "")
    options = "".join(f'<option value="{v}">v{v}</option>' for v in versions)
    token_note = (
        "Each completion token is coloured by the weight version that generated it; hover a token for its logprob. "
        "Underlined: p &lt; 0.1. Grey: context tokens inside the completion (not generated)."
    )
    if tok is None:
        token_note += " No matching tokenizer (pass --tokenizer DIR): tokens show as ids, with the decoded text below."
    out = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>rollout-trio dump · {esc(source)}</title><style>{_CSS}</style></head><body>",
        f"<header><h1>Trajectory dump</h1><p>{esc(source)}</p></header><main>",
        '<section class="cards">' + "".join(f'<div class="card"><b>{value}</b><span>{label}</span></div>' for value, label in cards) + "</section>",
        '<div class="row"><section class="grow"><h2>Reward over weight versions</h2>',
        '<p class="note">Mean raw reward per version with a ±1 std band (clipped to the smallest and largest reward)'
        + (" (original_reward, before normalization)" if summary.normalized else "")
        + "; eval rollouts dashed.</p>",
        reward_over_versions(summary, colours, bounds=(min(all_rewards), max(all_rewards))),
        "</section>",
        f'<section><h2>Completion length</h2><p class="note">min {a} · median {lengths[len(lengths) // 2]} · max {b} tokens</p>{length_fig}</section></div>',
        f'<section><h2>Reward histograms per version</h2><p class="note">The same {len(summary.versions[0].reward_hist)} bins '
        f'over [{_num(lo)}, {_num(hi)}] in every panel; hover a bar for its count.'
        + (f" {len(panel_versions)} of {len(summary.versions)} versions, evenly spread." if len(panel_versions) < len(summary.versions) else "")
        + "</p>",
        f'<div class="panels">{"".join(panels)}</div></section>',
        f'<section><h2>Samples</h2><p class="note">{len(shown)} of {summary.rows} rows, spread over the versions. {token_note}</p>',
        f'<div class="legend">{legend}</div>',
        '<div class="controls"><input id="q" type="search" placeholder="filter text…">'
        f'<label>version <select id="ver"><option value="">all</option>{options}</select></label>'
        '<label>show <select id="status"><option value="">all rows</option><option value="accepted">accepted</option>'
        '<option value="rejected">rejected</option><option value="truncated">truncated</option></select></label>'
        '<span class="note" style="margin:0">click a numeric header to sort</span></div>',
        '<table id="samples"><thead><tr><th data-key="task">task</th><th data-key="version">version</th>'
        '<th data-key="reward">reward</th><th data-key="tokens">tokens</th><th>status</th><th>prompt (tail)</th><th>completion</th></tr></thead><tbody>',
        "".join(_sample_row(r, tok, colours) for r in shown),
        "</tbody></table></section>",
        "<footer>written by rollout-trio inspect</footer></main>",
        f"<script>{_JS}</script></body></html>",
    ]
    return "\n".join(out)

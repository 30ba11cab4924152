#!/usr/bin/env bash
# Screenshots for the README's "Watching a run": `top` and the live page, during a real
# `rollout-trio run`. Needs Debian's chromium (apt-get install -y chromium). Run from the
# repository root with the venv's python: bash docs/screenshots/take.sh
set -euo pipefail
PY=${PYTHON:-python}
out=docs/screenshots
err=$(mktemp)
"$PY" -m rollout_trio run --groups 100000 --group-size 4 --concurrency 4 --metrics-port 0 >/dev/null 2>"$err" &
run=$!
trap 'kill -INT $run 2>/dev/null || true; wait $run 2>/dev/null || true; rm -f "$err"' EXIT
for _ in $(seq 120); do grep -q "metrics at" "$err" && break; sleep 1; done
url=$(grep -o 'http://[^/]*' "$err" | head -1)
sleep 15  # let episodes flow
chrome=(chromium --headless --no-sandbox --disable-gpu --hide-scrollbars)
"${chrome[@]}" --window-size=1200,560 --virtual-time-budget=8000 --screenshot="$out/live-page.png" "$url/live"
"$PY" - "$url" "$out/top.svg" <<'PYEOF'
import sys, time
from rich.console import Console
from rollout_trio.cli._top import HttpSource, render
source, history = HttpSource(sys.argv[1]), {}
for _ in range(8):  # a few refreshes, as top does, so the sparklines have a history
    snap = source.read()
    render(snap, history)
    time.sleep(1)
console = Console(record=True, width=96, file=open("/dev/null", "w"))
console.print(render(source.read(), history))
console.save_svg(sys.argv[2], title="rollout-trio top")
PYEOF
"${chrome[@]}" --window-size=1010,640 --screenshot="$out/top.png" "file://$PWD/$out/top.svg"
rm -f "$out/top.svg"

"""Runs one agent in a fresh process (started as a script, so it does not import rollout_trio).

stdin: a pickled ``sys.path`` list, then a pickled ``(agent, data, backend)``.
The agent runs as ``anyio.run(agent.run, data, backend=backend)``: its own event loop.
fd 3's replacement (the original stdout) receives one pickle, ``("ok", value)`` or
``("error", exception_or_text)``; the agent's own prints go to stderr.
"""

import functools
import os
import pickle
import sys
import traceback


def main() -> int:
    result_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the agent's prints must not corrupt the result channel
    stdin = sys.stdin.buffer
    sys.path[:0] = [p for p in pickle.load(stdin) if p not in sys.path]
    agent, data, backend = pickle.load(stdin)
    import anyio

    try:
        payload = ("ok", anyio.run(functools.partial(agent.run, data), backend=backend))
    except BaseException as exc:  # reported to the parent, which rejects the episode
        text = "".join(traceback.format_exception(exc))
        try:
            pickle.dumps(exc)
            payload = ("error", (exc, text))
        except Exception:
            payload = ("error", (None, text))
    try:
        data_out = pickle.dumps(payload)
    except Exception as exc:
        data_out = pickle.dumps(("error", (None, f"the agent's return value cannot be pickled: {exc!r}")))
    result_out.write(data_out)
    result_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

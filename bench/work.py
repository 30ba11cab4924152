"""The work both sides of ``python -m bench`` do, defined once (torch only, imported where used; no event loop).

Imported by rollout_trio's side (bench/run_all.py) and by AReaL's (bench/areal_worker.py,
in AReaL's environment), so the episodes, rewards and requests are identical.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the fixed-answer servers start without torch
    import torch

PROMPT = list(range(1, 33))  # a 32-token prompt
OUT_LEN = 48  # output lengths 42..48, varying per call so packing pads
NORM_GROUP = 16  # group size for the normalization-alone benchmark
NORM_MODES = {  # name -> (mean level, std level, leave one out)
    "group": ("group", "group", False),
    "batch": ("batch", "batch", False),
    "loo": ("group", "group", True),
}
FAIL_SLOTS = 8  # the failure scenario's group size (slot 0 fails)
FAIL_TOKENS = 4096  # long generations, so siblings are mid-flight when slot 0 fails

# The loopback server's fixed SGLang /generate answer (16 tokens with logprobs).
_TOKENS = list(range(100, 116))
GENERATE_BODY = json.dumps(
    {
        "text": "",
        "output_ids": _TOKENS,
        "meta_info": {
            "id": "bench",
            "finish_reason": {"type": "length", "length": len(_TOKENS)},
            "prompt_tokens": 8,
            "completion_tokens": len(_TOKENS),
            "weight_version": "0",
            "output_token_logprobs": [[-0.25, t, None] for t in _TOKENS],
        },
    }
).encode()
CLIENT_PROMPT = list(range(8))
CLIENT_NEW_TOKENS = 16


def respond(salt: int) -> tuple[list[int], list[float], list[int]]:
    """The instant engine's answer to its ``salt``-th call: tokens, logprobs, versions."""
    n = OUT_LEN - (salt % 7)
    return [(salt + k) % 250 for k in range(n)], [-0.5] * n, [0] * n


def six_tensors(
    input_tokens: list[int], output_tokens: list[int], logprobs: list[float], versions: list[int]
) -> dict[str, torch.Tensor]:
    """One episode's trajectory: the usual six tensors of a single-turn rollout."""
    import torch

    n_in, n_out = len(input_tokens), len(output_tokens)
    ids = [*input_tokens, *output_tokens]
    return {
        "input_ids": torch.tensor([ids], dtype=torch.int32),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.bool),
        "loss_mask": torch.tensor([[0] * n_in + [1] * n_out], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0] * n_in + list(logprobs)], dtype=torch.float32),
        "versions": torch.tensor([[-1] * n_in + list(versions)], dtype=torch.int32),
        "rewards": torch.tensor([float(n_out % 3)], dtype=torch.float32),
    }


def rewards(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` float32 rewards: a mix of 0/1 outcomes and continuous scores."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    r = torch.rand(n, generator=gen)
    return torch.where(r < 0.5, (r < 0.2).float(), r).to(torch.float32)


def profiled(run: Callable[[], float], top: int = 25) -> dict[str, Any]:
    """``run()`` under cProfile: its rate and the ``top`` functions by own time, as text."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    rate = prof.runcall(run)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).strip_dirs().sort_stats("tottime").print_stats(top)
    return {"rate": rate, "profile": out.getvalue()}


def serve_fixed(port_file: str, count: int = 1) -> None:
    """A keep-alive HTTP/1.1 loopback server answering every POST /generate with
    :data:`GENERATE_BODY`, GET /get_model_info with version 0, and anything else with an empty 200 (raw asyncio protocol, so
    the server is not what is measured). Listens on ``count`` ports (one process, one event
    loop) and writes them to ``port_file``, one per line."""
    import asyncio
    import os

    ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(GENERATE_BODY)
    ok += GENERATE_BODY
    empty = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
    info_body = b'{"weight_version": "0"}'  # RemoteEngine reads the server's version at start
    info = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(info_body)
    info += info_body

    class Proto(asyncio.Protocol):
        def connection_made(self, transport):  # type: ignore[no-untyped-def]
            self.t = transport
            self.buf = b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                head = self.buf[:end].decode("latin-1")
                length = 0
                for line in head.split("\r\n")[1:]:
                    k, _, v = line.partition(":")
                    if k.strip().lower() == "content-length":
                        length = int(v)
                if len(self.buf) < end + 4 + length:
                    return
                self.buf = self.buf[end + 4 + length :]
                if head.startswith("POST /generate"):
                    self.t.write(ok)
                else:
                    self.t.write(info if head.startswith("GET /get_model_info") else empty)
                if "connection: close" in head.lower():
                    self.t.close()
                    return

    async def main() -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(Proto, "127.0.0.1", 0, backlog=4096) for _ in range(count)]
        with open(port_file + ".tmp", "w") as f:
            f.write("\n".join(str(server.sockets[0].getsockname()[1]) for server in servers))
        os.replace(port_file + ".tmp", port_file)
        await asyncio.gather(*(server.serve_forever() for server in servers))

    asyncio.run(main())


if __name__ == "__main__":
    import sys

    serve_fixed(sys.argv[1], *map(int, sys.argv[2:3]))

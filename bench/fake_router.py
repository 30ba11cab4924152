"""A stand-in for sglang-router's worker listing, for bench/fleet_curve.py (stdlib only).

    python bench/fake_router.py PORT_FILE

Listens on one loopback port (written to ``PORT_FILE``) and answers ``GET /health`` with
an empty 200 and ``GET /workers`` with the current listing in sglang-router's shape
(``{"workers": [{"id", "url", ...}, ...]}``, encoded once per listing). ``PUT
/bench/listing`` with ``{"urls": [...]}`` replaces the listing (the bench's own door;
sglang-router has none). Nothing is routed: only the engine's membership refresh is
measured against it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


def listing_body(urls: list[str]) -> bytes:
    """``GET /workers``'s body for ``urls``, shaped as sglang-router 0.2 answers it."""
    workers = [
        {"id": f"w{abs(hash(url)) % 10**12:012d}", "url": url, "model_id": "bench", "worker_type": "regular",
         "is_healthy": True, "load": 0, "connection_mode": "http"}  # fmt: skip
        for url in urls
    ]
    return json.dumps({"workers": workers, "total": len(workers)}).encode()


def serve(port_file: str) -> None:
    """Serve until killed (see the module docstring)."""
    state = {"workers": listing_body([])}
    empty = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"

    def ok(body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

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
                body, self.buf = self.buf[end + 4 : end + 4 + length], self.buf[end + 4 + length :]
                if head.startswith("GET /workers"):
                    self.t.write(ok(state["workers"]))
                elif head.startswith("PUT /bench/listing"):
                    state["workers"] = listing_body(json.loads(body)["urls"])
                    self.t.write(empty)
                else:
                    self.t.write(empty)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Proto, "127.0.0.1", 0, backlog=1024)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(server.sockets[0].getsockname()[1]))
        os.replace(port_file + ".tmp", port_file)
        await server.serve_forever()

    asyncio.run(main())


if __name__ == "__main__":
    serve(sys.argv[1])

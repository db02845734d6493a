"""Liveness on a port of its own, out of reach of the connection caps.

router/http.py closes a worker's connection past SHARDLB_MAX_CONNECTIONS, and one from an address
that holds SHARDLB_MAX_CLIENT_CONNECTIONS, at once. The kubelet's liveness probe is one more
connection, from the node's address (which traffic that kube-proxy forwards from a NodePort shares):
on a router at either cap it was closed like any other, and after a few such probes Kubernetes
restarted a router that was busy, not dead, with every connection it held.

With SHARDLB_PROBE_PORT set, each worker also listens there, on SHARDLB_PROBE_HOST (SHARDLB_HOST
unless set; the pod's IP in k8s/, where no Service and no NetworkPolicy rule names the port), and
answers ``GET /healthz`` as the API port does; anything else is 404, and every connection is closed
after its one answer. Its connections count toward neither cap, and the listener has small bounds
of its own: PROBE_CONNECTIONS at once (one more is closed), PROBE_HEAD_BYTES of request line and
headers and PROBE_TIMEOUT_S to send them. It runs on the worker's event loop, so a worker whose loop
is stuck fails it as it failed the API port's ``/healthz``. Workers bind it with SO_REUSEPORT, as
they share the API port: a probe reaches one of them.
"""

from __future__ import annotations

import asyncio
from typing import cast

import orjson

from router.settings import Settings

PROBE_CONNECTIONS = 8
PROBE_HEAD_BYTES = 8 * 1024
PROBE_TIMEOUT_S = 5.0
HEALTHY = orjson.dumps({"status": "ok"})
NOT_HERE = orjson.dumps(
    {"error": {"code": "not_found", "message": "this port serves GET /healthz only", "field": None}}
)


def _response(status: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
    )


class Listener:
    """The probe listener of one worker: its server and the number of connections it holds."""

    def __init__(self) -> None:
        self.open = 0
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: ProbeProtocol(self), host, port, reuse_port=True)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


class ProbeProtocol(asyncio.Protocol):
    """One probe connection: a request head, one answer, the close."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.head = bytearray()
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        if self.listener.open >= PROBE_CONNECTIONS:
            transport.close()
            return
        self.listener.open += 1
        self.counted = True
        self.timer = asyncio.get_running_loop().call_later(PROBE_TIMEOUT_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.head += data
        if b"\r\n\r\n" not in self.head:
            if len(self.head) > PROBE_HEAD_BYTES:
                transport.close()
            return
        method, _, rest = bytes(self.head[: self.head.index(b"\r\n")]).partition(b" ")
        target = rest.partition(b" ")[0]
        if method == b"GET" and target == b"/healthz":
            transport.write(_response(b"200 OK", HEALTHY))
        else:
            transport.write(_response(b"404 Not Found", NOT_HERE))
        transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.counted:
            self.counted = False
            self.listener.open -= 1


async def listen(settings: Settings) -> Listener | None:
    """The worker's probe listener, started, when SHARDLB_PROBE_PORT asks for one."""
    if not settings.probe_port:
        return None
    listener = Listener()
    await listener.start(settings.probe_host or settings.host, settings.probe_port)
    return listener

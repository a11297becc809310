"""Emulated network links on loopback: a small delaying TCP proxy (asyncio), and a probe for `tc netem`.

`DelayProxy` listens on 127.0.0.1 and forwards every connection to an upstream port on 127.0.0.1, delaying the bytes
of each direction as a link with a one-way propagation delay, a bandwidth (serialisation delay, in order) and a
segment loss rate would: a lost segment arrives one retransmission timeout late and holds back the ones after it
(TCP's in-order delivery). `set_down(True)` cuts every connection and refuses new ones (an outage).

`tc netem` needs the `sch_netem` kernel module and a network namespace of one's own; `netem_available()` says whether
this machine allows it (it only probes, in a throw-away namespace: nothing on the host changes).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass

__all__ = ["PROFILES", "DelayProxy", "LinkProfile", "netem_available"]

_MSS = 1448  # bytes of payload per TCP segment on a 1500-byte MTU


@dataclass(frozen=True)
class LinkProfile:
    """A link: one-way delay, bandwidth per direction (bits/s; up = client -> server) and segment loss rate."""

    name: str
    one_way_delay_s: float
    up_bps: float
    down_bps: float
    loss: float = 0.0
    min_rto_s: float = 0.2  # Linux's minimum TCP retransmission timeout

    @property
    def rtt_s(self) -> float:
        return 2 * self.one_way_delay_s

    def describe(self) -> str:
        def rate(bps: float) -> str:
            return f"{bps / 1e6:g} Mbit/s" if bps >= 1e6 else f"{bps / 1e3:g} kbit/s"

        return f"RTT {1000 * self.rtt_s:g} ms, {rate(self.down_bps)} / {rate(self.up_bps)}, {100 * self.loss:g}% loss"

    def as_dict(self) -> dict:
        return {**asdict(self), "rtt_s": self.rtt_s}


PROFILES: dict[str, LinkProfile] = {
    "lan": LinkProfile("lan", 0.0005, 1e9, 1e9, 0.0),
    "4g": LinkProfile("4g", 0.025, 10e6, 30e6, 0.001),
    "3g": LinkProfile("3g", 0.1, 0.5e6, 2e6, 0.01),
    "satellite": LinkProfile("satellite", 0.3, 3e6, 20e6, 0.005),
}


class _Direction:
    """One direction of one connection: timestamps each segment with its arrival time, delivers them in order."""

    def __init__(self, proxy: DelayProxy, bps: float, key: str):
        self.proxy, self.bps, self.key = proxy, bps, key
        self.link_free_at = 0.0
        self.last_arrival = 0.0

    def schedule(self, size: int) -> float:
        p = self.proxy.profile
        now = time.monotonic()
        sent = max(now, self.link_free_at) + 8.0 * size / self.bps  # serialisation on the bottleneck
        self.link_free_at = sent
        arrival = sent + p.one_way_delay_s
        if p.loss > 0 and self.proxy.rng.random() < p.loss:
            arrival += max(p.min_rto_s, 2 * p.rtt_s)  # retransmitted after a timeout
        arrival = max(arrival, self.last_arrival)  # in-order delivery: a late segment holds back the next ones
        self.last_arrival = arrival
        return arrival

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                item = await queue.get()
                if item is None:
                    break
                arrival, data = item
                delay = arrival - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        task = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                for i in range(0, len(data), _MSS):
                    chunk = data[i : i + _MSS]
                    queue.put_nowait((self.schedule(len(chunk)), chunk))
                    self.proxy.bytes[self.key] += len(chunk)
        finally:
            queue.put_nowait(None)
            await task


class DelayProxy:
    """A delaying TCP proxy 127.0.0.1:port -> 127.0.0.1:upstream_port with a `LinkProfile` (see module doc).

    ```python
    with DelayProxy(server_port, PROFILES["4g"]) as proxy:
        client = MoAClient(proxy.url, ...)
    ```
    """

    def __init__(
        self, upstream_port: int, profile: LinkProfile, port: int = 0, seed: int = 0, upstream_host: str = "127.0.0.1"
    ):
        self.upstream = (upstream_host, upstream_port)
        self.profile, self.port = profile, port
        self.rng = random.Random(seed)
        self.bytes = {"up": 0, "down": 0}
        self.connections = 0
        self._down = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> DelayProxy:
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True, name="moa-delay-proxy")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the delay proxy did not start within 10 s")
        return self

    def set_down(self, down: bool) -> None:
        """Cut (True) or restore (False) the link: while down, connections are closed and new ones refused."""
        self._down = down
        if down and self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(10)

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown():
            self._server.close()
            await self._close_all()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = self._thread = self._server = None

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _close_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        if self._down:
            c_writer.transport.abort()
            return
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.transport.abort()
            return
        self.connections += 1
        self._writers.update((c_writer, u_writer))
        up, down = _Direction(self, self.profile.up_bps, "up"), _Direction(self, self.profile.down_bps, "down")
        try:
            await asyncio.gather(up.pump(c_reader, u_writer), down.pump(u_reader, c_writer))
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (c_writer, u_writer):
                self._writers.discard(w)
                w.transport.abort()


def netem_available(timeout_s: float = 10.0) -> tuple[bool, str]:
    """(True, "") if `tc netem` works in a fresh network namespace here, else (False, why). Changes nothing."""
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is not installed"
    script = "ip link set lo up && tc qdisc add dev lo root netem delay 1ms"
    try:
        proc = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, str(err)
    if proc.returncode != 0:
        return False, (proc.stderr or proc.stdout).strip() or f"exit status {proc.returncode}"
    return True, ""

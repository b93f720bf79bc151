"""Limits of the HTTP layer: uvicorn's settings and a header timeout uvicorn lacks.

A client can hold a connection in three places; each has a bound:

1. Before a request's headers are complete (a new connection that sends nothing or only part
   of its headers, or a keep-alive connection that starts a request and stalls): uvicorn has
   no timeout here (it arms its keep-alive timer only after a response, and any received byte
   cancels it), so ``GuardedH11Protocol`` closes a connection on which no request has started
   within ``--header-timeout`` seconds.
2. Inside the request body: ``server.http.body.read_json`` answers 408 and closes after
   ``--body-read-timeout`` seconds.
3. Idle between requests: uvicorn's ``timeout_keep_alive`` (KEEP_ALIVE_TIMEOUT_S).

With those, uvicorn's ``limit_concurrency`` (see ``uvicorn_limits``) cannot be filled by
stalled sockets for longer than a timeout.

A client may half-close its socket (``shutdown(SHUT_WR)``) once its request is sent: the
end of its stream then means "no more requests", not "gone". uvicorn closed the connection
on that EOF and dropped the answer; ``GuardedH11Protocol`` keeps a connection whose request
is complete open for the response, then closes it. An EOF anywhere else (no request, or a
body not yet complete) still ends the connection. A client that closed its socket entirely
looks the same as a half-closed one until a write to it fails, so until the response starts
the connection is probed every PROBE_INTERVAL_S with an interim ``100 Continue`` (HTTP/1.1
clients must skip 1xx responses; every client library does for 100): a closed socket answers
the first probe with a reset, the next write fails, and the request is aborted as before (a
stream that has started finds out at its next chunks).
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

#: idle keep-alive connections are closed after this many seconds
KEEP_ALIVE_TIMEOUT_S = 5
#: HTTP requests beyond the engine's admission limit that uvicorn still hands to the app
#: (health checks, metrics, tokenize, requests that will get ferry's own 503)
HTTP_HEADROOM = 256
#: file descriptors kept free of HTTP connections (ZMQ sockets, logs, the model files)
FD_RESERVE = 128
#: seconds between the interim responses that probe a half-closed client (see above)
PROBE_INTERVAL_S = 1.0


def set_nodelay(transport) -> bool:
    """Turn Nagle's algorithm off on a TCP connection; True when it is off now.

    asyncio does this only for sockets whose ``proto`` is ``IPPROTO_TCP``; uvicorn's listening
    socket is made with proto 0, so its connections kept Nagle on. A streamed response is
    written as the headers, then the first chunk: on a keep-alive connection Nagle held that
    chunk until the client's delayed ACK of the headers, ~40 ms on Linux, so every client that
    reuses connections (the ``openai`` client, httpx, load generators) saw its first token
    ~40 ms late.
    """
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        return False
    return True


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a header timeout.

    A timer is armed when the connection opens and again after every response; when it
    fires and no new request has started since (the same request cycle, finished, or none),
    the connection is closed without a response (as nginx's ``client_header_timeout``
    does). A request that is running (a long SSE stream) is never cut by it.
    """

    _header_timer: asyncio.TimerHandle | None = None
    #: the client half-closed after a complete request: answer it, then close
    _peer_eof = False
    _probe: asyncio.TimerHandle | None = None
    #: seconds a connection may stay open without a request starting (no complete headers);
    #: ``uvicorn_limits`` makes a subclass with the server's ``--header-timeout``
    header_timeout_s: float = 10.0

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout,
                                                  self.cycle)

    def _header_timeout(self, cycle) -> None:
        self._header_timer = None
        started = self.cycle is not cycle or (cycle is not None and not cycle.response_complete)
        if not started and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        set_nodelay(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        self._stop_probe()
        super().on_response_complete()
        if self._peer_eof and not self.transport.is_closing():
            self.transport.close()  # the client sends nothing more: no keep-alive
        if not self.transport.is_closing():
            self._arm_header_timer()

    def eof_received(self) -> bool | None:
        """The client's end of stream: True (keep the connection open for writing) when a
        whole request is in and its response not done; else None (asyncio closes it)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body \
                and not cycle.disconnected:
            self._peer_eof = True
            self._probe = self.loop.call_later(PROBE_INTERVAL_S, self._probe_peer, cycle)
            return True
        return None

    def _probe_peer(self, cycle) -> None:
        """Write an interim 100 while ``cycle``'s response has not started (see the module
        docstring); a client that is gone makes a later write fail, which ends the cycle."""
        self._probe = None
        if self.cycle is not cycle or cycle.response_started or cycle.disconnected \
                or self.transport.is_closing():
            return
        try:
            data = self.conn.send(h11.InformationalResponse(status_code=100, headers=[],
                                                            reason=b"Continue"))
        except h11.LocalProtocolError:
            return
        self.transport.write(data)
        self._probe = self.loop.call_later(PROBE_INTERVAL_S, self._probe_peer, cycle)

    def _stop_probe(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_probe()
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def raise_fd_limit(want: int = 65536) -> int:
    """Raise the soft RLIMIT_NOFILE towards ``want`` (at most the hard limit).

    Returns:
        The soft limit now in force (``want`` when the limit is unlimited).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return want if soft == resource.RLIM_INFINITY else soft


def uvicorn_limits(args, max_running_requests: int | None, fd_limit: int) -> dict:
    """uvicorn ``Config`` keywords that bound the HTTP layer.

    ``limit_concurrency``: beyond this many open connections or in-flight requests uvicorn
    answers new requests with its own plain-text 503 (checked when a request starts, so
    streams that already run are never cut). It sits above the engine's admission limit
    (running + ``--max-queued-requests``) plus HTTP_HEADROOM, so ferry's OpenAI-shaped 503
    "queue full" comes first, and below the file-descriptor limit minus FD_RESERVE.
    ``timeout_keep_alive``: idle keep-alive connections close after KEEP_ALIVE_TIMEOUT_S.
    ``http``: a ``GuardedH11Protocol`` with the server's ``--header-timeout``.

    Args:
        args: ``ServerArgs``.
        max_running_requests: the engine's (``ReadyOut``), or None for the flag's.
        fd_limit: the process's soft RLIMIT_NOFILE.
    """
    running = max_running_requests or args.max_running_requests
    limit = running + args.max_queued_requests + HTTP_HEADROOM
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,),
                    {"header_timeout_s": float(args.header_timeout)})
    return {"limit_concurrency": max(16, min(limit, fd_limit - FD_RESERVE)),
            "timeout_keep_alive": KEEP_ALIVE_TIMEOUT_S, "http": protocol}

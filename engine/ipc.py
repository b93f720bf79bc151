"""Typed ZMQ PUSH/PULL wrappers over ``ipc://`` paths, carrying msgspec msgpack messages.

The launcher makes a private temp dir (mode 0700) holding the socket files and removes it
at exit. Decoding is typed: a message that is not one of the expected structs raises
``msgspec.ValidationError`` instead of running arbitrary code (no pickle).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from engine import io_struct


@dataclass(frozen=True)
class IpcPaths:
    """The three PULL endpoints: engine input, detokenizer input, server input."""

    root: str
    engine: str
    detokenizer: str
    server: str

    @classmethod
    def create(cls) -> IpcPaths:
        root = tempfile.mkdtemp(prefix="ferry-")
        os.chmod(root, 0o700)
        return cls(root, f"ipc://{root}/engine", f"ipc://{root}/detok", f"ipc://{root}/server")

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


_enc = msgspec.msgpack.Encoder()


class PushSocket:
    """Connects (or binds) a PUSH socket and sends msgspec structs."""

    def __init__(self, ctx: zmq.Context, endpoint: str, bind: bool = False):
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        (self.sock.bind if bind else self.sock.connect)(endpoint)

    def send(self, msg) -> None:
        self.sock.send(_enc.encode(msg), copy=False)

    def close(self) -> None:
        self.sock.close(0)


class PullSocket:
    """Binds a PULL socket and decodes messages into the given struct union type."""

    def __init__(self, ctx: zmq.Context, endpoint: str, typ, bind: bool = True):
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.dec = msgspec.msgpack.Decoder(typ)

    def recv(self, timeout_ms: int | None = None):
        """Block for one message (or until ``timeout_ms``; then return None)."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self.dec.decode(self.sock.recv(copy=False).buffer)

    def recv_nowait(self) -> list:
        """Every message already queued, without blocking."""
        out = []
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            out.append(self.dec.decode(data.buffer))

    def close(self) -> None:
        self.sock.close(0)


class AsyncPullSocket:
    """asyncio PULL socket for the server's listener task."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, typ, bind: bool = True):
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.dec = msgspec.msgpack.Decoder(typ)

    async def recv(self):
        data = await self.sock.recv(copy=False)
        return self.dec.decode(data.buffer)

    def close(self) -> None:
        self.sock.close(0)


class AsyncPushSocket:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, bind: bool = False):
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        (self.sock.bind if bind else self.sock.connect)(endpoint)

    async def send(self, msg) -> None:
        await self.sock.send(_enc.encode(msg), copy=False)

    def close(self) -> None:
        self.sock.close(0)


ENGINE_IN = io_struct.EngineReq
DETOK_IN = io_struct.BatchTokenIdOut
SERVER_IN = io_struct.ServerBound

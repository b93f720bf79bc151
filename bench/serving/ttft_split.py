"""Where a lone streamed request's client-side TTFT goes: send -> response headers -> first
``data:`` line, through httpx and through a raw asyncio socket, against the server's own TTFT
(``/metrics``). ``python -m bench.serving.ttft_split --base-url http://127.0.0.1:30000``."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx


def _body(n_prompt: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"prompt": [rng.randrange(1000, 40000) for _ in range(n_prompt)], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "stream": True}


async def via_httpx(base: str, body: dict) -> tuple[float, float]:
    async with httpx.AsyncClient(base_url=base, timeout=60) as c:
        await c.get("/health")  # the connection is open before the clock starts
        t0 = time.perf_counter()
        async with c.stream("POST", "/v1/completions", json=body) as r:
            th = time.perf_counter()
            async for chunk in r.aiter_bytes():
                if b"data:" in chunk:
                    return th - t0, time.perf_counter() - t0
    raise RuntimeError("no data")


async def via_socket(host: str, port: int, body: dict) -> tuple[float, float]:
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    req = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    t0 = time.perf_counter()
    writer.write(req)
    await writer.drain()
    buf, th = b"", None
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            raise RuntimeError("closed")
        buf += chunk
        if th is None and b"\r\n\r\n" in buf:
            th = time.perf_counter() - t0
        if b"data:" in buf:
            t = time.perf_counter() - t0
            writer.close()
            return th, t


async def main() -> None:
    p = argparse.ArgumentParser(prog="ttft_split")
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--n", type=int, default=20)
    a = p.parse_args()
    host, port = a.base_url.split("//")[1].split(":")
    res = {"httpx": [], "socket": []}
    for i in range(a.n):
        for name in res:
            body = _body(a.prompt_len, 1000 * i + len(name))  # no prefix-cache hits
            f = via_httpx(a.base_url, body) if name == "httpx" else via_socket(host, int(port), body)
            res[name].append(await f)
            await asyncio.sleep(0.2)
    async with httpx.AsyncClient(base_url=a.base_url) as c:
        text = (await c.get("/metrics")).text
    s = [float(ln.split()[-1]) for ln in text.splitlines()
         if ln.startswith("ferry:time_to_first_token_seconds_sum")]
    n = [float(ln.split()[-1]) for ln in text.splitlines()
         if ln.startswith("ferry:time_to_first_token_seconds_count")]
    if s and n and n[0]:
        print(f"server TTFT mean over all requests so far: {1e3 * s[0] / n[0]:.2f} ms")
    for name, v in res.items():
        hd = statistics.median(x[0] for x in v) * 1e3
        fd = statistics.median(x[1] for x in v) * 1e3
        print(f"{name:7s} median: headers {hd:.2f} ms, first data line {fd:.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())

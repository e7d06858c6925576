"""The client side of `chatloom bench streams`: N SSE streams at once from one process, each token's
trip timed from the stamp the scripted replica put in its text.

It runs in a process of its own, so its CPU is not the gateway's. HTTP/1.1 is read by hand (one
connection per stream, chunked framing, SSE events split on blank lines): a client library's
per-chunk cost would be receive lag added to every gap. The lag that remains is measured apart: a
coroutine asks to wake every 10 ms and records how late it wakes, which is how late this process's
loop gets to any socket that became readable.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

STAMP = re.compile(rb" (\d+)@(\d+)")
LAG_PERIOD_S = 0.01


@dataclass
class StreamRecord:
    """One stream as the client saw it."""

    seqs: list[int] = field(default_factory=list)
    gaps_ns: list[int] = field(default_factory=list)  # replica send -> client receive, per token
    arrivals_ns: list[int] = field(default_factory=list)
    error: str | None = None
    done: bool = False


async def _read_chunk(reader: asyncio.StreamReader) -> bytes:
    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
    data = await reader.readexactly(size) if size else b""
    await reader.readexactly(2)
    return data


async def one_stream(host: str, port: int, path: str, body: dict, api_key: str | None) -> StreamRecord:
    """Open one stream and read it to its end (or its failure)."""
    record = StreamRecord()
    payload = json.dumps(body).encode()
    auth = f"authorization: Bearer {api_key}\r\n" if api_key else ""
    try:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    except OSError as exc:
        record.error = f"connect: {exc}"
        return record
    try:
        writer.write((f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
                      f"accept: text/event-stream\r\n{auth}content-length: {len(payload)}\r\n"
                      f"connection: close\r\n\r\n").encode() + payload)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status = int(head.split(" ", 2)[1])
        if status != 200:
            rest = await reader.read(4000)
            record.error = f"HTTP {status}: {rest[:300].decode('utf-8', 'replace')}"
            return record
        buffer = b""
        while not record.done:
            data = await _read_chunk(reader)
            now = time.monotonic_ns()
            if not data:
                break
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            for raw in events:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                line = line[5:].strip()
                if line == b"[DONE]":
                    record.done = True
                    break
                if line.startswith(b'{"error"'):
                    record.error = f"stream error: {line[:300].decode('utf-8', 'replace')}"
                    return record
                # The stamps are read from the raw event, not its parsed JSON: only a token's text holds
                # ` <digits>@<digits>`, and parsing every event would add to the receive lag measured.
                for seq, sent in STAMP.findall(line):
                    record.seqs.append(int(seq))
                    record.gaps_ns.append(now - int(sent))
                    record.arrivals_ns.append(now)
        if not record.done:
            record.error = "the stream ended without [DONE]"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        writer.close()
    return record


async def _lag_monitor(lags_ns: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        due = time.monotonic_ns() + int(LAG_PERIOD_S * 1e9)
        await asyncio.sleep(LAG_PERIOD_S)
        lags_ns.append(max(0, time.monotonic_ns() - due))


async def run_client(host: str, port: int, streams: int, tokens: int, api_key: str | None,
                     direct: bool) -> dict:
    """Open `streams` streams at once; each stream's tokens, gaps and arrival times, and the loop's lag."""
    if direct:
        path, body = "/v1/completions", {"model": "scripted", "prompt": [1], "stream": True, "max_tokens": tokens}
    else:
        path, body = "/v1/chat/completions", {"model": "scripted", "stream": True, "max_tokens": tokens,
                                              "messages": [{"role": "user", "content": "go"}]}
    lags: list[int] = []
    stop = asyncio.Event()
    monitor = asyncio.create_task(_lag_monitor(lags, stop))
    started = time.monotonic_ns()
    records = await asyncio.gather(*(one_stream(host, port, path, body, api_key) for _ in range(streams)))
    ended = time.monotonic_ns()
    stop.set()
    await monitor
    return {"started_ns": started, "ended_ns": ended, "loop_lag_ns": lags,
            "streams": [{"seqs": r.seqs, "gaps_ns": r.gaps_ns, "arrivals_ns": r.arrivals_ns, "error": r.error}
                        for r in records]}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import sys

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--streams", type=int, required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--direct", action="store_true", help="talk to the scripted replica itself (/v1/completions)")
    args = p.parse_args(argv)
    result = asyncio.run(run_client("127.0.0.1", args.port, args.streams, args.tokens, args.api_key, args.direct))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()

"""A scripted OpenAI-compatible replica for `chatloom bench streams`: tokens on a fixed schedule, each
stamped with the moment it left.

It answers what a gateway's router asks of a replica (/v1/models, /health, /metrics, /tokenize and
streaming /v1/completions with token ids; /v1/kv_events is a 404, so the router keeps its own prefix
index) and nothing else. Every streamed token's text is ` <seq>@<ns>`: its number in the answer and
`time.monotonic_ns()` read just before the bytes were handed to the socket. CLOCK_MONOTONIC is one
clock for every process on the machine, so a client that reads the same clock when the token reaches
it gets the token's whole trip through the gateway, without any change to the product's stream format.

HTTP/1.1 is spoken by hand on asyncio streams (keep-alive, Content-Length requests, chunked answers):
the replica shares the machine's cores with the gateway being measured, so it should cost as little
as it can.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

MODEL_ID = "scripted"
MAX_MODEL_LEN = 1 << 20


def token_text(seq: int) -> str:
    """A token's text: its number and the monotonic nanoseconds it left at."""
    return f" {seq}@{time.monotonic_ns()}"


class ScriptedReplica:
    """Streams `max_tokens` tokens per request, one every `interval_s`, starting at a random phase."""

    def __init__(self, interval_s: float, seed: int = 0) -> None:
        self.interval_s = interval_s
        self._random = random.Random(seed)
        self.streams_started = 0

    async def serve(self, host: str, port: int) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._connection, host, port, backlog=4096)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if not await self._answer(method, path.split("?", 1)[0], body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection should close."""
        if method == "GET" and path == "/v1/models":
            return _send(writer, 200, {"object": "list", "data": [
                {"id": MODEL_ID, "object": "model", "max_model_len": MAX_MODEL_LEN}]})
        if method == "GET" and path == "/health":
            return _send(writer, 200, {"status": "ok"})
        if method == "GET" and path == "/metrics":
            return _send_text(writer, 200, "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
        if method == "POST" and path == "/tokenize":
            request = json.loads(body or b"{}")
            words = sum(len(str(m.get("content") or "").split()) + 4 for m in request.get("messages") or [])
            words += len(str(request.get("prompt") or "").split())
            return _send(writer, 200, {"tokens": list(range(1, max(1, words) + 1))})
        if method == "POST" and path == "/v1/completions":
            request = json.loads(body or b"{}")
            await self._stream(writer, int(request.get("max_tokens") or 16))
            return True
        return _send(writer, 404, {"error": {"message": f"no route {method} {path}", "code": "not_found"}})

    async def _stream(self, writer: asyncio.StreamWriter, tokens: int) -> None:
        self.streams_started += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        loop = asyncio.get_running_loop()
        start = loop.time() + self._random.uniform(0, self.interval_s)
        for seq in range(tokens):
            delay = start + seq * self.interval_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if writer.is_closing():
                return
            text = token_text(seq)
            _chunk(writer, {"choices": [{"index": 0, "text": text, "token_ids": [seq + 1], "finish_reason": None}]})
            await writer.drain()
        _chunk(writer, {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]})
        _chunk(writer, {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                                                 "total_tokens": tokens + 1}})
        writer.write(_framed(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()


def _framed(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _chunk(writer: asyncio.StreamWriter, payload: dict) -> None:
    writer.write(_framed(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"))


def _send(writer: asyncio.StreamWriter, status: int, payload: dict) -> bool:
    return _send_bytes(writer, status, "application/json", json.dumps(payload).encode())


def _send_text(writer: asyncio.StreamWriter, status: int, text: str) -> bool:
    return _send_bytes(writer, status, "text/plain; version=0.0.4", text.encode())


def _send_bytes(writer: asyncio.StreamWriter, status: int, kind: str, data: bytes) -> bool:
    reason = {200: "OK", 404: "Not Found"}[status]
    writer.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                 % (status, reason.encode(), kind.encode(), len(data), data))
    return True


async def run_replica(host: str, port: int, interval_s: float, seed: int) -> None:
    """Serve until cancelled (the bench ends the process with SIGTERM)."""
    server = await ScriptedReplica(interval_s, seed).serve(host, port)
    print(f"scripted replica on {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--interval-ms", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        asyncio.run(run_replica("127.0.0.1", args.port, args.interval_ms / 1000, args.seed))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

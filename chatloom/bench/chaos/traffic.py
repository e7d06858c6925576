"""The chaos run's users: seeded loops of conversation turns (streams dropped and resumed with
Last-Event-ID, stops), OpenAI-compatible calls (streaming, non-streaming, a calculator tool round
trip) and small file uploads, over HTTP/2 to either gateway.

A client moves to the other gateway when one stops answering (a killed gateway refuses connections),
and waits out a 429 or 503 for its Retry-After (capped). A gateway's client is replaced when its
connection breaks (chatloom/bench/chaos/gateway_pool.py). A message whose POST broke after it may have reached
a gateway is looked up in its conversation before it is sent again: found, its answer is followed with
a resume like any other. Everything the clients see goes into the Ledger.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from chatloom.bench.chaos.gateway_pool import NOT_SENT, GatewayClients, new_client
from chatloom.bench.chaos.ledger import Answer, Ledger, OpenAICall, Submission, Upload

PASSWORD = "chaos horse battery"
RESUME_FOR_S = 120.0  # how long a client keeps trying to follow one answer to its end
LOOKUP_FOR_S = 60.0  # how long a client tries to learn whether a message whose POST broke was stored
WORDS = ("river", "stone", "lamp", "quiet", "orbit", "maple", "signal", "harbor", "copper", "window", "violet")
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


@dataclass
class User:
    name: str
    tier: str
    role: str  # chat | openai | files
    headers: dict[str, str]


def parse_sse(text: str) -> list[tuple[int | None, str | None, dict]]:
    """Complete SSE blocks -> (id, event, data); comments (heartbeats) are skipped."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        ident, event, data = None, None, None
        for line in block.split("\n"):
            if line.startswith("id: "):
                ident = int(line[4:])
            elif line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None and data != "[DONE]":
            out.append((ident, event, json.loads(data)))
    return out


class Traffic:
    """Drives every user until `stop` is set; `model` is the served model's id."""

    def __init__(self, gateways: dict[str, str], model: str, ledger: Ledger, seed: int) -> None:
        self.urls = gateways
        self.model = model
        self.ledger = ledger
        self.rng = random.Random(seed)
        self.clients = GatewayClients(gateways)
        self.stop = asyncio.Event()
        self._side_tasks: set[asyncio.Task] = set()

    async def close(self) -> None:
        await asyncio.gather(*self._side_tasks, return_exceptions=True)
        await self.clients.aclose()

    def _order(self, rng: random.Random, avoid: str | None = None) -> list[str]:
        names = list(self.urls)
        rng.shuffle(names)
        if avoid in names and len(names) > 1:
            names.remove(avoid)
            names.append(avoid)
        return names

    async def request(self, rng: random.Random, method: str, path: str, route: str, **kw) -> httpx.Response | None:
        """One request on the first gateway that answers; None when none did (both being restarted)."""
        for name in self._order(rng):
            try:
                async with self.clients.use(name) as client:
                    r = await client.request(method, path, **kw)
            except httpx.HTTPError as exc:
                self.ledger.no_reply(time.monotonic(), name, route, exc)
                continue
            self.ledger.reply(time.monotonic(), name, route, r.status_code, r.headers, _json(r))
            return r
        return None

    # -- accounts ---------------------------------------------------------------------------

    async def signup(self, name: str) -> dict[str, str]:
        rng = random.Random(name)
        for _ in range(60):
            r = await self.request(rng, "POST", "/auth/signup", "signup", json={"username": name, "password": PASSWORD})
            if r is not None and r.status_code == 409:
                r = await self.request(rng, "POST", "/auth/login", "login",
                                       json={"username": name, "password": PASSWORD})
            if r is not None and r.status_code in (200, 201):
                return {"Authorization": f"Bearer {r.json()['token']}"}
            await asyncio.sleep(1.0)
        raise RuntimeError(f"could not sign up {name}")

    # -- the loops --------------------------------------------------------------------------

    async def run_user(self, user: User, seed: int) -> None:
        rng = random.Random(seed)
        loop = {"chat": self._chat_turns, "openai": self._openai_calls, "files": self._uploads}[user.role]
        await loop(user, rng)

    async def _pause(self, rng: random.Random, r: httpx.Response | None, base: float) -> None:
        wait = base * (0.5 + rng.random())
        if r is not None and r.status_code in (429, 503):
            try:
                wait = max(wait, min(float(r.headers.get("retry-after", "1")), 5.0))
            except ValueError:
                pass
        elif r is None:
            wait = max(wait, 1.0)
        try:
            await asyncio.wait_for(self.stop.wait(), wait)
        except asyncio.TimeoutError:
            pass

    async def _chat_turns(self, user: User, rng: random.Random) -> None:
        conversation = None
        turns = 0
        while not self.stop.is_set():
            if conversation is None or turns >= rng.randint(2, 5):
                r = await self.request(rng, "POST", "/conversations", "conversations", headers=user.headers)
                if r is None or r.status_code != 201:
                    await self._pause(rng, r, 1.0)
                    continue
                conversation, turns = r.json()["id"], 0
            r = await self._turn(user, conversation, rng)
            turns += 1
            await self._pause(rng, r, 0.5)

    async def _turn(self, user: User, conversation: str, rng: random.Random) -> httpx.Response | None:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + f" #{rng.getrandbits(40):x}"
        body = {"text": text, "max_tokens": rng.randint(16, 64)}
        # Sent again after a lost reply, the key makes any gateway that stores it late find it stored instead.
        headers = {**user.headers, "Idempotency-Key": f"{rng.getrandbits(64):016x}"}
        plan = rng.random()
        cut_after = rng.randint(1, 6) if plan < 0.3 else None
        stop_after = rng.randint(2, 8) if 0.3 <= plan < 0.4 else None
        for name in self._order(rng):
            answer = None
            try:
                async with self._stream_client(name, cut_after is not None) as client, client.stream(
                        "POST", f"/conversations/{conversation}/messages", headers=headers, json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        self.ledger.reply(time.monotonic(), name, "messages", r.status_code, r.headers, _json(r))
                        if r.status_code == 409 and (_json(r) or {}).get("error", {}).get("code") == "already_sent":
                            # stored by the send whose reply was lost; its stream is gone: follow it stored
                            _, answer = await self._look_up(user, conversation, text, body["max_tokens"], rng)
                            if answer is not None:
                                await self._follow(answer, name, user, rng)
                            return None
                        self.ledger.refused_messages += 1
                        return r
                    self.ledger.reply(time.monotonic(), name, "messages", 200)
                    answer = Answer(user.name, conversation, r.headers["x-message-id"],
                                    r.headers["x-user-message-id"], text, body["max_tokens"])
                    self.ledger.answers.append(answer)
                    await self._read(r, answer, name, user, rng, cut_after, stop_after)
            except httpx.HTTPError as exc:
                self.ledger.no_reply(time.monotonic(), name, "messages", exc)
                if answer is None:
                    if isinstance(exc, NOT_SENT):
                        continue  # never reached the gateway: try the other one
                    maybe_stored, answer = await self._look_up(user, conversation, text, body["max_tokens"], rng)
                    if not maybe_stored:
                        continue  # never stored: try the other gateway
                    if answer is None:
                        return None  # nobody could tell: one of the ledger's unknown submissions
            if answer.end is None and not answer.lost:
                await self._follow(answer, name, user, rng)
            return None
        return None

    @asynccontextmanager
    async def _stream_client(self, name: str, own: bool) -> AsyncIterator[httpx.AsyncClient]:
        """The gateway's shared client, or (a stream to be cut) a connection of its own, closed after."""
        if not own:
            async with self.clients.use(name) as client:
                yield client
            return
        client = new_client(self.urls[name])
        try:
            yield client
        finally:
            await client.aclose()

    async def _look_up(self, user: User, conversation: str, text: str, max_tokens: int,
                       rng: random.Random) -> tuple[bool, Answer | None]:
        """After a POST that broke once it may have reached a gateway, read the conversation (on
        whichever gateway answers) for the message (its text is unique). Found: (True, its answer), to be
        followed from its first event. Not there: (False, None): never stored, to be sent again.
        Unknowable within LOOKUP_FOR_S: (True, None), and the ledger keeps it as an unknown submission."""
        deadline = time.monotonic() + LOOKUP_FOR_S
        while time.monotonic() < deadline:
            r = await self.request(rng, "GET", f"/conversations/{conversation}", "lookup", headers=user.headers)
            if r is not None and r.status_code == 200:
                messages = r.json()["messages"]
                sent = next((m for m in messages if m["role"] == "user" and m["text"] == text), None)
                if sent is None:
                    return False, None
                reply = next((m for m in messages if m["parent_id"] == sent["id"]), None)
                if reply is not None:
                    answer = Answer(user.name, conversation, reply["id"], sent["id"], text, max_tokens,
                                    connections=0, found_after_lost_reply=True)
                    self.ledger.answers.append(answer)
                    return True, answer
            await asyncio.sleep(1.0)
        self.ledger.unknown_submissions.append(Submission(user.name, conversation, text, max_tokens))
        return True, None

    async def _read(self, r: httpx.Response, answer: Answer, gateway: str, user: User, rng: random.Random,
                    cut_after: int | None = None, stop_after: int | None = None) -> None:
        """Add the response's events to the answer until its end, or until the planned cut."""
        buffer = ""
        async for chunk in r.aiter_text():
            buffer += chunk
            cut = buffer.rfind("\n\n")
            if cut < 0:
                continue
            complete, buffer = buffer[:cut + 2], buffer[cut + 2:]
            for ident, event, data in parse_sse(complete):
                if event == "error" or data.get("done"):
                    answer.end = {**data, "event": event or "done"}
                    return
                if ident is not None:
                    answer.events.append((ident, data))
            tokens = sum(1 for _, d in answer.events if "token" in d)
            if cut_after is not None and tokens >= cut_after and not answer.cut:
                answer.cut = True
                self.ledger.cuts += 1
                return
            if stop_after is not None and tokens >= stop_after and not answer.stop_sent:
                answer.stop_sent = True
                task = asyncio.get_running_loop().create_task(self._stop(answer, gateway, user, rng))
                self._side_tasks.add(task)  # held, so it is not collected before it runs
                task.add_done_callback(self._side_tasks.discard)

    async def _stop(self, answer: Answer, gateway: str, user: User, rng: random.Random) -> None:
        for name in self._order(rng, avoid=gateway):  # the stop goes to the other gateway first
            try:
                async with self.clients.use(name) as client:
                    r = await client.post(f"/conversations/{answer.conversation_id}/stop", headers=user.headers)
            except httpx.HTTPError as exc:
                self.ledger.no_reply(time.monotonic(), name, "stop", exc)
                continue
            self.ledger.reply(time.monotonic(), name, "stop", r.status_code, r.headers, _json(r))
            if r.status_code == 200:
                return

    async def _follow(self, answer: Answer, last_gateway: str, user: User, rng: random.Random) -> None:
        """Resume the answer with Last-Event-ID (from the last event received) until its end. A log that
        Redis lost (a resume answers 404), or that lost the events up to its end marker (resumes answer
        200 and end at once, with nothing) while the stored answer has ended, is given up as lost."""
        deadline = time.monotonic() + RESUME_FOR_S
        avoid = last_gateway
        empty = 0  # resumes in a row that ended with no event and no end
        while answer.end is None and time.monotonic() < deadline:
            for name in self._order(rng, avoid=avoid):
                last = answer.events[-1][0] if answer.events else 0
                try:
                    async with self.clients.use(name) as client, client.stream(
                            "GET", f"/conversations/{answer.conversation_id}/stream",
                            params={"message_id": answer.message_id},
                            headers={**user.headers, "Last-Event-ID": str(last)}) as r:
                        if r.status_code != 200:
                            await r.aread()
                            self.ledger.reply(time.monotonic(), name, "resume", r.status_code, r.headers, _json(r))
                            if r.status_code == 404:
                                answer.lost = True
                                return
                            continue
                        self.ledger.reply(time.monotonic(), name, "resume", 200)
                        answer.connections += 1
                        before = len(answer.events)
                        await self._read(r, answer, name, user, rng)
                        empty = empty + 1 if len(answer.events) == before and answer.end is None else 0
                except httpx.HTTPError as exc:
                    self.ledger.no_reply(time.monotonic(), name, "resume", exc)
                if answer.end is not None:
                    return
                if empty >= 3 and await self._stored_ended(answer, user, rng):
                    answer.lost = answer.end_lost = True
                    return
                avoid = name
            await asyncio.sleep(0.5)

    async def _stored_ended(self, answer: Answer, user: User, rng: random.Random) -> bool:
        r = await self.request(rng, "GET", f"/conversations/{answer.conversation_id}", "lookup",
                               headers=user.headers)
        if r is None or r.status_code != 200:
            return False
        row = next((m for m in r.json()["messages"] if m["id"] == answer.message_id), None)
        return row is not None and (row["status"] != "incomplete" or row["finish_reason"] is not None)

    async def _openai_calls(self, user: User, rng: random.Random) -> None:
        while not self.stop.is_set():
            kind = rng.choice(("plain", "stream", "tool"))
            messages = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))}]
            call = OpenAICall(user.name, kind, 0)
            self.ledger.openai.append(call)
            if kind == "stream":
                r = await self._openai_stream(user, rng, messages, call)
            elif kind == "tool":
                r = await self._tool_round(user, rng, messages, call)
            else:
                r = await self._openai_plain(user, rng, messages, call, {})
            await self._pause(rng, r, 0.5)

    async def _openai_plain(self, user: User, rng: random.Random, messages: list, call: OpenAICall,
                            extra: dict) -> httpx.Response | None:
        r = await self.request(rng, "POST", "/v1/chat/completions", "openai", headers=user.headers, json={
            "model": self.model, "messages": messages, "max_tokens": rng.randint(8, 48), **extra})
        call.status = r.status_code if r is not None else 0
        if r is not None and r.status_code == 200:
            usage = r.json()["usage"]
            call.prompt_tokens += usage["prompt_tokens"]
            call.completion_tokens += usage["completion_tokens"]
            call.complete = True
        return r

    async def _tool_round(self, user: User, rng: random.Random, messages: list,
                          call: OpenAICall) -> httpx.Response | None:
        """A calculator round trip: the assistant's call (played by the client: a random-weight model
        never picks a tool, and a forced call needs structured output, which a routed backend refuses),
        its result from chatloom's calculator, and the model's answer after it."""
        from chatloom.app.tools.calculator import evaluate, format_number
        from chatloom.app.tools.registry import ToolFailure

        expression = f"{rng.randint(2, 999)} {rng.choice('+-*/')} {rng.randint(1, 99)}"
        try:
            output = format_number(evaluate(expression))
        except ToolFailure as exc:
            output = f"error: {exc}"
        call_id = f"call_{rng.getrandbits(48):x}"
        follow = messages + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
                "name": "calculator", "arguments": json.dumps({"expression": expression})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": output}]
        return await self._openai_plain(user, rng, follow, call, {"tools": [CALCULATOR]})

    async def _openai_stream(self, user: User, rng: random.Random, messages: list,
                             call: OpenAICall) -> httpx.Response | None:
        body = {"model": self.model, "messages": messages, "max_tokens": rng.randint(8, 48), "stream": True,
                "stream_options": {"include_usage": True}}
        for name in self._order(rng):
            try:
                async with self.clients.use(name) as client, client.stream(
                        "POST", "/v1/chat/completions", headers=user.headers, json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        self.ledger.reply(time.monotonic(), name, "openai", r.status_code, r.headers, _json(r))
                        call.status = r.status_code
                        return r
                    self.ledger.reply(time.monotonic(), name, "openai", 200)
                    call.status = 200
                    text = ""
                    async for chunk in r.aiter_text():
                        text += chunk
                    for _, _, data in parse_sse(text):
                        if data.get("usage"):
                            call.prompt_tokens = data["usage"]["prompt_tokens"]
                            call.completion_tokens = data["usage"]["completion_tokens"]
                            call.complete = True
                    return r
            except httpx.HTTPError as exc:
                self.ledger.no_reply(time.monotonic(), name, "openai", exc)
                if call.status == 200:
                    return None  # cut mid-stream by a fault: its usage is unknown to the client
        return None

    async def _uploads(self, user: User, rng: random.Random) -> None:
        while not self.stop.is_set():
            size = rng.randint(2_000, 40_000)
            data = bytes(rng.getrandbits(8) for _ in range(size))
            r = await self.request(rng, "POST", "/v1/files", "files", headers=user.headers,
                                   files={"file": ("chaos.bin", data)}, data={"purpose": "user_data"})
            if r is not None and r.status_code == 200:
                self.ledger.uploads.append(Upload(user.name, r.json()["id"], size))
            await self._pause(rng, r, 1.0)


def _json(r: httpx.Response) -> dict | None:
    try:
        body = r.json()
    except (ValueError, UnicodeDecodeError, httpx.ResponseNotRead):
        return None
    return body if isinstance(body, dict) else None

"""One response as it runs: the pipeline's pieces become output items (a reasoning item for the thinking, a
message with output_text for the answer, a function_call item per call) and, streamed, OpenAI's semantic
events in OpenAI's order:

    response.created, response.in_progress,
    per item: response.output_item.added,
      message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done
      reasoning: response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                 response.content_part.done
      call:      response.function_call_arguments.delta, response.function_call_arguments.done
    response.output_item.done,
    then response.completed, or response.incomplete (max_output_tokens, content_filter), or response.failed

each numbered by `sequence_number`. A whole (not streamed) response is the same walk with the events
dropped, so both give the same object. With `store`, the response is saved before its last event, so a
client that reads `response.completed` can continue the thread at once, on any gateway.

With built-in tools (`HostedRun`), the servers' tool listings come first (mcp_list_tools), and a round
that ends in calls of built-in tools runs them on the server, as the chat's answers do (their items and
events: hosted_calls.py), then resumes the same run with their results, until the model answers or
calls a function tool of the client's: then the response ends with its function_call items, as without
built-ins, and the thread keeps the built-in results for the next turn. While the built-ins run, the
round's KV cache is held or evicted by the same policy as the chat's tools (generation/tool_kv.py).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import AsyncIterator, Iterator

from chatloom.app.core.errors import ApiError
from chatloom.app.generation.pipeline import (AnswerText, BudgetSpent, ChatPrompt, Finished, Piece, Run, Thinking,
                                              ToolCall)
from chatloom.app.generation.tool_calls import render_messages
from chatloom.app.generation.tool_kv import keeps_kv, release_kv, tools_started
from chatloom.app.responses import hosted_calls as hc
from chatloom.app.responses.hosted_calls import HostedRun, shown
from chatloom.app.responses.items import function_call_item, message_item, reasoning_item
from chatloom.app.tools.registry import ToolResult
from chatloom.app.tools.sandbox import remove_scratch
from chatloom.app.responses.stored import ResponseStore
from chatloom.serving import BackendError, BadGenerationRequest
from chatloom.store import StoredResponse, new_id

# finish reason -> (status, incomplete_details)
OUTCOMES = {"length": ("incomplete", {"reason": "max_output_tokens"}),
            "content_filter": ("incomplete", {"reason": "content_filter"}),
            "abort": ("incomplete", None)}
TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


@dataclass
class Draft:
    """A response before it runs: what the request gave and what the response object echoes back."""

    user_id: str
    input_items: list[dict]
    params: dict  # the request's settings as the response object shows them (tools, text, reasoning...)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))


def response_object(draft: Draft, model: str, status: str, output: list[dict], usage: dict | None = None,
                    details: dict | None = None) -> dict:
    """The API's response object (`details`: incomplete_details, or the error of a failed response)."""
    return {"id": draft.id, "object": "response", "created_at": draft.created_at, "status": status,
            "background": False, "error": details if status == "failed" else None,
            "incomplete_details": details if status == "incomplete" else None,
            "instructions": draft.instructions, "model": model, "output": output,
            "previous_response_id": draft.previous_response_id, "usage": usage, **draft.params}


def stored_object(row: StoredResponse) -> dict:
    created = row.created if row.created.tzinfo else row.created.replace(tzinfo=timezone.utc)  # SQLite: naive
    draft = Draft(row.user_id, row.input_items, row.params, row.instructions, row.previous_response_id, True,
                  row.id, int(created.timestamp()))
    return response_object(draft, row.model, row.status, [shown(it) for it in row.output_items], row.usage,
                           row.details)


class ResponseWriter:
    def __init__(self, draft: Draft, run: Run, pieces: AsyncIterator[Piece], first: Piece | None,
                 store: ResponseStore, hosted: HostedRun | None = None) -> None:
        self.draft = draft
        self.run = run
        self.pieces = pieces
        self.first = first
        self.store = store
        self.hosted = hosted
        draft.params = {**draft.params, "temperature": run.limits.temperature, "top_p": run.limits.top_p}
        self.output: list[dict] = []
        self._open: dict | None = None  # the item being written (message or reasoning)
        self._seq = 0
        self.final: dict | None = None

    # -- the walk ------------------------------------------------------------------------------------
    async def events(self, raise_errors: bool = False) -> AsyncIterator[dict]:
        """The stream's events; `raise_errors`: a failure raises (a whole response is an HTTP error then)
        rather than ending as response.failed."""
        yield self._event("response.created", response=self._object("in_progress"))
        yield self._event("response.in_progress", response=self._object("in_progress"))
        failure: Exception | None = None
        spent = False
        try:
            for listing in self.hosted.tools.listings if self.hosted else []:
                for event in self._listing(listing):
                    yield event
            piece, round_no = self.first, 0
            while True:
                text, calls, theirs = [], [], 0
                while piece is not None:
                    if isinstance(piece, AnswerText):
                        text.append(piece.text)
                        for event in self._text("message", piece.text):
                            yield event
                    elif isinstance(piece, Thinking):
                        for event in self._text("reasoning", piece.text):
                            yield event
                    elif isinstance(piece, Finished) and round_no > 0:  # what resuming after the tools cost
                        self.run.traffic.metrics.observe_resume(piece.usage, piece.timings)
                    elif isinstance(piece, ToolCall):
                        calls.append(piece)
                        if self._hosted_tool(piece) is None:  # the client's function: its item now
                            theirs += 1
                            for event in self._call(piece):
                                yield event
                    piece = await anext(self.pieces, None)
                if not any(self._hosted_tool(c) for c in calls):
                    break
                if not theirs:  # a resume follows: the round's KV cache is held or evicted while they run
                    tools_started(self.run, [c.name for c in calls])
                async for event in self._run_hosted("".join(text), calls):
                    yield event
                if theirs:  # the client runs its functions; the thread keeps the built-ins' results
                    break
                round_no += 1
                await self.pieces.aclose()
                await self.run.resume(ChatPrompt(render_messages(self.hosted.turns, self.run.ask.tools)),
                                      f"{self.draft.id}-round-{round_no}")
                self.run.keeps_kv = keeps_kv(self.run)
                self.pieces = self.run.stream()
                piece = await anext(self.pieces, None)
        except BudgetSpent:  # the tokens reserved for the response are used up: cut, like max_output_tokens
            spent = True
        except (ApiError, BadGenerationRequest, BackendError) as exc:
            if raise_errors:
                raise
            failure = exc
        finally:
            release_kv(self.run)  # no resume follows: what the last round kept is freed
            if self.hosted is not None and "code_interpreter" in {t.kind for t in self.hosted.tools.tools.values()}:
                # the response's container lasts as long as the response; the files it kept stay
                await asyncio.to_thread(remove_scratch, self.run.pipeline.settings.server.data_dir,
                                        self.hosted.ctx.conversation_id)
        if spent:
            status, details = OUTCOMES["length"]
        elif isinstance(failure, ApiError):
            status, details = "failed", {"code": failure.code or "server_error", "message": failure.message}
        elif failure is not None:
            status, details = "failed", {"code": "server_error", "message": f"generation failed: {failure}"}
        else:
            status, details = OUTCOMES.get(self.run.finish_reason or "", ("completed", None))
        if not any(item.get("type") in ("message", "function_call") for item in self.output + [self._open or {}]):
            for event in self._text("message", ""):  # an empty answer is still a message
                yield event
        for event in self._close("completed" if status == "completed" else "incomplete"):
            yield event
        await self.run.release()  # the user's next request may start now
        self.final = self._object(status, self._usage(), details)
        if self.draft.store:
            await self.store.save(self._row(status, details))
        yield self._event(TERMINAL[status], response=self.final)

    async def whole(self) -> dict:
        """The finished response object (failures raise)."""
        async for _ in self.events(raise_errors=True):
            pass
        assert self.final is not None
        return self.final

    # -- items -----------------------------------------------------------------------------------------
    def _text(self, kind: str, text: str) -> Iterator[dict]:
        if self._open is None or self._open["type"] != kind:
            yield from self._close("completed")
            yield from self._start(kind)
        item = self._open
        assert item is not None
        if text:
            item["text"] += text
            name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if kind == "message" else {}
            yield self._event(name, item_id=item["id"], output_index=item["index"], content_index=0, delta=text,
                              **extra)

    def _start(self, kind: str) -> Iterator[dict]:
        index = len(self.output)
        shown = message_item("assistant", "", status="in_progress") if kind == "message" \
            else reasoning_item("", status="in_progress")
        self._open = {"type": kind, "id": shown["id"], "index": index, "text": ""}
        yield self._event("response.output_item.added", output_index=index, item={**shown, "content": []})
        yield self._event("response.content_part.added", item_id=shown["id"], output_index=index, content_index=0,
                          part=shown["content"][0])

    def _close(self, status: str) -> Iterator[dict]:
        item, self._open = self._open, None
        if item is None:
            return
        text, where = item["text"], {"item_id": item["id"], "output_index": item["index"], "content_index": 0}
        if item["type"] == "message":
            done = message_item("assistant", text, item["id"], status)
            yield self._event("response.output_text.done", **where, text=text, logprobs=[])
        else:
            done = reasoning_item(text, item["id"], status)
            yield self._event("response.reasoning_text.done", **where, text=text)
        yield self._event("response.content_part.done", **where, part=done["content"][0])
        self.output.append(done)
        yield self._event("response.output_item.done", output_index=item["index"], item=done)

    # -- built-in tools -------------------------------------------------------------------------------
    def _hosted_tool(self, call: ToolCall):
        return self.hosted.tools.tools.get(call.name) if self.hosted is not None else None

    def _listing(self, listing) -> Iterator[dict]:
        index, item = len(self.output), hc.listing_item(listing)
        where = {"item_id": item["id"], "output_index": index}
        yield self._event("response.output_item.added", output_index=index, item={**item, "tools": []})
        yield self._event("response.mcp_list_tools.in_progress", **where)
        yield self._event("response.mcp_list_tools.completed", **where)
        self.output.append(item)
        yield self._event("response.output_item.done", output_index=index, item=item)

    async def _run_hosted(self, text: str, calls: list[ToolCall]) -> AsyncIterator[dict]:
        """Run a round's built-in calls, each as its item and events; the round and their results join
        the turns the next round is prompted with."""
        for event in self._close("completed"):
            yield event
        hosted = self.hosted
        assert hosted is not None
        registry, results = hosted.tools.registry(), []
        for call in calls:
            tool = self._hosted_tool(call)
            if tool is None:
                continue
            try:
                args = json.loads(call.arguments)
            except ValueError:
                args = {}
            args = args if isinstance(args, dict) else {}
            index, pending = len(self.output), hc.pending_item(tool, call, args)
            where = {"item_id": pending["id"], "output_index": index}
            yield self._event("response.output_item.added", output_index=index, item=pending)
            for name, extra in hc.before_events(tool, call, args):
                yield self._event(name, **where, **extra)
            if hosted.calls >= hosted.max_calls:
                result = ToolResult(call, error=f"the limit of {hosted.max_calls} tool calls per response is reached")
            else:
                hosted.calls += 1
                started = time.monotonic()
                result = await registry.run(call, hosted.ctx)
                self.run.traffic.metrics.observe_tool("mcp" if tool.kind == "mcp" else call.name,
                                                      time.monotonic() - started, result.error is not None)
            item = hc.finished_item(pending, tool, call, args, result, hosted)
            for name, extra in hc.after_events(tool, item):
                yield self._event(name, **where, **extra)
            self.output.append(item)
            yield self._event("response.output_item.done", output_index=index, item=shown(item))
            results.append(result.model_text())
        hosted.turns = hosted.turns + [{"role": "assistant", "content": text, "tool_calls": calls}] + [
            {"role": "tool", "content": r} for r in results]
        ask, spent = self.run.ask, hosted.calls >= hosted.max_calls
        if ask.tools is not None and (spent or ask.tools.forced):
            # no more calls (read as plain text), or the forced call made: the model may answer now
            unforced = {"constraint": None} if ask.tools.forced else {}
            self.run.ask = replace(ask, tools=replace(ask.tools, choice="none" if spent else "auto"), **unforced)

    def _call(self, call: ToolCall) -> Iterator[dict]:
        yield from self._close("completed")
        index = len(self.output)
        done = function_call_item(call)
        where = {"item_id": done["id"], "output_index": index}
        yield self._event("response.output_item.added", output_index=index,
                          item={**done, "arguments": "", "status": "in_progress"})
        yield self._event("response.function_call_arguments.delta", **where, delta=call.arguments)
        yield self._event("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments)
        self.output.append(done)
        yield self._event("response.output_item.done", output_index=index, item=done)

    # -- the response --------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _object(self, status: str, usage: dict | None = None, details: dict | None = None) -> dict:
        output = [shown(it) for it in self.output]
        return response_object(self.draft, self.run.limits.model, status, output, usage, details)

    async def aclose(self) -> None:
        """Close the current round's stream (aborting it if it still runs) and free what a round kept."""
        await self.pieces.aclose()
        release_kv(self.run)

    def _usage(self) -> dict:
        u = self.run.used  # every round's
        thinking = "".join(p["text"] for it in self.output if it["type"] == "reasoning" for p in it["content"])
        # The engine counts the answer's tokens as one; the thinking's share is its text counted again.
        reasoning = min(u.completion_tokens, self.run.pipeline.backend.count_tokens(thinking)) if thinking else 0
        return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": u.total_tokens}

    def _row(self, status: str, details: dict | None) -> StoredResponse:
        d = self.draft
        assert self.final is not None
        return StoredResponse(id=d.id, user_id=d.user_id, model=self.run.limits.model, status=status,
                              previous_response_id=d.previous_response_id, instructions=d.instructions,
                              input_items=d.input_items, output_items=self.output, usage=self.final["usage"],
                              params=d.params, details=details,
                              created=datetime.fromtimestamp(d.created_at, timezone.utc))

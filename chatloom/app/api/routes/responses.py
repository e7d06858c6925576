"""The OpenAI Responses API: POST /v1/responses (streamed or not), GET and DELETE /v1/responses/{id}, and
GET /v1/responses/{id}/input_items.

A format adapter over the shared generation pipeline, as the chat completions route is: the request becomes
an `Ask` and a chat prompt (the thread behind `previous_response_id`, then the new input items), and
app/responses/ turns the pipeline's pieces into output items and semantic events and stores the response
(with `store`, the default). Another user's response id is a 404, exactly as an unknown one. Built-in
tools (web_search, file_search, code_interpreter, mcp) run on the server between rounds of the same run
(responses/writer.py); the code interpreter's container is the response's own scratch folder.
"""
from __future__ import annotations

from contextlib import aclosing
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask

from chatloom.app.api.deps import Ctx, CurrentUser, SessionDep
from chatloom.app.api.hosted_tools_in import hosted_tools
from chatloom.app.api.openai_schemas import MAX_TOOL_OUTPUT_CHARS, ChatCompletionIn
from chatloom.app.api.openapi_responses import OPENAI_ANSWER, errors, event_stream
from chatloom.app.api.response_images import read_turn_images
from chatloom.app.api.responses_out import InputItemListOut, ResponseDeletedOut, ResponseOut
from chatloom.app.api.responses_schemas import ResponseCreateIn
from chatloom.app.api.run_start import begin_run, reserve_run
from chatloom.app.api.sse import SSE_HEADERS, EventStreamResponse, frame
from chatloom.app.generation.pipeline import ChatPrompt
from chatloom.app.generation.tool_calls import render_messages
from chatloom.app.generation.tool_kv import keeps_kv
from chatloom.app.responses.hosted_calls import HostedRun
from chatloom.app.responses.items import input_items, prompt_turns
from chatloom.app.responses.stored import ResponseStore, page
from chatloom.app.responses.writer import Draft, ResponseWriter, stored_object
from chatloom.app.tools.registry import ToolContext

router = APIRouter(prefix="/v1", tags=["responses"])

STREAM = event_stream(
    "One response object; with `stream: true`, server-sent events named by their `type`, each with a "
    "`sequence_number`: response.created, response.in_progress, response.output_item.added, "
    "response.content_part.added, response.output_text.delta, response.reasoning_text.delta, "
    "response.function_call_arguments.delta, their .done events, the built-in tools' events "
    "(response.web_search_call.*, response.file_search_call.*, response.code_interpreter_call.*, "
    "response.code_interpreter_call_code.*, response.mcp_list_tools.*, response.mcp_call.*, "
    "response.mcp_call_arguments.*), response.output_item.done, then response.completed, "
    "response.incomplete or response.failed.",
    {"type": "string", "contentMediaType": "application/json"}, ResponseOut)


@router.post("/responses", responses=STREAM | OPENAI_ANSWER)
async def create_response(body: ResponseCreateIn, ctx: Ctx, user: CurrentUser, session: SessionDep):
    body.function_tools()  # a tool of an unknown type is refused before any built-in is set up
    draft = Draft(user.id, input_items(body.input), body.shown(), body.instructions, body.previous_response_id,
                  body.store)
    store = ResponseStore(ctx.db)
    thread = await store.thread(user.id, body.previous_response_id) if body.previous_response_id else []
    turns = prompt_turns(body.instructions, thread + draft.input_items, MAX_TOOL_OUTPUT_CHARS)
    hosted = await hosted_tools(body.tools or [], ctx.hosted, session, user.id)
    tools = body.tool_use(hosted.specs())
    ask = body.to_ask(user, draft.id, tools)
    turns = await read_turn_images(ctx, user, session, turns, body.model)  # input_image parts
    prompt = ChatPrompt(render_messages(turns, tools))
    settings = ctx.settings
    run = await reserve_run(ctx.pipeline, ask, prompt, ChatCompletionIn.user_text(prompt),
                            settings.chat.tool_rounds_reserved if hosted else 0)
    run.keeps_kv = bool(hosted) and keeps_kv(run)  # built-ins run between rounds: the KV cache policy applies
    run, pieces, first = await begin_run(run, prompt, session)
    tool_ctx = ToolContext(user, ctx.db, f"{draft.id}-code", ctx.blobs, settings)
    run_tools = HostedRun(hosted, turns, tool_ctx, set(body.include or []),
                          settings.chat.max_tool_calls_per_answer) if hosted else None
    writer = ResponseWriter(draft, run, pieces, first, store, run_tools)

    if not body.stream:
        try:
            return JSONResponse(await writer.whole())
        finally:
            await writer.aclose()
            await run.close()

    async def events():
        ended = False  # the response went out whole: the run is closed after the response (see below)
        try:
            async with aclosing(writer.events()) as stream:
                async for event in stream:
                    yield frame(event, event=event["type"])
            ended = True
        finally:
            await writer.aclose()  # a client that left aborts the request
            if not ended:
                await run.close()

    # Metering (a database write) runs once the response is complete, as on the other OpenAI routes.
    return EventStreamResponse(events(), headers=SSE_HEADERS, background=BackgroundTask(run.close))


@router.get("/responses/{response_id}", response_model=ResponseOut, responses=errors(401, 404))
async def get_response(response_id: str, ctx: Ctx, user: CurrentUser) -> JSONResponse:
    return JSONResponse(stored_object(await ResponseStore(ctx.db).get(user.id, response_id)))


@router.delete("/responses/{response_id}", response_model=ResponseDeletedOut, responses=errors(401, 404))
async def delete_response(response_id: str, ctx: Ctx, user: CurrentUser) -> ResponseDeletedOut:
    await ResponseStore(ctx.db).delete(user.id, response_id)
    return ResponseDeletedOut(id=response_id, object="response", deleted=True)


@router.get("/responses/{response_id}/input_items", response_model=InputItemListOut, responses=errors(401, 404))
async def list_input_items(response_id: str, ctx: Ctx, user: CurrentUser,
                           after: Annotated[str | None, Query(max_length=64)] = None,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20,
                           order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc") -> InputItemListOut:
    """The items the response was given (its own `input`, not the thread before it), newest first unless
    `order` is asc; `after` an item id, for the next page."""
    row = await ResponseStore(ctx.db).get(user.id, response_id)
    chosen = page(row.input_items, after, limit, order)
    items = chosen.items
    return InputItemListOut(object="list", data=items, first_id=items[0]["id"] if items else None,
                            last_id=items[-1]["id"] if items else None, has_more=chosen.has_more)

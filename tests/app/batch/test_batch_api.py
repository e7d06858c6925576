"""The files and batches APIs with the official `openai` package: upload, list, retrieve, content and
delete; a batch run to its end with output and error files in OpenAI's format; cancel; another user's
file or batch is a 404; an oversized upload a 413 with nothing stored."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from chatloom.store.batches import Batch
from chatloom.store.models import StoredFile
from sqlalchemy import func, select

from app_testing import signup

MODEL = "tiny-random"


def sdk_for(app, headers: dict) -> openai.AsyncOpenAI:
    token = headers["Authorization"].split(" ", 1)[1]
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key=token, max_retries=0, http_client=http)


def chat_line(custom_id: str, text: str = "Say hello.", **body) -> bytes:
    req = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
           "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                    "temperature": 0, **body}}
    return json.dumps(req).encode()


async def wait_for_status(sdk: openai.AsyncOpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 60):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        batch = await sdk.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert loop.time() < deadline, f"batch still {batch.status}"
        await asyncio.sleep(0.05)


def jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


async def test_files_upload_list_retrieve_content_delete(app, client, alice):
    sdk = sdk_for(app, alice)
    data = chat_line("a") + b"\n" + chat_line("b") + b"\n"
    first = await sdk.files.create(file=("in.jsonl", data), purpose="batch")
    assert (first.object, first.filename, first.purpose, first.bytes, first.status) == \
           ("file", "in.jsonl", "batch", len(data), "processed")
    other = await sdk.files.create(file=("notes.txt", b"some notes"), purpose="user_data")
    listed = await sdk.files.list()
    assert [f.id for f in listed.data] == [other.id, first.id]  # newest first
    assert [f.id for f in (await sdk.files.list(purpose="batch")).data] == [first.id]
    assert [f.id for f in (await sdk.files.list(order="asc", limit=1)).data] == [first.id]
    page = await client.get("/v1/files", headers=alice, params={"limit": 1})
    assert page.json()["has_more"] is True and page.json()["last_id"] == other.id
    assert (await sdk.files.retrieve(first.id)).bytes == len(data)
    assert (await sdk.files.content(first.id)).content == data
    deleted = await sdk.files.delete(first.id)
    assert deleted.deleted is True and deleted.id == first.id
    with pytest.raises(openai.NotFoundError):
        await sdk.files.retrieve(first.id)
    assert not list((app.state.ctx.blobs.root / "files").rglob(first.id))  # the bytes went with the row


async def test_bad_purpose_and_oversized_upload(app, client, alice, settings):
    sdk = sdk_for(app, alice)
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune-me")
    assert e.value.body["param"] == "purpose"
    settings.files.max_bytes = {"batch": 100, "default": 1000}
    with pytest.raises(openai.APIStatusError) as e:
        await sdk.files.create(file=("big.jsonl", b"x" * 101), purpose="batch")
    assert e.value.status_code == 413 and "at most 100 bytes" in e.value.message
    await sdk.files.create(file=("ok.txt", b"x" * 101), purpose="user_data")  # its own limit
    async with app.state.ctx.db.session() as session:
        assert await session.scalar(select(func.count()).select_from(StoredFile)) == 1
    assert len([p for p in (app.state.ctx.blobs.root / "files").rglob("*") if p.is_file()]) == 1


async def test_a_batch_runs_to_completion_with_output_and_error_files(app, alice):
    sdk = sdk_for(app, alice)
    lines = [chat_line("first", "Say hello."),
             b"{not json",
             chat_line("second", "Count to three."),
             b"",
             json.dumps({"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL}}).encode(),
             chat_line("first", "Again."),
             chat_line("too-long", max_tokens=10 ** 9),
             json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": "hi"}}).encode()]
    source = await sdk.files.create(file=("in.jsonl", b"\n".join(lines) + b"\n"), purpose="batch")
    batch = await sdk.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                     completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = await wait_for_status(sdk, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 2, 5)
    assert done.completed_at and done.in_progress_at and done.finalizing_at
    output = jsonl((await sdk.files.content(done.output_file_id)).content)
    assert [o["custom_id"] for o in output] == ["first", "second"]
    for o in output:
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 4
        assert body["choices"][0]["message"]["role"] == "assistant"
    assert (await sdk.files.retrieve(done.output_file_id)).purpose == "batch_output"
    errors = jsonl((await sdk.files.content(done.error_file_id)).content)
    by_line = {e["error"]["line"]: e for e in errors if e["error"]}
    assert by_line[2]["error"]["code"] == "invalid_json_line" and by_line[2]["custom_id"] is None
    assert by_line[5]["custom_id"] == "bad-body" and "messages" in by_line[5]["error"]["message"]
    assert by_line[6]["error"]["code"] == "duplicate_custom_id"
    assert by_line[8]["error"]["code"] == "invalid_url"
    refused = [e for e in errors if e["response"]]
    assert [e["custom_id"] for e in refused] == ["too-long"]
    assert refused[0]["response"]["status_code"] == 400 and refused[0]["response"]["body"]["error"]["param"]
    listed = await sdk.batches.list()
    assert [b.id for b in listed.data] == [batch.id]


async def test_batch_tokens_count_at_the_discount(app, alice, settings):
    settings.batch.quota_discount = 0.25
    sdk = sdk_for(app, alice)
    source = await sdk.files.create(file=("in.jsonl", chat_line("one") + b"\n"), purpose="batch")
    batch = await sdk.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = await wait_for_status(sdk, batch.id, ("completed",))
    body = jsonl((await sdk.files.content(done.output_file_id)).content)[0]["response"]["body"]
    ctx = app.state.ctx
    state = await ctx.traffic.quotas.state(await _user_id(ctx, source.id), ctx.traffic.tiers.for_user("free"))
    used = state.day_used  # batch lines count against the day only
    # Cached prompt tokens count at their own discount first; then the batch pays a quarter, rounded up.
    cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    full = body["usage"]["total_tokens"] - int(cached * settings.traffic.cached_input_discount)
    assert used == -(-full // 4)


async def _user_id(ctx, file_id: str) -> str:
    async with ctx.db.session() as session:
        return (await session.get(StoredFile, file_id)).user_id


async def test_cancel_stops_a_batch(app, alice, settings):
    settings.batch.concurrency = 1
    sdk = sdk_for(app, alice)
    data = b"\n".join(chat_line(f"r{i}", max_tokens=16) for i in range(200))
    source = await sdk.files.create(file=("in.jsonl", data), purpose="batch")
    batch = await sdk.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    running = await wait_for_status(sdk, batch.id, ("in_progress",))
    cancelling = await sdk.batches.cancel(running.id)
    assert cancelling.status in ("cancelling", "cancelled")
    ended = await wait_for_status(sdk, batch.id, ("cancelled",))
    assert ended.cancelled_at and ended.request_counts.completed < 200
    if ended.output_file_id:
        assert len(jsonl((await sdk.files.content(ended.output_file_id)).content)) == ended.request_counts.completed
    with pytest.raises(openai.ConflictError):
        done = await sdk.files.create(file=("in.jsonl", chat_line("x")), purpose="batch")
        finished = await sdk.batches.create(input_file_id=done.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        await wait_for_status(sdk, finished.id, ("completed",))
        await sdk.batches.cancel(finished.id)


async def test_another_users_file_and_batch_are_404(app, client, alice, bob):
    mine, theirs = sdk_for(app, alice), sdk_for(app, bob)
    source = await mine.files.create(file=("in.jsonl", chat_line("a")), purpose="batch")
    batch = await mine.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (theirs.files.retrieve(source.id), theirs.files.content(source.id), theirs.files.delete(source.id),
                 theirs.batches.retrieve(batch.id), theirs.batches.cancel(batch.id),
                 theirs.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            await call
    assert (await theirs.files.list()).data == [] and (await theirs.batches.list()).data == []
    await wait_for_status(mine, batch.id, ("completed",))


async def test_bad_batch_requests_are_named(app, alice):
    sdk = sdk_for(app, alice)
    source = await sdk.files.create(file=("in.jsonl", chat_line("a")), purpose="batch")
    notes = await sdk.files.create(file=("n.txt", b"hi"), purpose="user_data")
    cases = [({"endpoint": "/v1/nothing"}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
             ({"input_file_id": notes.id}, "input_file_id")]
    for change, param in cases:
        args = {"input_file_id": source.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **change}
        with pytest.raises(openai.BadRequestError) as e:
            await sdk.batches.create(**args)
        assert param in str(e.value.body), e.value.body


async def test_a_file_of_no_requests_fails_the_batch(app, alice):
    sdk = sdk_for(app, alice)
    source = await sdk.files.create(file=("in.jsonl", b"\n\n"), purpose="batch")
    batch = await sdk.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = await wait_for_status(sdk, batch.id, ("failed",))
    assert failed.errors.data[0].code == "empty_file" and failed.failed_at

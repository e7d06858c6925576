"""What a batch line leaves in the output or error file, in OpenAI's format, and writing those files.

Output file: one `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}` per
request answered with a 200. Error file: the same for a request the API refused (its status code and
error body), and `{"id", "custom_id", "response": null, "error": {"code", "message", "line"}}` for a line
that never ran (not a valid request, or left when the batch expired). Both are in input line order.
"""
from __future__ import annotations

import json
import uuid

from chatloom.app.core.errors import error_body
from chatloom.store import Database
from chatloom.store.batches import Batch, Batches
from chatloom.store.blobs import BlobStore
from chatloom.store.files import StoredFiles

PAGE = 1000


def request_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def answered(custom_id: str, rid: str, status: int, body: dict) -> dict:
    return {"id": rid, "custom_id": custom_id, "response": {"status_code": status, "request_id": rid, "body": body},
            "error": None}


def refused(custom_id: str, rid: str, status: int, message: str, code: str | None, param: str | None) -> dict:
    return answered(custom_id, rid, status, error_body(status, message, code, param))


def never_ran(custom_id: str | None, line: int, code: str, message: str) -> dict:
    return {"id": request_id(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message, "line": line}}


async def write_files(db: Database, blobs: BlobStore, batch: Batch) -> None:
    """Write the output and error files of an ended batch (each only when it has lines) and record their ids
    on the batch as each is saved, so a gateway that takes over finalizing does not write one twice."""
    for status, name, column in (("done", "output", "output_file_id"), ("failed", "error", "error_file_id")):
        if getattr(batch, column) is not None:
            continue
        data = await _collect(db, batch.id, status)
        if not data:
            continue
        async with db.session() as session:
            row = await StoredFiles(session, blobs).save(batch.user_id, f"{batch.id}_{name}.jsonl", "batch_output",
                                                         data, content_type="application/jsonl")
            stored = await session.get(Batch, batch.id)
            setattr(stored, column, row.id)
            setattr(batch, column, row.id)
            await session.commit()


async def _collect(db: Database, batch_id: str, status: str) -> bytes:
    parts: list[bytes] = []
    after = 0
    while True:
        async with db.session() as session:
            rows = await Batches(session).ended_lines(batch_id, status, after, PAGE)
        for row in rows:
            parts.append(json.dumps(row.result, ensure_ascii=False).encode() + b"\n")
        if len(rows) < PAGE:
            return b"".join(parts)
        after = rows[-1].line

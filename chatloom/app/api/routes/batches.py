"""OpenAI's Batch API: /v1/batches create, retrieve, list, cancel.

A batch is a row in the database (store/batches.py); the gateways' batch runners (app/batch/runner.py)
validate it, run its lines in the batch traffic class and write its output and error files. Creating
or cancelling one here nudges this gateway's runner so it starts at once. Another user's batch, or
input file, is a 404.
"""
from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Query, Request
from sqlalchemy import update

from chatloom.app.api.batch_schemas import BatchIn, BatchList, BatchOut
from chatloom.app.api.deps import Ctx, CurrentUser, SessionDep
from chatloom.app.api.openapi_responses import errors
from chatloom.app.core.errors import ApiError
from chatloom.store.batches import Batch, Batches
from chatloom.store.files import StoredFiles
from chatloom.store.models import utcnow

router = APIRouter(prefix="/v1", tags=["batches"])

WINDOW = timedelta(hours=24)


def _runner(request: Request):
    return getattr(request.app.state, "batch_runner", None)


def _batch_not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"no batch with id {batch_id!r}", "batch_not_found", "batch_id")


@router.post("/batches", response_model=BatchOut, responses=errors(400, 401, 404))
async def create_batch(body: BatchIn, request: Request, ctx: Ctx, user: CurrentUser, session: SessionDep) -> BatchOut:
    """Run every request of a `batch` file against `endpoint`, in capacity interactive traffic leaves idle."""
    runner = _runner(request)
    served = sorted(runner.endpoints) if runner is not None else []
    if body.endpoint not in served:
        raise ApiError(400, f"endpoint must be one of {', '.join(served)}, not {body.endpoint!r}",
                       "invalid_value", "endpoint")
    source = await StoredFiles(session, ctx.blobs).get_owned(user.id, body.input_file_id)
    if source is None:
        raise ApiError(404, f"no file with id {body.input_file_id!r}", "file_not_found", "input_file_id")
    if source.purpose != "batch":
        raise ApiError(400, f"the input file must have purpose 'batch', not {source.purpose!r}", "invalid_value",
                       "input_file_id")
    now = utcnow()
    batch = Batch(user_id=user.id, endpoint=body.endpoint, input_file_id=source.id,
                  completion_window=body.completion_window, status="validating", meta=body.metadata, created=now,
                  expires_at=now + WINDOW, total=0, completed=0, failed=0)
    session.add(batch)
    await session.commit()
    runner.nudge()
    return BatchOut.of(batch)


@router.get("/batches/{batch_id}", response_model=BatchOut, responses=errors(401, 404))
async def get_batch(batch_id: str, user: CurrentUser, session: SessionDep) -> BatchOut:
    batch = await Batches(session).get_owned(user.id, batch_id)
    if batch is None:
        raise _batch_not_found(batch_id)
    return BatchOut.of(batch)


@router.get("/batches", response_model=BatchList, responses=errors(401))
async def list_batches(user: CurrentUser, session: SessionDep, after: str | None = Query(None, max_length=40),
                       limit: int = Query(20, ge=1, le=100)) -> BatchList:
    """The caller's batches, newest first, `limit` at a time after the batch `after`."""
    rows = await Batches(session).page(user.id, after, limit + 1)
    data = [BatchOut.of(b) for b in rows[:limit]]
    return BatchList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                     has_more=len(rows) > limit)


@router.post("/batches/{batch_id}/cancel", response_model=BatchOut, responses=errors(401, 404, 409))
async def cancel_batch(batch_id: str, request: Request, user: CurrentUser, session: SessionDep) -> BatchOut:
    """Stop a batch: it is `cancelling` until the requests running end, then `cancelled`, with the output and
    error files of what ended before."""
    batches = Batches(session)
    batch = await batches.get_owned(user.id, batch_id)
    if batch is None:
        raise _batch_not_found(batch_id)
    if batch.status in ("cancelling", "cancelled"):
        return BatchOut.of(batch)
    changed = await session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.status.in_(("validating", "in_progress")))
        .values(status="cancelling", cancelling_at=utcnow()).execution_options(synchronize_session=False))
    await session.commit()
    batch = await batches.get_owned(user.id, batch_id)
    if changed.rowcount != 1 and batch.status not in ("cancelling", "cancelled"):
        raise ApiError(409, f"the batch is {batch.status} and can no longer be cancelled", "batch_not_cancellable",
                       "batch_id")
    runner = _runner(request)
    if runner is not None:
        runner.nudge()
    return BatchOut.of(batch)

"""The files and batches APIs' objects, in OpenAI's shapes (what the official SDKs parse)."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from chatloom.store.batches import Batch
from chatloom.store.models import StoredFile

MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


def _ts(when: datetime | None) -> int | None:
    if when is None:
        return None
    if when.tzinfo is None:  # SQLite hands timestamps back without their zone; they were written in UTC
        when = when.replace(tzinfo=timezone.utc)
    return int(when.timestamp())


class FileOut(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: str = Field(description="uploaded, processed or error")
    status_details: str | None = None

    @classmethod
    def of(cls, row: StoredFile) -> "FileOut":
        return cls(id=row.id, bytes=row.bytes, created_at=_ts(row.created), expires_at=_ts(row.expires_at),
                   filename=row.filename, purpose=row.purpose, status=row.status, status_details=row.status_details)


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileOut]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str = Field(min_length=1, max_length=40)
    endpoint: str = Field(min_length=1, max_length=64)
    completion_window: Literal["24h"]
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16,
                                                             description="up to 16 pairs of strings")


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchErrorOut(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorOut]


class BatchOut(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None

    @classmethod
    def of(cls, b: Batch) -> "BatchOut":
        errors = BatchErrors(data=[BatchErrorOut(**e) for e in b.errors]) if b.errors else None
        return cls(id=b.id, endpoint=b.endpoint, errors=errors, input_file_id=b.input_file_id,
                   completion_window=b.completion_window, status=b.status, output_file_id=b.output_file_id,
                   error_file_id=b.error_file_id, created_at=_ts(b.created), in_progress_at=_ts(b.in_progress_at),
                   expires_at=_ts(b.expires_at), finalizing_at=_ts(b.finalizing_at), completed_at=_ts(b.completed_at),
                   failed_at=_ts(b.failed_at), expired_at=_ts(b.expired_at), cancelling_at=_ts(b.cancelling_at),
                   cancelled_at=_ts(b.cancelled_at),
                   request_counts=RequestCounts(total=b.total, completed=b.completed, failed=b.failed),
                   metadata=b.meta)


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchOut]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False

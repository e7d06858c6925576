"""Request and response bodies of the files, collections and retrieval routes (routes/files.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from chatloom.app.api.schemas import iso
from chatloom.store.file_chunks import Collection, FileChunk, FileText
from chatloom.store.models import StoredFile

STRICT = ConfigDict(extra="forbid")


class FileOut(BaseModel):
    id: str
    filename: str
    content_type: str | None
    bytes: int
    status: str  # processed: extracted and indexed
    status_details: str | None = None  # e.g. why the passages have no vectors (full-text search only)
    created: str | None

    @classmethod
    def of(cls, f: StoredFile) -> "FileOut":
        return cls(id=f.id, filename=f.filename, content_type=f.content_type, bytes=f.bytes, status=f.status,
                   status_details=f.status_details, created=iso(f.created))


class FileTextOut(BaseModel):
    id: str
    filename: str
    kind: str  # pdf | docx | html | markdown | code | text
    text: str

    @classmethod
    def of(cls, f: StoredFile, body: FileText) -> "FileTextOut":
        return cls(id=f.id, filename=f.filename, kind=body.kind, text=body.text)


class PassageOut(BaseModel):
    chunk_id: int
    file_id: str
    ordinal: int
    page: int | None
    char_start: int
    char_end: int
    text: str

    @classmethod
    def of(cls, c: FileChunk) -> "PassageOut":
        return cls(chunk_id=c.id, file_id=c.file_id, ordinal=c.ordinal, page=c.page, char_start=c.char_start,
                   char_end=c.char_end, text=c.text)


class CollectionIn(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1, max_length=100)


class CollectionOut(BaseModel):
    id: str
    name: str
    created: str | None

    @classmethod
    def of(cls, c: Collection) -> "CollectionOut":
        return cls(id=c.id, name=c.name, created=iso(c.created))


class FileRef(BaseModel):
    model_config = STRICT
    file_id: str = Field(min_length=1, max_length=40)


class AttachIn(BaseModel):
    """One of the caller's files or collections to attach to a conversation."""

    model_config = STRICT
    file_id: str | None = Field(None, max_length=40)
    collection_id: str | None = Field(None, max_length=40)

    @model_validator(mode="after")
    def _one(self) -> "AttachIn":
        if (self.file_id is None) == (self.collection_id is None):
            raise ValueError("give file_id or collection_id (one of them)")
        return self


class AttachedOut(BaseModel):
    files: list[FileOut]  # attached directly
    collections: list[CollectionOut]


class SearchMode(BaseModel):
    mode: Literal["hybrid", "fulltext", "vector"] = "hybrid"

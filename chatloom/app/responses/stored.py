"""Stored responses: saving one, finding the caller's own, deleting it, the thread behind a
`previous_response_id`, and pages of a response's input items. Rows live in the shared database
(store/responses.py), so any gateway can continue any thread."""
from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from chatloom.app.core.errors import ApiError
from chatloom.store import Database, StoredResponse

MAX_THREAD = 1000  # responses followed back through previous_response_id (a guard, not a working limit)


def unknown(response_id: str, param: str | None = None) -> ApiError:
    """Someone else's response is answered exactly as one that does not exist."""
    return ApiError(404, f"no response with id {response_id!r} was found", "response_not_found", param)


@dataclass(frozen=True)
class Page:
    items: list[dict]
    has_more: bool


class ResponseStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def save(self, row: StoredResponse) -> None:
        async with self.db.session() as session:
            session.add(row)
            await session.commit()

    async def get(self, user_id: str, response_id: str, param: str | None = None) -> StoredResponse:
        """The caller's response; 404 naming the id otherwise."""
        async with self.db.session() as session:
            row = await session.get(StoredResponse, response_id)
            if row is None or row.user_id != user_id:
                raise unknown(response_id, param)
            session.expunge(row)
            return row

    async def delete(self, user_id: str, response_id: str) -> None:
        async with self.db.session() as session:
            row = await session.get(StoredResponse, response_id)
            if row is None or row.user_id != user_id:
                raise unknown(response_id)
            await session.delete(row)
            await session.commit()

    async def thread(self, user_id: str, previous_response_id: str) -> list[dict]:
        """Every item of the thread that ends with `previous_response_id`, oldest first: each response's
        input items, then its output items. 404 when that response is not the caller's; a response deleted
        further back ends the thread there."""
        async with self.db.session() as session:
            chain: list[StoredResponse] = []
            next_id: str | None = previous_response_id
            while next_id is not None and len(chain) < MAX_THREAD:
                row = await session.scalar(select(StoredResponse).where(
                    StoredResponse.id == next_id, StoredResponse.user_id == user_id))
                if row is None:
                    if not chain:
                        raise unknown(previous_response_id, "previous_response_id")
                    break
                chain.append(row)
                next_id = row.previous_response_id
        items: list[dict] = []
        for row in reversed(chain):
            items += row.input_items + row.output_items
        return items


def page(items: list[dict], after: str | None, limit: int, order: str) -> Page:
    """One page of items in `order` (asc: as given, desc: newest first), starting after the item `after`."""
    ordered = items if order == "asc" else list(reversed(items))
    start = 0
    if after is not None:
        at = next((i for i, it in enumerate(ordered) if it.get("id") == after), None)
        if at is None:
            raise ApiError(400, f"after: the response has no input item with id {after!r}", "invalid_value", "after")
        start = at + 1
    chosen = ordered[start:start + limit]
    return Page(chosen, start + limit < len(ordered))

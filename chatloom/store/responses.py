"""Stored answers of the Responses API (/v1/responses): one row per response, with the items it was given
and the items it produced, so that `previous_response_id` continues a thread on any gateway."""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, DateTime, ForeignKey, Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from chatloom.store.models import Base, new_id, utcnow


class StoredResponse(Base):
    """A response as GET /v1/responses/{id} returns it. `input_items` and `output_items` are the API's item
    objects (messages, function calls and their outputs), each with its id; `params` holds the request's
    settings echoed back in the response object (temperature, tools, text format...)."""

    __tablename__ = "responses"
    __table_args__ = (Index("ix_responses_user_created", "user_id", "created"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("resp"))
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(255))
    # completed | incomplete | failed
    status: Mapped[str] = mapped_column(String(16))
    # Not a foreign key: deleting a response leaves the ones that continued it (their own items stay).
    previous_response_id: Mapped[str | None] = mapped_column(String(40))
    instructions: Mapped[str | None] = mapped_column(Text)
    input_items: Mapped[list] = mapped_column(JSON)
    output_items: Mapped[list] = mapped_column(JSON)
    usage: Mapped[dict | None] = mapped_column(JSON)
    params: Mapped[dict] = mapped_column(JSON)
    details: Mapped[dict | None] = mapped_column(JSON)  # incomplete_details or error, by status
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

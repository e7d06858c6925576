"""Which stored images a message carries: rows linking a message to files (purpose "vision") in order.

The image's bytes are a file like any other (the `files` table and the blob store); this table says
which message shows it and where, so a conversation's prompt can put each image back in its turn.
"""
from __future__ import annotations

from sqlalchemy import ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from chatloom.store.models import Base

IMAGE_PURPOSE = "vision"


class MessageImage(Base):
    __tablename__ = "message_images"

    message_id: Mapped[str] = mapped_column(ForeignKey("messages.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0, 1, ... in the message
    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), index=True)

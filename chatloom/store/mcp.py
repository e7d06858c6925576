"""The MCP servers users add for themselves (when the deployment allows it): streamable HTTP
endpoints only, reached under the safe fetcher's address rules (app/tools/mcp_servers.py)."""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, DateTime, ForeignKey, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from chatloom.store.models import Base, new_id, utcnow


class UserMcpServer(Base):
    """One user's MCP server: its name (the model sees NAME__TOOL), URL and request headers."""

    __tablename__ = "user_mcp_servers"
    __table_args__ = (UniqueConstraint("user_id", "name"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("mcp"))
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(32))
    url: Mapped[str] = mapped_column(String(2048))
    headers: Mapped[dict] = mapped_column(JSON)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

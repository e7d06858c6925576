"""Persistence: SQLAlchemy models, repositories, Alembic migrations. SQLite by default, PostgreSQL by URL."""
from chatloom.store.database import DEFAULT_URL, Database
from chatloom.store.message_images import MessageImage  # noqa: F401 (in the metadata the migrations match)
from chatloom.store.models import AnswerChunk, ApiKey, Base, Conversation, DailyUsage, Feedback, Message, User, new_id
from chatloom.store.responses import StoredResponse
from chatloom.store.mcp import UserMcpServer  # noqa: F401 - its table joins the metadata
# Retrieval's tables (their own module): imported here so the metadata, and so migrations, see them.
from chatloom.store import file_chunks  # noqa: F401
from chatloom.store import batches  # noqa: F401 (the Batch API's tables)
from chatloom.store.audit import AuditEvent
from chatloom.store.accounts_extra import CustomInstructions, Identity, Memory, SharedLink
from chatloom.store.repositories import AnswerChunks, ApiKeys, Conversations, FeedbackRows, Messages, UsageRows, Users

__all__ = ["DEFAULT_URL", "Database", "AnswerChunk", "AnswerChunks", "ApiKey", "Base", "Conversation", "Message", "User",
           "new_id", "ApiKeys", "Conversations", "Messages", "Users", "DailyUsage", "Feedback", "UsageRows", "FeedbackRows",
           "StoredResponse", "CustomInstructions", "Identity", "Memory", "SharedLink"]

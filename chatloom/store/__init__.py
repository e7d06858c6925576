"""Persistence: SQLAlchemy models, repositories, Alembic migrations. SQLite by default, PostgreSQL by URL."""
from chatloom.store.database import DEFAULT_URL, Database
from chatloom.store.models import AnswerChunk, ApiKey, Base, Conversation, DailyUsage, Feedback, Message, User, new_id
from chatloom.store.responses import StoredResponse
from chatloom.store.accounts_extra import CustomInstructions, Identity, Memory, SharedLink
from chatloom.store.repositories import AnswerChunks, ApiKeys, Conversations, FeedbackRows, Messages, UsageRows, Users

__all__ = ["DEFAULT_URL", "Database", "AnswerChunk", "AnswerChunks", "ApiKey", "Base", "Conversation", "Message", "User",
           "new_id", "ApiKeys", "Conversations", "Messages", "Users", "DailyUsage", "Feedback", "UsageRows", "FeedbackRows",
           "StoredResponse", "CustomInstructions", "Identity", "Memory", "SharedLink"]

"""Persistence: SQLAlchemy models, repositories, Alembic migrations. SQLite by default, PostgreSQL by URL."""
from chatloom.store.database import DEFAULT_URL, Database
from chatloom.store.models import AnswerChunk, ApiKey, Base, Conversation, Feedback, Message, Usage, User, new_id
from chatloom.store.repositories import AnswerChunks, ApiKeys, Conversations, FeedbackRows, Messages, UsageRows, Users

__all__ = ["DEFAULT_URL", "Database", "AnswerChunk", "AnswerChunks", "ApiKey", "Base", "Conversation", "Message", "User", "new_id",
           "ApiKeys", "Conversations", "Messages", "Users", "Usage", "Feedback", "UsageRows", "FeedbackRows"]

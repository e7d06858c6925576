"""Persistence: SQLAlchemy models, repositories, Alembic migrations. SQLite by default, PostgreSQL by URL."""
from chatloom.store.database import DEFAULT_URL, Database
from chatloom.store.models import ApiKey, Base, Conversation, Message, User, new_id
from chatloom.store.repositories import ApiKeys, Conversations, Messages, Users

__all__ = ["DEFAULT_URL", "Database", "ApiKey", "Base", "Conversation", "Message", "User", "new_id",
           "ApiKeys", "Conversations", "Messages", "Users"]

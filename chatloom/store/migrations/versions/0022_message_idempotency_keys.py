"""a user message's Idempotency-Key, unique within its conversation

A client whose send broke before the reply cannot tell whether the message was stored. Sending it again
with the same key returns the stored message's answer; without the key a gateway that was slow (or
paused) and stored it late would leave the message, its answer and its usage twice.

Revision ID: 0022
Revises: 0021
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("client_key", sa.String(length=100), nullable=True))
    op.create_index("uq_messages_conversation_client_key", "messages", ["conversation_id", "client_key"],
                    unique=True)


def downgrade() -> None:
    op.drop_index("uq_messages_conversation_client_key", table_name="messages")
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("client_key")

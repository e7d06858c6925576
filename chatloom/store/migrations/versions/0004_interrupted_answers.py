"""messages: heartbeat of answers being written, and why an answer was interrupted

Revision ID: 0004
Revises: 0003
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("heartbeat", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("interrupted_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("interrupted_reason")
        batch.drop_column("heartbeat")

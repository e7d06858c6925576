"""messages: heartbeat of answers being written, and why an answer was interrupted

Revision ID: 0003
Revises: 0002
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
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

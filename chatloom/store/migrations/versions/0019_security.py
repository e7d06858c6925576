"""security: API key scopes and expiry, session versions, the audit log

Revision ID: 0019
Revises: 0014
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        # Keys made before scopes existed keep every right their owner has.
        batch.add_column(sa.Column("scopes", sa.String(length=64), server_default="read chat admin", nullable=False))
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("users") as batch:
        batch.add_column(sa.Column("session_version", sa.Integer(), server_default="0", nullable=False))
    op.create_table(
        "audit_events",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("actor_id", sa.String(length=40), nullable=True),
        sa.Column("actor_name", sa.String(length=64), nullable=True),
        sa.Column("address", sa.String(length=64), nullable=True),
        sa.Column("target", sa.String(length=200), nullable=True),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    op.create_index("ix_audit_events_at", "audit_events", ["at"], unique=False)
    op.create_index("ix_audit_events_actor_at", "audit_events", ["actor_id", "at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_audit_events_actor_at", table_name="audit_events")
    op.drop_index("ix_audit_events_at", table_name="audit_events")
    op.drop_table("audit_events")
    with op.batch_alter_table("users") as batch:
        batch.drop_column("session_version")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("expires_at")
        batch.drop_column("scopes")

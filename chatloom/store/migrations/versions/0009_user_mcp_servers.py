"""the MCP servers users add for themselves

Revision ID: 0009
Revises: 0008
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "user_mcp_servers",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("user_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("url", sa.String(length=2048), nullable=False),
        sa.Column("headers", sa.JSON(), nullable=False),
        sa.Column("created", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], name=op.f("fk_user_mcp_servers_user_id_users"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_user_mcp_servers")),
        sa.UniqueConstraint("user_id", "name", name=op.f("uq_user_mcp_servers_user_id")),
    )
    op.create_index(op.f("ix_user_mcp_servers_user_id"), "user_mcp_servers", ["user_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_user_mcp_servers_user_id"), table_name="user_mcp_servers")
    op.drop_table("user_mcp_servers")

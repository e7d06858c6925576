"""answer text journaled as it streams, and the process writing each answer

Revision ID: 0006
Revises: 0005
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("writer", sa.String(length=120), nullable=True))
    op.create_table(
        "answer_chunks",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("message_id", sa.String(length=40), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["message_id"], ["messages.id"], name=op.f("fk_answer_chunks_message_id_messages"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_answer_chunks")),
    )
    op.create_index(op.f("ix_answer_chunks_message_id"), "answer_chunks", ["message_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_answer_chunks_message_id"), table_name="answer_chunks")
    op.drop_table("answer_chunks")
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("writer")

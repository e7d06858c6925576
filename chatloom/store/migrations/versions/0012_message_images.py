"""images in messages: which stored files (purpose vision) a message carries, in order

Revision ID: 0012
Revises: 0011
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "message_images",
        sa.Column("message_id", sa.String(length=40), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("file_id", sa.String(length=40), nullable=False),
        sa.ForeignKeyConstraint(["message_id"], ["messages.id"], name=op.f("fk_message_images_message_id_messages"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"], name=op.f("fk_message_images_file_id_files"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("message_id", "position", name=op.f("pk_message_images")),
    )
    op.create_index(op.f("ix_message_images_file_id"), "message_images", ["file_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_message_images_file_id"), table_name="message_images")
    op.drop_table("message_images")

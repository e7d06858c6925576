"""the tokens an answer generated, kept with the message

`tokens` counts the saved text again (for prompt assembly), which differs from what the model generated
(a random model's text re-tokenizes to more tokens, a continued answer's first part was made elsewhere).
`completion_tokens` is what was generated and metered, so an answer's end event reports the same
figure whichever gateway writes it.

Revision ID: 0021
Revises: 0020
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("completion_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("completion_tokens")

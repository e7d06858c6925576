"""Metering: tokens per user, UTC day and model, written to the database as generations end."""
from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

from sqlalchemy.exc import IntegrityError

from chatloom.serving import Usage
from chatloom.store import Database, UsageRows

log = logging.getLogger(__name__)


def utc_day(ts: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if ts is None else ts, timezone.utc).strftime("%Y-%m-%d")


class Meter:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def record(self, user_id: str, model: str, usage: Usage) -> None:
        """Add one request's tokens. Failures are logged, never raised: metering must not break an answer."""
        day = utc_day()
        for attempt in range(3):
            try:
                async with self.db.session() as session:
                    await UsageRows(session).add(user_id, day, model, usage.prompt_tokens, usage.completion_tokens,
                                                 usage.cached_tokens)
                    await session.commit()
                return
            except IntegrityError:  # lost the race to create today's row; the UPDATE will find it now
                continue
            except Exception:
                log.exception("could not meter usage for %s", user_id)
                return
        log.error("could not meter usage for %s after retries", user_id)

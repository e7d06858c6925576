"""An answer's final save, fenced: its outcome and its usage in one transaction, written only while this
process is still the answer's writer.

Two gateways can reach the end of one answer: the one running it, whose job lease lapsed (Redis restarted
without its data, or the gateway froze), and the one that took it over. Each checks that it holds the job
before it saves, but the job can change hands between that check and the save, so the database decides:
`Messages.finish_written` updates the message only while it names this process as its writer and is still
being written (a gateway taking an answer over names itself first, `Messages.claim`, and only while the
answer is in progress), and the usage row is added in the same transaction. Whichever gateway commits
second writes nothing at all. The quota store (memory or Redis) is settled after the commit, by the
answer's job (answer_job.py): the winner settles with the tokens used, the loser leaves the reservation
to the winner, which adopted it with the job.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from chatloom.app.traffic.metering import Meter
from chatloom.serving import Usage
from chatloom.store import AnswerChunks, Conversations, Database, Messages
from chatloom.store.repositories import GONE, LOST, SAVED

__all__ = ["GONE", "LOST", "SAVED", "UNSAVED", "Metered", "save_answer"]

log = logging.getLogger(__name__)

UNSAVED = "unsaved"  # nothing written: the database stayed out of reach, or the usage row could not be
RETRY_S = 15.0  # how long a save rides out an unreachable or locked database (a PostgreSQL restart, say)
BACKOFF_S = (0.05, 1.0)  # the first and the longest pause between tries


@dataclass(frozen=True)
class Metered:
    """The usage row an answer adds: its user's, the model's, the tokens every round of it used."""

    user_id: str
    model: str
    usage: Usage


async def save_answer(db: Database, message_id: str, conversation_id: str, writer: str, values: dict,
                      metered: Metered | None, retry_s: float = RETRY_S) -> str:
    """Save the answer's `values` and add its usage in one transaction, if `writer` still writes it.
    SAVED; LOST (another process has the answer, or it ended: nothing written); GONE (deleted: nothing
    written); UNSAVED (nothing written: the database stayed out of reach for `retry_s`)."""
    deadline = time.monotonic() + retry_s
    delay, collisions = BACKOFF_S[0], 0
    while True:
        try:
            return await _save_once(db, message_id, conversation_id, writer, values, metered)
        except IntegrityError as exc:
            # Another process created the day's usage row meanwhile: the next try's UPDATE finds it. A second
            # collision is no race (the user is gone, say): leave the tokens to the metering queue.
            collisions += 1
            if collisions > 1:
                log.error("could not save the answer %s with its usage: %s", message_id, exc)
                return UNSAVED
            continue
        except (DBAPIError, OSError, PoolTimeout) as exc:  # unreachable, restarting, locked, pool empty
            if time.monotonic() + delay > deadline:
                log.error("could not save the answer %s: the database stayed out of reach for %.0f s: %s",
                          message_id, retry_s, exc)
                return UNSAVED
            log.warning("saving the answer %s failed, retrying in %.2f s: %s", message_id, delay, exc)
        await asyncio.sleep(delay)
        delay = min(delay * 2, BACKOFF_S[1])


async def _save_once(db: Database, message_id: str, conversation_id: str, writer: str, values: dict,
                     metered: Metered | None) -> str:
    async with db.session() as session:
        outcome = await Messages(session).finish_written(message_id, writer, **values)
        if outcome != SAVED:
            return outcome  # the session rolls back: nothing of this process's is written
        if metered is not None:
            await Meter.write(session, metered.user_id, metered.model, metered.usage)
        await AnswerChunks(session).clear([message_id])
        await Conversations(session).touch(conversation_id)
        await session.commit()
    return SAVED

"""Queries, one small class per table. Each takes an AsyncSession; the caller commits."""
from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from sqlalchemy import and_, delete, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.store.models import AnswerChunk, ApiKey, Conversation, DailyUsage, Feedback, Message, User, utcnow


class Users:
    def __init__(self, session: AsyncSession) -> None:
        self.s = session

    async def count(self) -> int:
        return int(await self.s.scalar(select(func.count()).select_from(User)) or 0)

    async def get(self, user_id: str) -> User | None:
        return await self.s.get(User, user_id)

    async def by_username(self, username: str) -> User | None:
        return await self.s.scalar(select(User).where(User.username == username))

    async def create(self, username: str, password_hash: str | None, is_admin: bool = False) -> User:
        user = User(username=username, password_hash=password_hash, is_admin=is_admin)
        self.s.add(user)
        await self.s.flush()
        return user

    async def set_tier(self, username: str, tier: str) -> User | None:
        user = await self.by_username(username)
        if user is not None:
            user.tier = tier
            await self.s.flush()
        return user


class ApiKeys:
    # Writing last_used on every request would make each read a write; a minute's precision is enough.
    TOUCH_EVERY = timedelta(minutes=1)

    def __init__(self, session: AsyncSession) -> None:
        self.s = session

    async def create(self, user_id: str, name: str, prefix: str, key_hash: str, scopes: str = "read chat",
                     expires_at: datetime | None = None) -> ApiKey:
        key = ApiKey(user_id=user_id, name=name, prefix=prefix, key_hash=key_hash, scopes=scopes,
                     expires_at=expires_at)
        self.s.add(key)
        await self.s.flush()
        return key

    async def by_hash(self, key_hash: str) -> ApiKey | None:
        return await self.s.scalar(select(ApiKey).where(ApiKey.key_hash == key_hash))

    async def for_user(self, user_id: str) -> list[ApiKey]:
        rows = await self.s.scalars(select(ApiKey).where(ApiKey.user_id == user_id).order_by(ApiKey.id))
        return list(rows)

    async def delete(self, user_id: str, key_id: str) -> bool:
        result = await self.s.execute(delete(ApiKey).where(ApiKey.id == key_id, ApiKey.user_id == user_id))
        return result.rowcount > 0

    async def delete_all(self, user_id: str) -> int:
        result = await self.s.execute(delete(ApiKey).where(ApiKey.user_id == user_id))
        return result.rowcount or 0

    async def touch(self, key: ApiKey) -> bool:
        now = utcnow()
        last = _aware(key.last_used)
        if last is not None and now - last < self.TOUCH_EVERY:
            return False
        key.last_used = now
        return True


class Conversations:
    def __init__(self, session: AsyncSession) -> None:
        self.s = session

    async def create(self, user_id: str, title: str | None = None) -> Conversation:
        now = utcnow()
        conv = Conversation(user_id=user_id, title=title, created=now, updated=now)
        self.s.add(conv)
        await self.s.flush()
        return conv

    async def get_owned(self, user_id: str, conversation_id: str) -> Conversation | None:
        """The conversation if `user_id` owns it; a foreign one looks exactly like a missing one."""
        return await self.s.scalar(select(Conversation).where(
            Conversation.id == conversation_id, Conversation.user_id == user_id))

    async def get(self, conversation_id: str) -> Conversation | None:
        return await self.s.get(Conversation, conversation_id)

    async def page(self, user_id: str, limit: int, offset: int) -> list[Conversation]:
        rows = await self.s.scalars(
            select(Conversation).where(Conversation.user_id == user_id)
            .order_by(Conversation.updated.desc(), Conversation.id.desc()).limit(limit).offset(offset))
        return list(rows)

    async def delete(self, conversation_id: str) -> None:
        # Messages first and explicitly, so nothing depends on the database enforcing ON DELETE CASCADE.
        await self.s.execute(delete(AnswerChunk).where(AnswerChunk.message_id.in_(
            select(Message.id).where(Message.conversation_id == conversation_id))))
        await self.s.execute(delete(Message).where(Message.conversation_id == conversation_id))
        await self.s.execute(delete(Conversation).where(Conversation.id == conversation_id))

    async def touch(self, conversation_id: str, **values) -> None:
        await self.s.execute(update(Conversation).where(Conversation.id == conversation_id)
                             .values(updated=utcnow(), **values))


def answer_in_progress():
    """An answer still being written: incomplete with no outcome yet."""
    return and_(Message.role == "assistant", Message.status == "incomplete", Message.finish_reason.is_(None))


# What Messages.finish_written found.
SAVED, LOST, GONE = "saved", "lost", "gone"


class Messages:
    def __init__(self, session: AsyncSession) -> None:
        self.s = session

    async def add(self, conversation_id: str, parent_id: str | None, role: str, text: str, tokens: int,
                  model: str | None = None, status: str = "complete", writer: str | None = None,
                  client_key: str | None = None) -> Message:
        now = utcnow()
        msg = Message(conversation_id=conversation_id, parent_id=parent_id, role=role, text=text, tokens=tokens,
                      model=model, status=status, created=now, writer=writer,
                      heartbeat=now if writer is not None else None, client_key=client_key)
        self.s.add(msg)
        await self.s.flush()
        return msg

    async def by_client_key(self, conversation_id: str, client_key: str) -> Message | None:
        """The message a send (its user message) or a regeneration (its answer) with this Idempotency-Key
        stored in the conversation, if any."""
        return await self.s.scalar(select(Message).where(Message.conversation_id == conversation_id,
                                                         Message.client_key == client_key))

    async def first_answer(self, message_id: str) -> Message | None:
        """The oldest answer to a user message: the one its send started."""
        return await self.s.scalar(select(Message).where(Message.parent_id == message_id,
                                                         Message.role == "assistant").order_by(Message.id).limit(1))

    async def get(self, conversation_id: str, message_id: str) -> Message | None:
        return await self.s.scalar(select(Message).where(
            Message.id == message_id, Message.conversation_id == conversation_id))

    async def all_in(self, conversation_id: str) -> list[Message]:
        """Every message of a conversation, oldest first (ids sort by creation)."""
        rows = await self.s.scalars(select(Message).where(Message.conversation_id == conversation_id)
                                    .order_by(Message.id))
        return list(rows)

    async def finish(self, message_id: str, in_progress: bool = False, **values) -> bool:
        """Write a generation's outcome; False when the message is gone (its conversation was deleted) or,
        with `in_progress`, when it is no longer being written (another process ended it)."""
        where = [Message.id == message_id] + ([answer_in_progress()] if in_progress else [])
        result = await self.s.execute(update(Message).where(*where).values(**values))
        return result.rowcount > 0

    async def finish_written(self, message_id: str, writer: str, **values) -> str:
        """Write an answer's outcome only while `writer` still writes it: the row names it and is in
        progress (or a sweep marked it interrupted, taking its writer for dead). This one conditional UPDATE
        fences two processes ending the same answer (the one whose job lease lapsed and the one that took
        it over): the second finds nothing to update. SAVED, GONE (deleted) or LOST (another writer has
        it, or it ended)."""
        mine = and_(Message.id == message_id, Message.writer == writer,
                    or_(answer_in_progress(), Message.status == "interrupted"))
        if (await self.s.execute(update(Message).where(mine).values(**values))).rowcount:
            return SAVED
        return LOST if await self.s.scalar(select(Message.id).where(Message.id == message_id)) else GONE

    async def claim(self, message_id: str, writer: str, **values) -> bool:
        """Become the writer of an answer still in progress (taking it over), with `values`; False when it
        has ended meanwhile (its writer saved it) or is gone."""
        result = await self.s.execute(update(Message).where(Message.id == message_id, answer_in_progress())
                                      .values(writer=writer, **values))
        return result.rowcount > 0


class AnswerChunks:
    """Answer text journaled while it streams (models.AnswerChunk), folded into the message at the end."""

    def __init__(self, session: AsyncSession) -> None:
        self.s = session

    async def add(self, rows: list[dict]) -> None:
        """rows: [{"message_id", "kind", "text", "tokens"}], appended in this order."""
        if rows:
            await self.s.execute(insert(AnswerChunk), rows)

    async def fold(self, message_ids: list[str]) -> None:
        """Append each answer's journaled text (and reasoning) to its message, then drop the rows."""
        if not message_ids:
            return
        rows = await self.s.execute(select(AnswerChunk.message_id, AnswerChunk.kind, AnswerChunk.text,
                                           AnswerChunk.tokens)
                                    .where(AnswerChunk.message_id.in_(message_ids)).order_by(AnswerChunk.id))
        parts: dict[str, dict[str, list[str]]] = defaultdict(lambda: {"text": [], "reasoning": []})
        tokens: dict[str, int] = defaultdict(int)
        for message_id, kind, text, n in rows:
            parts[message_id][kind].append(text)
            tokens[message_id] += n if kind == "text" else 0
        for message_id, kinds in parts.items():
            values = {}
            if kinds["text"]:
                values.update(text=Message.text + "".join(kinds["text"]), tokens=Message.tokens + tokens[message_id])
            if kinds["reasoning"]:
                values["reasoning"] = func.coalesce(Message.reasoning, "") + "".join(kinds["reasoning"])
            await self.s.execute(update(Message).where(Message.id == message_id).values(**values))
        await self.clear(message_ids)

    async def clear(self, message_ids: list[str]) -> None:
        await self.s.execute(delete(AnswerChunk).where(AnswerChunk.message_id.in_(message_ids)))


def _aware(dt: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; everything we store is UTC."""
    if dt is None or dt.tzinfo is not None:
        return dt
    from datetime import timezone
    return dt.replace(tzinfo=timezone.utc)


class UsageRows:
    """Metered tokens per (user, UTC day, model)."""

    def __init__(self, session: AsyncSession) -> None:
        self.s = session

    async def add(self, user_id: str, day: str, model: str, prompt_tokens: int, completion_tokens: int,
                  cached_tokens: int, requests: int = 1) -> None:
        # An UPDATE first: the common case is a row that exists already, and an UPDATE of
        # counters is atomic in SQL, so concurrent writers never lose an increment.
        values = dict(requests=DailyUsage.requests + requests, prompt_tokens=DailyUsage.prompt_tokens + prompt_tokens,
                      completion_tokens=DailyUsage.completion_tokens + completion_tokens,
                      cached_tokens=DailyUsage.cached_tokens + cached_tokens)
        where = (DailyUsage.user_id == user_id, DailyUsage.day == day, DailyUsage.model == model)
        result = await self.s.execute(update(DailyUsage).where(*where).values(**values))
        if result.rowcount:
            return
        # A concurrent writer may insert the same row first: the flush then raises IntegrityError,
        # and the caller retries (the UPDATE above then finds the row).
        self.s.add(DailyUsage(user_id=user_id, day=day, model=model, requests=requests, prompt_tokens=prompt_tokens,
                         completion_tokens=completion_tokens, cached_tokens=cached_tokens))
        await self.s.flush()

    async def query(self, user_id: str | None = None, since: str | None = None,
                    until: str | None = None) -> list[tuple[DailyUsage, str]]:
        """Rows with their username, newest day first."""
        q = select(DailyUsage, User.username).join(User, User.id == DailyUsage.user_id)
        if user_id is not None:
            q = q.where(DailyUsage.user_id == user_id)
        if since is not None:
            q = q.where(DailyUsage.day >= since)
        if until is not None:
            q = q.where(DailyUsage.day <= until)
        rows = await self.s.execute(q.order_by(DailyUsage.day.desc(), User.username, DailyUsage.model))
        return [(u, name) for u, name in rows.all()]

    async def by_tier(self, day: str) -> list[tuple[str, int, int, int, int, int]]:
        """One day's totals per user tier (the tier users have now): (tier, users, requests,
        prompt_tokens, completion_tokens, cached_tokens), by tier name."""
        q = (select(User.tier, func.count(func.distinct(DailyUsage.user_id)), func.sum(DailyUsage.requests),
                    func.sum(DailyUsage.prompt_tokens), func.sum(DailyUsage.completion_tokens),
                    func.sum(DailyUsage.cached_tokens))
             .join(User, User.id == DailyUsage.user_id).where(DailyUsage.day == day)
             .group_by(User.tier).order_by(User.tier))
        return [(tier, *(int(v or 0) for v in rest)) for tier, *rest in (await self.s.execute(q)).all()]


class FeedbackRows:
    def __init__(self, session: AsyncSession) -> None:
        self.s = session

    async def put(self, message_id: str, user_id: str, rating: str, text: str | None) -> Feedback:
        """One feedback per user and message: a second one replaces the first."""
        row = await self.s.scalar(select(Feedback).where(Feedback.message_id == message_id,
                                                         Feedback.user_id == user_id))
        if row is None:
            row = Feedback(message_id=message_id, user_id=user_id, rating=rating, text=text, created=utcnow())
            self.s.add(row)
        else:
            row.rating, row.text, row.created = rating, text, utcnow()
        await self.s.flush()
        return row

    async def for_message(self, message_id: str) -> list[Feedback]:
        return list(await self.s.scalars(select(Feedback).where(Feedback.message_id == message_id)))

    async def ratings(self, user_id: str, message_ids: list[str]) -> dict[str, Feedback]:
        """The user's feedback on each of these messages that has some."""
        if not message_ids:
            return {}
        rows = await self.s.scalars(select(Feedback).where(Feedback.user_id == user_id,
                                                           Feedback.message_id.in_(message_ids)))
        return {f.message_id: f for f in rows}

    async def page(self, limit: int, offset: int, rating: str | None = None) -> list[tuple[Feedback, str, Message]]:
        """Everyone's feedback, newest first, with the author's username and the rated message."""
        q = (select(Feedback, User.username, Message).join(User, User.id == Feedback.user_id)
             .join(Message, Message.id == Feedback.message_id))
        if rating is not None:
            q = q.where(Feedback.rating == rating)
        q = q.order_by(Feedback.created.desc(), Feedback.id.desc()).limit(limit).offset(offset)
        return [tuple(r) for r in (await self.s.execute(q)).all()]

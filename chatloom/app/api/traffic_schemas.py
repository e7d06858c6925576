"""Request bodies and response shapes of the traffic routes: usage, feedback, tiers, reasoning, stats."""
from __future__ import annotations

from dataclasses import asdict
from typing import Literal

from pydantic import BaseModel, Field

from chatloom.app.traffic.admission import REASONING, AdmissionQueue
from chatloom.app.api.schemas import STRICT, iso
from chatloom.app.traffic.tiers import Tier
from chatloom.serving import BackendStats
from chatloom.store import Feedback, Message

class UsageRowOut(BaseModel):
    day: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int


class UserUsageRowOut(UsageRowOut):
    username: str  # the admin view: everyone's rows


class UsageTotals(BaseModel):
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    total_tokens: int = 0


class UsageReport(BaseModel):
    data: list[UserUsageRowOut]
    totals: UsageTotals

    @classmethod
    def of(cls, rows: list) -> "UsageReport":
        items = [UserUsageRowOut(day=u.day, model=u.model, username=name,
                             requests=u.requests, prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                             cached_tokens=u.cached_tokens, total_tokens=u.prompt_tokens + u.completion_tokens)
                 for u, name in rows]
        totals = UsageTotals(**{k: sum(getattr(i, k) for i in items) for k in UsageTotals.model_fields})
        return cls(data=items, totals=totals)


class TierLimits(BaseModel):
    tokens_per_minute: int
    tokens_per_day: int
    requests_per_minute: int
    max_concurrent: int
    max_tokens: int
    models: list[str] | None


class TierOut(TierLimits):
    name: str
    priority: int
    reserved_share: float
    max_file_bytes: int | None = Field(None, description="The tier's largest document upload (null: the [files] "
                                                         "setting max_file_bytes, which is also the ceiling).")
    max_storage_bytes: int | None = Field(None, description="The most bytes of documents a user of the tier keeps "
                                                            "(null: the [files] setting max_user_bytes).")

    @classmethod
    def of(cls, t: Tier) -> "TierOut":
        return cls(**{**asdict(t), "models": list(t.models) if t.models else None})


class MyUsage(BaseModel):
    data: list[UsageRowOut]
    totals: UsageTotals
    tier: str
    limits: TierLimits
    remaining_tokens_this_minute: int
    tokens_counted_today: int = Field(description="What today's (UTC) token quota counts so far: settled requests "
                                              "at their discounts, running ones at what they reserved.")


class FeedbackIn(BaseModel):
    model_config = STRICT
    rating: Literal["up", "down"]
    text: str | None = Field(default=None, max_length=4000)


class FeedbackOut(BaseModel):
    id: str
    message_id: str
    rating: Literal["up", "down"]
    text: str | None
    created: str | None

    @classmethod
    def of(cls, f: Feedback) -> "FeedbackOut":
        return cls(id=f.id, message_id=f.message_id, rating=f.rating, text=f.text, created=iso(f.created))


class FeedbackItem(FeedbackOut):
    """An admin's view: who rated what."""

    username: str
    conversation_id: str
    answer: str  # the rated answer's text, shortened

    @classmethod
    def row(cls, f: Feedback, username: str, m: Message) -> "FeedbackItem":
        answer = m.text if len(m.text) <= 300 else m.text[:300] + "…"
        return cls(**FeedbackOut.of(f).model_dump(), username=username, conversation_id=m.conversation_id,
                   answer=answer)


class TierIn(BaseModel):
    model_config = STRICT
    tier: str = Field(min_length=1, max_length=32)


class UserTierOut(BaseModel):
    username: str
    tier: str


class TiersOut(BaseModel):
    default: str
    tiers: list[TierOut]


class ReasoningIn(BaseModel):
    model_config = STRICT
    max_effort: Literal["low", "medium", "high"]


class ReasoningCap(BaseModel):
    max_effort: str


class ReasoningOut(ReasoningCap):
    efforts: list[str]
    running: int
    slots: int


class AdmissionOut(BaseModel):
    waiting: int
    running: int
    max_running: int
    reasoning_running: int
    reasoning_slots: int

    @classmethod
    def of(cls, a: AdmissionQueue) -> "AdmissionOut":
        return cls(waiting=a.waiting, running=a.running, max_running=a.max_running,
                   reasoning_running=a.running_of(REASONING), reasoning_slots=a.reasoning_slots())


class StatsOut(BaseModel):
    backend: BackendStats  # the dataclass itself: pydantic puts its fields in the schema
    running_generations: int
    admission: AdmissionOut

"""The terms of the batch traffic class (the Batch API's requests), apart from admission itself
(admission.py): what their tokens count against the quota, and the refusal a batch run ends with when it
gives way to interactive work (a 503 its batch runner answers by running the request again later)."""
from __future__ import annotations

import math

from chatloom.app.core.errors import ApiError
from chatloom.app.traffic.tiers import Tier
from chatloom.settings.tree import BatchSettings

GAVE_WAY = "batch_yielded"


def charged(tokens: int, settings: BatchSettings) -> int:
    """What `tokens` of a batch request count against the quota: the discount, rounded up."""
    return math.ceil(tokens * settings.quota_discount)


def check_size(charged_tokens: int, tier: Tier, param: str) -> None:
    """A 400 for a batch request the tier's per-minute quota could never take: waiting (as batch requests do
    on a 429) would never help."""
    if charged_tokens > tier.tokens_per_minute:
        raise ApiError(400, f"this request counts {charged_tokens} tokens against the quota (prompt + max_tokens, "
                       f"at the batch discount), more than the {tier.name} tier's {tier.tokens_per_minute} tokens "
                       "per minute; lower max_tokens or shorten the prompt", "request_too_large", param)


def gave_way() -> ApiError:
    return ApiError(503, "this batch request gave way to interactive traffic; it runs again later", GAVE_WAY,
                    headers={"Retry-After": "1"})

"""The terms of the batch traffic class (the Batch API's requests), apart from admission itself
(admission.py): what their tokens count against the quota, and the refusal a batch run ends with when it
gives way to interactive work (a 503 its batch runner answers by running the request again later)."""
from __future__ import annotations

import math

from chatloom.app.core.errors import ApiError
from chatloom.settings.tree import BatchSettings

GAVE_WAY = "batch_yielded"


def charged(tokens: int, settings: BatchSettings) -> int:
    """What `tokens` of a batch request count against the quota: the discount, rounded up."""
    return math.ceil(tokens * settings.quota_discount)


def gave_way() -> ApiError:
    return ApiError(503, "this batch request gave way to interactive traffic; it runs again later", GAVE_WAY,
                    headers={"Retry-After": "1"})

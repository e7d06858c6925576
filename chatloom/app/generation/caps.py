"""The caps a request meets before anything is reserved: the model its tier may use, max_tokens defaulted,
limited and capped for the tier, reasoning effort capped, the degrade ladder's steps in force."""
from __future__ import annotations

from chatloom.app.core.errors import ApiError
from chatloom.app.generation.run_types import Ask, Limits
from chatloom.app.traffic import reasoning
from chatloom.app.traffic.control import Traffic
from chatloom.serving import Backend
from chatloom.settings import Settings


def caps(ask: Ask, backend: Backend, traffic: Traffic, settings: Settings, window: int) -> Limits:
    """What `ask` may use in a context window of `window` tokens; ApiError (400, 403) names what it may not."""
    sampling = settings.sampling
    model = backend.resolve_model(ask.model)
    tier = traffic.tier(ask.user)
    traffic.check_model(tier, model)
    max_tokens = ask.max_tokens if ask.max_tokens is not None else min(sampling.max_tokens, window // 2)
    if max_tokens > sampling.max_tokens_limit:
        raise ApiError(400, f"max_tokens may be at most {sampling.max_tokens_limit}", "invalid_value", "max_tokens")
    if max_tokens >= window:
        raise ApiError(400, f"max_tokens must be below the context window ({window} tokens)",
                       "invalid_value", "max_tokens")
    if ask.n > sampling.max_n:
        raise ApiError(400, f"n may be at most {sampling.max_n}", "invalid_value", "n")
    max_tokens = traffic.cap_max_tokens(tier, max_tokens)
    effort = traffic.effort(ask.reasoning_effort)
    model, max_tokens, effort = traffic.degrade(tier, model, max_tokens, effort)
    if effort is not None:  # room for the thinking on top of the answer, within the window
        max_tokens = min(max_tokens + reasoning.BUDGET_TOKENS[effort], (window + max_tokens) // 2)
    temperature = sampling.temperature if ask.temperature is None else ask.temperature
    top_p = sampling.top_p if ask.top_p is None else ask.top_p
    return Limits(model, tier, max_tokens, temperature, top_p, effort)

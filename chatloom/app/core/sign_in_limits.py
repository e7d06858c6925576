"""Brute-force limits on signing in and signing up (settings: accounts.login_* and signup_*).

Failed sign-ins are counted per username and per client address in fixed windows that start at the first
failure; once either count reaches its limit, further tries get 429 with Retry-After until the window
ends, whatever the password. A successful sign-in clears its username's count (not the address's: one
address guessing many names stays limited). Sign-ups are counted per address, successful or not."""
from __future__ import annotations

import math

from chatloom.app.core.attempts import AttemptStore
from chatloom.app.core.errors import ApiError
from chatloom.settings.tree import AccountSettings


def too_many(what: str, retry_after_s: float) -> ApiError:
    seconds = max(1, math.ceil(retry_after_s))
    return ApiError(429, f"too many {what}; try again in {seconds} s", "too_many_attempts",
                    headers={"Retry-After": str(seconds)})


class SignInLimits:
    def __init__(self, store: AttemptStore, settings: AccountSettings) -> None:
        self.store = store
        self.s = settings

    @staticmethod
    def _account(username: str) -> str:
        return "login:user:" + username.strip().lower()

    @staticmethod
    def _address(address: str | None) -> str:
        return "login:addr:" + (address or "unknown")

    async def check_login(self, username: str, address: str | None) -> None:
        """Raise 429 while the username or the address is over its limit."""
        for key, limit in ((self._account(username), self.s.login_failures_per_account),
                           (self._address(address), self.s.login_failures_per_address)):
            count, left_s = await self.store.peek(key)
            if count >= limit:
                raise too_many("failed sign-ins", left_s)

    async def failed_login(self, username: str, address: str | None) -> None:
        await self.store.add(self._account(username), self.s.login_window_s)
        await self.store.add(self._address(address), self.s.login_window_s)

    async def signed_in(self, username: str) -> None:
        await self.store.clear(self._account(username))

    async def signup_attempt(self, address: str | None) -> None:
        """Count a sign-up attempt; 429 once the address has made its allowance in the window."""
        key = "signup:addr:" + (address or "unknown")
        count, left_s = await self.store.peek(key)
        if count >= self.s.signups_per_address:
            raise too_many("sign-ups from this address", left_s)
        await self.store.add(key, self.s.signup_window_s)

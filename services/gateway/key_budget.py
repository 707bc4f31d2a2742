"""--max-inflight-per-key: how many generation calls one API key may have in flight at once on
this gateway, so one client cannot take every slot of the global admission limit.

A call counts once however many prompts or samples it carries (the global limits count
those); it holds its slot until its handler returns, the end of its stream included.
"""

from __future__ import annotations

from services.gateway.errors import ApiError

RETRY_AFTER_S = 1.0  # a slot frees when one of the key's calls ends: usually within seconds


class KeyBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: no limit
        self.inflight: dict[str, int] = {}  # owner (key digest) -> calls in flight

    def acquire(self, owner: str) -> None:
        """Take a slot for `owner`, or raise a 429 with Retry-After. Anonymous callers ("")
        and a limit of 0 are not counted."""
        if not owner or self.limit <= 0:
            return
        held = self.inflight.get(owner, 0)
        if held >= self.limit:
            raise ApiError(
                429,
                f"this API key already has {held} request(s) in flight "
                f"(--max-inflight-per-key {self.limit}); retry when one ends",
                type="rate_limit_error",
                retry_after=RETRY_AFTER_S,
            )
        self.inflight[owner] = held + 1

    def release(self, owner: str) -> None:
        if not owner or self.limit <= 0:
            return
        held = self.inflight.get(owner, 0) - 1
        assert held >= 0, f"released a slot {owner[:8]} did not hold"
        if held:
            self.inflight[owner] = held
        else:
            del self.inflight[owner]

"""A moderator that asks an OpenAI-compatible moderation endpoint (POST {base_url}/moderations).

Use it where a trained classifier should decide instead of the local lexicon: OpenAI's own API, or a
self-hosted server that speaks the same format. The request is {"input": text, "model": ...}; the
answer's results[0] says `flagged` and which `categories` are true. The first true category names
the verdict. A server that cannot be reached, or answers with an error or a malformed body, raises
ModerationUnavailable: the input is refused with a 503, and an answer being streamed is withheld
(fail closed, never shown unchecked).
"""
from __future__ import annotations


import httpx

from chatloom.app.traffic.moderation import Classification, Moderator, ModerationUnavailable, Verdict
from chatloom.settings import Settings



class RemoteModerator(Moderator):
    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 5.0, window_chars: int = 400,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = base_url.rstrip("/") + "/moderations"
        self.model = model
        self.window_chars = window_chars
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=headers, transport=transport)

    @classmethod
    def from_settings(cls, settings: Settings) -> "RemoteModerator":
        if not settings.moderation.url:
            raise ValueError("moderation = 'openai' needs moderation_url (the server's base URL, ending in /v1)")
        return cls(settings.moderation.url, settings.moderation.model,
                   settings.moderation.api_key, settings.moderation.timeout_s)

    async def _ask(self, text: str) -> Verdict | None:
        body: dict = {"input": text}
        if self.model:
            body["model"] = self.model
        try:
            r = await self._client.post(self.url, json=body)
            r.raise_for_status()
            result = r.json()["results"][0]
            flagged = bool(result["flagged"])
            categories = result.get("categories") or {}
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise ModerationUnavailable(f"the moderation service at {self.url} did not answer: "
                                        f"{type(exc).__name__}: {exc}") from None
        if not flagged:
            return None
        category = next((name for name, hit in categories.items() if hit), "flagged")
        return Verdict(category, text[-200:])

    async def check_input(self, text: str) -> Verdict | None:
        return await self._ask(text)

    async def classify(self, texts: list[str]) -> tuple[str, list[Classification]]:
        """The service's own results for every text, in one request, as it gave them."""
        body: dict = {"input": texts}
        if self.model:
            body["model"] = self.model
        try:
            r = await self._client.post(self.url, json=body)
            r.raise_for_status()
            data = r.json()
            results = [Classification(bool(x["flagged"]), {k: bool(v) for k, v in (x.get("categories") or {}).items()},
                                      {k: float(v) for k, v in (x.get("category_scores") or {}).items()})
                       for x in data["results"]]
            if len(results) != len(texts):
                raise ValueError(f"{len(results)} results for {len(texts)} inputs")
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ModerationUnavailable(f"the moderation service at {self.url} did not answer: "
                                        f"{type(exc).__name__}: {exc}") from None
        return str(data.get("model") or self.model or self.name), results

    async def check_output(self, text: str) -> Verdict | None:
        return await self._ask(text)

    async def close(self) -> None:
        await self._client.aclose()

"""The chaos traffic's clients after a failed request: a gateway whose pooled HTTP/2 connection a drain
or a kill ended gets a fresh client, so one broken connection does not fail every later request."""
from __future__ import annotations

import httpx

from chatloom.bench.chaos.ledger import Ledger
from chatloom.bench.chaos.traffic import Traffic


async def test_a_broken_connection_gets_the_gateway_a_fresh_client():
    ledger = Ledger()
    traffic = Traffic({"gateway1": "https://127.0.0.1:9"}, "tiny-random", ledger, seed=0)
    first = traffic.clients["gateway1"]
    traffic._transport_failed("gateway1", "openai", httpx.ConnectError("refused"))
    assert traffic.clients["gateway1"] is first  # nothing pooled was used: the same client tries again
    traffic._transport_failed("gateway1", "openai", httpx.RemoteProtocolError("<ConnectionTerminated>"))
    assert traffic.clients["gateway1"] is not first
    assert ledger.transport_errors == {"ConnectError": 1, "RemoteProtocolError": 1}
    assert [r.status for r in ledger.replies] == [0, 0]
    traffic.stop.set()
    await traffic.close()
    assert first.is_closed and traffic.clients["gateway1"].is_closed

"""The chat's tool loop keeps a round's KV cache, asks the backend to hold or evict it while the tools run,
resumes from it, and lets it go when the answer ends."""
from __future__ import annotations

import json
import re

import pytest

from chatloom.serving import Backend, Delta, GenerationRequest

from app_testing import app_client, done_of, make_settings, new_conversation, send


class HoldingBackend(Backend):
    """Calls the calculator once for 'calculate X', then answers; records requests and KV instructions."""

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []
        self.kv: list[tuple] = []

    ready = property(lambda self: True)
    model_ids = property(lambda self: ["scripted"])
    context_window = property(lambda self: 8192)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def count_prompt_tokens(self, messages: list[dict]) -> int:
        return sum(self.count_tokens(m["content"]) + 4 for m in messages)

    async def stream(self, request: GenerationRequest):
        self.requests.append(request)
        msgs = request.messages
        expr = re.search(r"calculate (.+)", msgs[-1]["content"])
        if expr and "<tools>" in msgs[0]["content"]:
            call = json.dumps({"name": "calculator", "arguments": {"expression": expr.group(1)}})
            text = f"<tool_call>\n{call}\n</tool_call>"
        else:
            text = f"It is {msgs[-1]['content']}."
        yield Delta(text)
        yield Delta("", True, "stop", self.count_prompt_tokens(msgs), len(text.split()))

    def abort(self, request_id: str) -> None:
        pass

    def hold_kv(self, request_id: str, tools: list[str], policy: str, timeout_s: float) -> None:
        self.kv.append(("hold", request_id, tools, policy, timeout_s))

    def release_kv(self, request_id: str) -> None:
        self.kv.append(("release", request_id))


@pytest.mark.parametrize("policy", ["auto", "hold", "evict"])
async def test_the_tool_loop_holds_or_evicts_and_resumes_from_the_round(tmp_path, policy):
    backend = HoldingBackend()
    settings = make_settings(tmp_path, chat={"tools": "calculator"}, sampling={"max_tokens": 200},
                             tools={"kv_policy": policy, "kv_hold_timeout_s": 7})
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        _, events = await send(client, alice, cid, "calculate 6 * 7")
        assert done_of(events)["status"] == "complete"
        first, second = backend.requests
        assert second.resume_of == first.request_id and first.resume_of is None
        assert first.keep_kv and second.keep_kv
        # Held or evicted while the calculator ran; the last round's kept cache freed when the answer ended.
        assert backend.kv == [("hold", first.request_id, ["calculator"], policy, 7.0),
                              ("release", second.request_id)]


def test_the_hold_counters_are_on_metrics():
    from chatloom.app.traffic.metrics import Metrics
    from chatloom.engine.kv_holds import HoldStats
    from chatloom.serving import BackendStats

    holds = HoldStats(holds=3, evictions=2, pressure_releases=1, reprefilled_tokens=40, block_seconds=12.5,
                      blocks_held=9)
    text = Metrics(lambda: BackendStats(ready=True, num_requests_running=0, kv_holds=holds),
                   lambda: "m").render().decode()
    for line in ('chatloom:kv_tool_holds_total{model_name="m"} 3.0', 'chatloom:kv_tool_evictions_total{model_name="m"} 2.0',
                 'chatloom:kv_tool_pressure_releases_total{model_name="m"} 1.0',
                 'chatloom:kv_tool_reprefilled_tokens_total{model_name="m"} 40.0',
                 'chatloom:kv_tool_block_seconds_total{model_name="m"} 12.5',
                 'chatloom:kv_tool_blocks_held{model_name="m"} 9.0'):
        assert line in text

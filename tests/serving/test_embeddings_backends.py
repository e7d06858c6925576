"""Backend.embed on every backend: in-process, a remote replica's /v1/embeddings, the router, several models."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from chatloom.engine import EngineConfig
from chatloom.serving import BadGenerationRequest, LocalBackend, MultiModelBackend, RemoteBackend, Router
from chatloom.serving.backend import Backend
from chatloom.serving.replica_server import create_replica_app


class _ChatOnly(Backend):
    ready = True
    model_ids = ["chat-only"]
    context_window = 100

    def count_tokens(self, text):
        return len(text)

    def count_prompt_tokens(self, messages):
        return 1

    async def stream(self, request):
        yield None

    def abort(self, request_id):
        pass


def _close(a, b, tol=1e-6):
    return all(abs(x - y) < tol for x, y in zip(a, b)) and len(a) == len(b)


def test_a_backend_without_embeddings_says_so():
    with pytest.raises(BadGenerationRequest, match="does not serve embeddings") as err:
        asyncio.run(_ChatOnly().embed(["x"]))
    assert err.value.code == "embeddings_unsupported"


def test_remote_router_and_multi_model_forward_to_the_engine(tiny_model_fp32):
    async def main():
        local = LocalBackend(tiny_model_fp32, engine_config=EngineConfig(num_blocks=128), pooling="last")
        await local.start()
        try:
            remote = RemoteBackend("http://replica", "tiny-random")
            remote._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_replica_app(local)),
                                               base_url="http://replica")
            texts = ["first passage", "second, longer passage about files"]
            want = await local.embed(texts)
            assert want.prompt_tokens == sum(len(local.tokenizer.encode(t)) for t in texts)
            got = await remote.embed(texts)
            assert got.prompt_tokens == want.prompt_tokens
            assert all(_close(a, b) for a, b in zip(got.vectors, want.vectors))
            with pytest.raises(BadGenerationRequest, match="empty"):
                await remote.embed([""])

            router = Router("tiny-random", [remote])
            router.replicas[0].healthy = True
            router._started = True
            routed = await router.embed(texts)
            assert all(_close(a, b) for a, b in zip(routed.vectors, want.vectors))

            both = MultiModelBackend({"tiny-random": local, "remote": router})
            assert all(_close(a, b) for a, b in zip((await both.embed(texts, "remote")).vectors, want.vectors))
            assert both.embedding_size("tiny-random") == tiny_model_fp32.config.hidden_size
            s = local.engine.snapshot()
            assert s.kv_cache_free_blocks == s.kv_cache_blocks
            await remote._client.aclose()
        finally:
            await local.close()

    asyncio.run(main())

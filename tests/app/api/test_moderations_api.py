"""/v1/moderations through the official `openai` package: the configured moderator answers in OpenAI's
shape, for one text or several; a remote moderator's own results pass through; sign-in is required."""
from __future__ import annotations

import httpx
import openai
import pytest

from chatloom.app.main import create_app
from chatloom.app.traffic.moderation import OPENAI_CATEGORIES

from app_testing import LiveServer, make_settings
from traffic_testing import ScriptedBackend

THREAT = "I'm gonna kill you tomorrow"


def new_key(url: str, username: str = "mod") -> str:
    with httpx.Client(base_url=url, timeout=30) as http:
        token = http.post("/auth/signup", json={"username": username, "password": "correct horse"}).json()["token"]
        return http.post("/auth/api-keys", headers={"Authorization": f"Bearer {token}"}, json={"name": "k"}).json()["key"]


def server(tmp_path, **settings) -> LiveServer:
    return LiveServer(create_app(make_settings(tmp_path, **settings), ScriptedBackend()))


@pytest.fixture(scope="module")
def lexicon(tmp_path_factory):
    with server(tmp_path_factory.mktemp("lexicon"), moderation={"mode": "lexicon"}) as live:
        yield live, openai.OpenAI(base_url=f"{live.url}/v1", api_key=new_key(live.url), max_retries=0)


def test_the_lexicon_flags_a_threat_in_openais_shape(lexicon):
    _, sdk = lexicon
    r = sdk.moderations.create(input=THREAT)
    assert r.id.startswith("modr-") and r.model == "chatloom-lexicon" and len(r.results) == 1
    result = r.results[0]
    assert result.flagged and result.categories.violence and result.categories.harassment_threatening
    assert not result.categories.sexual and result.category_scores.violence == 1.0
    assert result.category_scores.sexual == 0.0
    # Every OpenAI category is reported, and the lexicon's own names beside them.
    raw = result.model_dump(by_alias=True)
    assert set(OPENAI_CATEGORIES) <= set(raw["categories"]) and raw["categories"]["violence/threat"] is True


def test_a_list_gets_one_result_per_text_in_order(lexicon):
    _, sdk = lexicon
    r = sdk.moderations.create(input=["What a lovely day.", THREAT, "How do I bake bread?"])
    assert [x.flagged for x in r.results] == [False, True, False]
    parts = sdk.moderations.create(input=[{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}])
    assert len(parts.results) == 1 and not parts.results[0].flagged


def test_bad_input_and_no_key_are_refused(lexicon):
    live, sdk = lexicon
    with pytest.raises(openai.BadRequestError) as e:
        sdk.moderations.create(input=[])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.moderations.create(input=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    assert e.value.code == "unsupported_content"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="cl-wrong", max_retries=0).moderations.create(input="hi")
    assert httpx.post(f"{live.url}/v1/moderations", json={"input": "hi"}).status_code == 401


def test_a_remote_moderators_results_pass_through(lexicon, tmp_path):
    """A gateway whose moderator is another server's /v1/moderations (here: the lexicon gateway's)."""
    upstream, _ = lexicon
    with server(tmp_path, moderation={"mode": "openai", "url": f"{upstream.url}/v1",
                                      "api_key": new_key(upstream.url, "gateway")}) as live:
        sdk = openai.OpenAI(base_url=f"{live.url}/v1", api_key=new_key(live.url), max_retries=0)
        r = sdk.moderations.create(input=["fine", THREAT])
        assert r.model == "chatloom-lexicon"  # the name the upstream service gave
        assert [x.flagged for x in r.results] == [False, True] and r.results[1].categories.hate is False


def test_with_moderation_off_the_route_says_so(tmp_path):
    with server(tmp_path, moderation={"mode": "off"}) as live:
        sdk = openai.OpenAI(base_url=f"{live.url}/v1", api_key=new_key(live.url), max_retries=0)
        with pytest.raises(openai.NotFoundError) as e:
            sdk.moderations.create(input="hi")
        assert e.value.code == "moderation_off"

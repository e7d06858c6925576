"""POST /v1/audio/transcriptions: OpenAI's multipart shape and response formats, windows of long audio,
requests batched together, and a 400 naming each bad input."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from chatloom.models.speech.whisper import load_whisper
from chatloom.serving.speech import SpeechBackend

from app_testing import app_client, make_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import tiny_whisper as tw  # noqa: E402


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    return load_whisper(tw.write_whisper_folder(tmp_path_factory.mktemp("whisper") / "tiny-whisper"))


def settings(tmp_path, **speech):
    return make_settings(tmp_path, server={"db_url": f"sqlite+aiosqlite:///{tmp_path}/chatloom.db"}, speech=speech)


async def post(client, headers, audio: bytes, **form):
    return await client.post("/v1/audio/transcriptions", headers=headers,
                             files={"file": ("clip.wav", audio, "audio/wav")},
                             data={"model": "whisper-1", **form})


async def test_transcriptions_in_each_format(tmp_path, tiny_backend, whisper):
    speech = SpeechBackend(whisper)
    async with app_client(settings(tmp_path), tiny_backend, speech=speech) as (client, _, headers):
        audio = tw.wav_bytes(3.0, seed=1)
        r = await post(client, headers, audio)
        assert r.status_code == 200, r.text
        text = r.json()["text"]
        assert text
        plain = await post(client, headers, audio, response_format="text")
        assert plain.text == text and plain.headers["content-type"].startswith("text/plain")
        verbose = (await post(client, headers, audio, response_format="verbose_json", language="en")).json()
        assert verbose["text"] == text and verbose["language"] == "en" and abs(verbose["duration"] - 3.0) < 0.05
        assert [(s["start"], s["text"]) for s in verbose["segments"]] == [(0.0, text)]
        srt = (await post(client, headers, audio, response_format="srt")).text
        assert srt.startswith("1\n00:00:00,000 --> 00:00:03,000\n")
        vtt = (await post(client, headers, audio, response_format="vtt")).text
        assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:03.000\n")
        # The same window through the model alone: the endpoint adds nothing and drops nothing.
        from chatloom.models.speech.features import FeatureExtractor, decode_audio
        tokens = whisper.model.transcribe(FeatureExtractor(80)(decode_audio(audio, 60))[None], [whisper.prompt("en")], 224)
        assert text == whisper.tokenizer.decode(tokens[0]).strip()


async def test_long_audio_is_cut_into_30_second_windows(tmp_path, tiny_backend, whisper):
    async with app_client(settings(tmp_path), tiny_backend, speech=SpeechBackend(whisper)) as (client, _, headers):
        r = await post(client, headers, tw.wav_bytes(65.0, rate=16000, channels=1), response_format="verbose_json")
        assert r.status_code == 200, r.text
        segments = r.json()["segments"]
        assert [(s["start"], s["end"]) for s in segments] == [(0.0, 30.0), (30.0, 60.0), (60.0, 65.0)]


async def test_requests_are_batched_together(tmp_path, tiny_backend, whisper):
    speech = SpeechBackend(whisper, max_batch=8)
    # A transcription holds one of its user's concurrent slots: a tier with room for all four at once.
    async with app_client(_tiered(tmp_path, 100_000), tiny_backend, speech=speech) as (client, _, headers):
        clips = [tw.wav_bytes(2.0 + i, seed=i) for i in range(4)]
        alone = [(await post(client, headers, c)).json()["text"] for c in clips]
        assert speech.batches == [1, 1, 1, 1]
        together = await asyncio.gather(*(post(client, headers, c) for c in clips))
        assert [r.json()["text"] for r in together] == alone
        assert max(speech.batches[4:]) > 1  # waiting windows of different requests ran as one batch


@pytest.mark.parametrize("audio,form,code,words", [
    (b"not audio, just text" * 20, {}, "invalid_audio", "not audio"),
    ("cut", {}, "invalid_audio", "corrupt"),
    ("long", {}, "invalid_audio", "longer than"),
    ("ok", {"language": "xx"}, "invalid_value", "language"),
    ("ok", {"response_format": "mp3"}, "invalid_value", "response_format"),
    ("big", {}, "audio_too_large", "larger than"),
])
async def test_bad_audio_is_a_400_naming_the_problem(tmp_path, tiny_backend, whisper, audio, form, code, words):
    audio = {"cut": tw.wav_bytes(1.0)[:40], "long": tw.wav_bytes(5.0), "ok": tw.wav_bytes(1.0),
             "big": b"\0" * 3000}.get(audio, audio)
    conf = settings(tmp_path, max_audio_seconds=4.0, max_audio_bytes=2000 if code == "audio_too_large" else 10**7)
    async with app_client(conf, tiny_backend, speech=SpeechBackend(whisper)) as (client, _, headers):
        r = await post(client, headers, audio, **form)
        assert r.status_code in (400, 413), r.text
        if r.status_code == 400:
            assert r.json()["error"]["code"] == code and words in r.json()["error"]["message"], r.json()


async def test_without_a_speech_model_the_route_is_404(tmp_path, tiny_backend):
    async with app_client(settings(tmp_path), tiny_backend) as (client, _, headers):
        r = await post(client, headers, tw.wav_bytes(1.0))
        assert r.status_code == 404 and r.json()["error"]["code"] == "speech_off"


def _tiered(tmp_path, tokens_per_minute: int):
    from traffic_testing import write_tiers

    tiers = write_tiers(tmp_path, free={"max_concurrent": 10, "requests_per_minute": 1000,
                                        "tokens_per_minute": tokens_per_minute, "tokens_per_day": 1_000_000})
    return make_settings(tmp_path, server={"db_url": f"sqlite+aiosqlite:///{tmp_path}/chatloom.db"},
                         traffic={"tiers_file": tiers})


async def test_a_transcription_counts_its_tokens_against_the_quota(tmp_path, tiny_backend, whisper):
    async with app_client(_tiered(tmp_path, 5000), tiny_backend, speech=SpeechBackend(whisper)) as (client, _, headers):
        before = (await client.get("/usage", headers=headers)).json()["remaining_tokens_this_minute"]
        r = await post(client, headers, tw.wav_bytes(3.0, seed=1), response_format="verbose_json")
        assert r.status_code == 200, r.text
        written = sum(len(s["tokens"]) for s in r.json()["segments"])
        assert written > 0
        after = (await client.get("/usage", headers=headers)).json()["remaining_tokens_this_minute"]
        assert before - after == written
        bad = await post(client, headers, b"not audio at all")
        assert bad.status_code == 400
        assert (await client.get("/usage", headers=headers)).json()["remaining_tokens_this_minute"] == after


async def test_a_transcription_past_the_quota_is_refused(tmp_path, tiny_backend, whisper):
    speech = SpeechBackend(whisper)
    async with app_client(_tiered(tmp_path, 100), tiny_backend, speech=speech) as (client, _, headers):
        r = await post(client, headers, tw.wav_bytes(2.0, seed=2))
        assert r.status_code == 429, r.text
        assert speech.batches == []  # the model never ran


async def test_models_list_the_speech_model_as_taking_audio(tmp_path, tiny_backend, whisper):
    async with app_client(settings(tmp_path), tiny_backend, speech=SpeechBackend(whisper)) as (client, _, headers):
        models = (await client.get("/v1/models", headers=headers)).json()["data"]
        assert [m["capabilities"]["audio"] for m in models] == [False, True]
        speech = models[-1]
        assert speech["capabilities"]["chat"] is False
        assert (await client.get(f"/v1/models/{speech['id']}", headers=headers)).json() == speech

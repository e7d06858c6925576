"""`chatloom serve --speech-model PATH`: the flag sets [speech] model, a Whisper folder is served for speech
to text, and a path that is not one (or a Whisper folder given as the chat model) is one line at start."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from test_cli import assert_one_line_error, call

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import tiny_whisper as tw  # noqa: E402

ENV = "CHATLOOM_SPEECH__MODEL"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("speech")
    tw.write_whisper_folder(root / "tiny-whisper")
    llama = root / "llama-folder"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "clip.wav").write_bytes(tw.wav_bytes(1.0))
    return root


def _parse(*argv: str) -> argparse.Namespace:
    from chatloom.cli.serve import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_the_flag_sets_the_speech_model_over_the_environment(folders, monkeypatch):
    from chatloom.cli.serve import _settings

    whisper = str(folders / "tiny-whisper")
    monkeypatch.delenv(ENV, raising=False)
    assert _settings(_parse()).speech.model is None
    assert _settings(_parse("--speech-model", whisper)).speech.model == whisper
    monkeypatch.setenv(ENV, "elsewhere")
    assert _settings(_parse()).speech.model == "elsewhere"
    assert _settings(_parse("--speech-model", whisper)).speech.model == whisper


async def test_the_flag_serves_the_whisper_folder(folders, monkeypatch, tmp_path):
    import httpx

    from chatloom.app.main import create_app
    from chatloom.cli.serve import _settings, check_model_kinds

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("CHATLOOM_SERVER__DATA_DIR", str(tmp_path))
    monkeypatch.setenv("CHATLOOM_ACCOUNTS__ARGON2_TIME_COST", "1")  # cheap hashing for the one sign-up
    monkeypatch.setenv("CHATLOOM_ACCOUNTS__ARGON2_MEMORY_KIB", "1024")
    settings = _settings(_parse("--model", "tiny-random", "--speech-model", str(folders / "tiny-whisper"),
                                "--num-blocks", "32", "--db", f"sqlite+aiosqlite:///{tmp_path}/chatloom.db"))
    check_model_kinds(settings)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            signed = await client.post("/auth/signup", json={"username": "alice", "password": "correct horse"})
            assert signed.status_code == 201, signed.text
            headers = {"Authorization": f"Bearer {signed.json()['token']}"}
            models = (await client.get("/v1/models", headers=headers)).json()["data"]
            assert models[-1]["id"] == "tiny-whisper" and models[-1]["capabilities"]["audio"] is True
            r = await client.post("/v1/audio/transcriptions", headers=headers, data={"model": "whisper-1"},
                                  files={"file": ("clip.wav", (folders / "clip.wav").read_bytes(), "audio/wav")})
            assert r.status_code == 200 and "text" in r.json(), r.text


@pytest.mark.parametrize("argv,env,needles", [
    (["--speech-model", "{root}/llama-folder"], None, ["llama-folder", "not a Whisper folder"]),
    (["--speech-model", "{root}/nope"], None, ["speech model not found", "nope"]),
    ([], "{root}/llama-folder", ["not a Whisper folder"]),
    (["--model", "{root}/tiny-whisper"], None, ["Whisper speech model", "--speech-model"]),
], ids=["not whisper", "missing", "setting not whisper", "whisper as the chat model"])
def test_a_wrong_model_kind_is_one_line_at_start(capsys, folders, monkeypatch, tmp_path, argv, env, needles):
    monkeypatch.delenv(ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(ENV, env.replace("{root}", str(folders)))
    argv = [a.replace("{root}", str(folders)) for a in argv]
    rc, _, err = call(capsys, "serve", *argv, "--port", "0", "--db", f"sqlite+aiosqlite:///{tmp_path}/c.db")
    assert_one_line_error(rc, err, *needles)
    assert rc == 2

"""POST /v1/audio/transcriptions: speech to text in OpenAI's shape, by the Whisper model of [speech] model.

A multipart upload (`file`, `model`, optional `language` and `response_format`): json gives {"text"},
text the bare text, verbose_json the text with its language, duration and one segment per 30-second
window, srt and vtt subtitles of those segments. Audio that cannot be read is a 400 naming the problem;
without a speech model the route answers 404.

Quotas: a transcription counts the tokens Whisper wrote (its segments' tokens) against the caller's
token quota. Before it runs, the quota must have room for one window's most tokens (a 429 otherwise);
it is settled to the tokens really written, and a refused file costs nothing.
"""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse

from chatloom.app.api.deps import Ctx, CurrentUser
from chatloom.app.api.openapi_responses import errors
from chatloom.app.core.errors import ApiError
from chatloom.serving import BackendNotReady
from chatloom.serving.speech import Transcription

router = APIRouter(prefix="/v1", tags=["openai"])

TRANSCRIPTIONS = "/v1/audio/transcriptions"
FORM_OVERHEAD = 64 * 1024  # the multipart form's other fields and boundaries, on top of the file
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


def _clock(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def _subtitles(result: Transcription, vtt: bool) -> str:
    sep = "." if vtt else ","
    cues = []
    for i, s in enumerate(s for s in result.segments if s.text):
        number = "" if vtt else f"{i + 1}\n"
        cues.append(f"{number}{_clock(s.start, sep)} --> {_clock(s.end, sep)}\n{s.text}\n")
    return ("WEBVTT\n\n" if vtt else "") + "\n".join(cues)


@router.post("/audio/transcriptions", responses=errors(400, 401, 404, 413, 503))
async def transcribe(ctx: Ctx, user: CurrentUser, file: Annotated[UploadFile, File()],
                     model: Annotated[str, Form(min_length=1)],
                     language: Annotated[str | None, Form(max_length=16)] = None,
                     response_format: Annotated[str, Form()] = "json",
                     prompt: Annotated[str | None, Form()] = None,
                     temperature: Annotated[float | None, Form(ge=0, le=1)] = None):
    """The text of an audio file (any format FFmpeg reads: wav, mp3, m4a, ogg, webm, flac...)."""
    speech = ctx.speech
    if speech is None:
        raise ApiError(404, "speech to text is not set up on this server (set [speech] model to a Whisper folder)",
                       "speech_off")
    if response_format not in FORMATS:
        raise ApiError(400, f"response_format must be one of {', '.join(FORMATS)}", "invalid_value",
                       "response_format")
    limit = ctx.settings.speech.max_audio_bytes
    data = await file.read(limit + 1)
    if len(data) > limit:
        raise ApiError(400, f"the audio file is larger than {limit} bytes", "audio_too_large", "file")
    reservation = await ctx.traffic.reserve(user, ctx.traffic.tier(user), speech.max_new_tokens)
    written = 0
    try:
        result = await speech.transcribe(data, language, ctx.settings.speech.max_audio_seconds)
        written = sum(len(s.tokens) for s in result.segments)
    except BackendNotReady as exc:
        raise ApiError(503, str(exc), "model_loading", headers={"Retry-After": "5"}) from None
    finally:
        await ctx.traffic.quotas.settle(reservation, written)
    if response_format == "text":
        return PlainTextResponse(result.text)
    if response_format in ("srt", "vtt"):
        return PlainTextResponse(_subtitles(result, response_format == "vtt"))
    if response_format == "json":
        return JSONResponse({"text": result.text})
    return JSONResponse({"task": "transcribe", "language": result.language, "duration": round(result.duration, 3),
                         "text": result.text,
                         "segments": [{"id": s.id, "seek": int(s.start * 100), "start": round(s.start, 3),
                                       "end": round(s.end, 3), "text": s.text, "tokens": s.tokens,
                                       "temperature": 0.0} for s in result.segments]})

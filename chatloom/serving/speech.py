"""Speech to text served in this process: a Whisper model, with the windows of every waiting request
transcribed together in batches.

A request's audio is decoded (PyAV) and cut into 30-second windows; each window joins one queue. A
worker takes what is waiting, up to `max_batch` windows from any number of requests, encodes and
decodes them as one batch in a thread, and hands each request its windows' text as they finish. The
model need not share the chat engine's paged KV cache: a window's decoder cache lives only while its
batch runs.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from chatloom.models import ModelError
from chatloom.models.speech.features import SAMPLE_RATE, AudioError, FeatureExtractor, decode_audio
from chatloom.models.speech.whisper import LoadedWhisper, load_whisper
from chatloom.serving.backend import BackendNotReady, BadGenerationRequest, ModelLoadFailed

log = logging.getLogger(__name__)

__all__ = ["SpeechBackend", "Transcription", "Segment", "AudioError"]


@dataclass(frozen=True)
class Segment:
    id: int
    start: float
    end: float
    text: str
    tokens: list[int]


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str
    duration: float  # seconds of audio
    segments: list[Segment] = field(default_factory=list)


@dataclass(eq=False)  # compared by identity: windows with equal samples are still two requests' own
class _Window:
    samples: np.ndarray
    prompt: list[int]
    done: asyncio.Future


class SpeechBackend:
    """A Whisper model (a Hugging Face folder) behind an async, batching interface."""

    def __init__(self, spec: str | LoadedWhisper, max_batch: int = 8, max_new_tokens: int = 224) -> None:
        self._loaded = spec if isinstance(spec, LoadedWhisper) else None
        self._spec = spec.id if isinstance(spec, LoadedWhisper) else spec
        self.max_batch = max_batch
        self.max_new_tokens = max_new_tokens
        self._error: str | None = None
        self._queue: asyncio.Queue[_Window] | None = None
        self._worker: asyncio.Task | None = None
        self.batches: list[int] = []  # windows per batch run, newest last (the last 100)
        self._extractor: FeatureExtractor | None = None
        self._start_lock: asyncio.Lock | None = None

    @property
    def model_id(self) -> str:
        return self._loaded.id if self._loaded is not None else Path(self._spec).name

    @property
    def ready(self) -> bool:
        return self._worker is not None

    @property
    def load_error(self) -> str | None:
        return self._error

    async def start(self) -> None:
        """Load the model (once, whoever asks first) and start the batching worker."""
        self._start_lock = self._start_lock or asyncio.Lock()
        async with self._start_lock:
            if self._worker is not None or self._error is not None:
                return
            try:
                if self._loaded is None:
                    self._loaded = await asyncio.to_thread(load_whisper, Path(self._spec))
            except (ModelError, OSError) as exc:
                self._error = str(exc)
                raise ModelLoadFailed(f"speech model failed to load: {exc}") from exc
            self._extractor = FeatureExtractor(self._loaded.config.num_mel_bins)
            self._queue = asyncio.Queue()
            self._worker = asyncio.create_task(self._run(), name="speech-batches")

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None

    async def transcribe(self, data: bytes, language: str | None = None, max_seconds: float = 3600.0) -> Transcription:
        """The text of the audio in `data`. BadGenerationRequest for audio that cannot be read or a
        language the model does not know; BackendNotReady while the model loads."""
        if self._worker is None and self._error is None:
            try:
                await self.start()  # a request that comes while the model loads waits for it
            except ModelLoadFailed:
                pass
        if self._worker is None:
            raise BackendNotReady(f"speech model failed to load: {self._error}")
        try:
            samples = await asyncio.to_thread(decode_audio, data, max_seconds)
            prompt = self._loaded.prompt(language)
        except AudioError as exc:
            raise BadGenerationRequest(str(exc), "invalid_audio", "file") from None
        except ModelError as exc:
            raise BadGenerationRequest(str(exc), "invalid_value", "language") from None
        loop = asyncio.get_running_loop()
        windows = [(start, _Window(chunk, prompt, loop.create_future()))
                   for start, chunk in self._extractor.windows(samples)]
        for _, w in windows:
            self._queue.put_nowait(w)
        tokens = [await w.done for _, w in windows]
        duration = len(samples) / SAMPLE_RATE
        decode = self._loaded.tokenizer.decode
        segments = [Segment(i, start, min(start + len(w.samples) / SAMPLE_RATE, duration), decode(t).strip(), t)
                    for i, ((start, w), t) in enumerate(zip(windows, tokens))]
        text = " ".join(s.text for s in segments if s.text)
        return Transcription(text, language or "en", duration, segments)

    async def _run(self) -> None:
        while True:
            first = await self._queue.get()
            batch = [first]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            # One batch runs windows whose prompts have the same length (they decode in lockstep).
            now = [w for w in batch if len(w.prompt) == len(first.prompt)]
            for w in batch:
                if w not in now:
                    self._queue.put_nowait(w)
            live = [w for w in now if not w.done.cancelled()]
            if not live:
                continue
            try:
                results = await asyncio.to_thread(self._transcribe, live)
            except Exception as exc:  # the batch's requests fail; the worker carries on
                log.exception("speech batch failed")
                for w in live:
                    if not w.done.done():
                        w.done.set_exception(BadGenerationRequest(f"transcription failed: {exc!r}", "generation_failed"))
                continue
            for w, tokens in zip(live, results):
                if not w.done.done():
                    w.done.set_result(tokens)

    def _transcribe(self, windows: list[_Window]) -> list[list[int]]:
        import torch

        started = time.perf_counter()
        features = torch.stack([self._extractor(w.samples) for w in windows])
        out = self._loaded.model.transcribe(features, [w.prompt for w in windows], self.max_new_tokens)
        self.batches = (self.batches + [len(windows)])[-100:]
        log.debug("transcribed %d windows in %.2f s", len(windows), time.perf_counter() - started)
        return out

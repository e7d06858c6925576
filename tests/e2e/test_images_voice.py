"""Images and voice in the browser (Chromium): pasted, dropped and chosen images wait as thumbnails and
go with the message, stay in the conversation after a reload, and are refused by name for a model that
reads none; the microphone records (Chromium's fake capture device playing a 440 Hz tone the test writes), the
server hears that tone, the recording is transcribed by a tiny Whisper and the text lands in the input
box."""
from __future__ import annotations

import base64
import io
import sys
import wave
from pathlib import Path

import numpy as np

import pytest
from PIL import Image

from browser_testing import CHROMIUM, CHROMIUM_ARGS, DESKTOP, sign_up, wait_js
from test_chat import send_and_wait
from test_files_browser import drop_file

from app_testing import LiveServer, make_settings
from chatloom.app.main import create_app
from scripted_backend import ScriptedBackend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
import tiny_whisper as tw  # noqa: E402

TONE_HZ = 440.0


def write_tone(path: Path, seconds: float = 3.0, rate: int = 48_000) -> Path:
    """A 16-bit mono WAV of a TONE_HZ sine: what the fake microphone plays (in a loop)."""
    t = np.arange(int(seconds * rate)) / rate
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((0.5 * 32767 * np.sin(2 * np.pi * TONE_HZ * t)).astype("<i2").tobytes())
    return path


class SeeingBackend(ScriptedBackend):
    """The scripted model, reading images: it answers how many it was shown."""

    def __init__(self) -> None:
        super().__init__(delay_s=0.0)
        self.shown: list[int] = []

    def takes_images(self, model: str | None = None) -> bool:
        return model != "scripted-large"  # one model of the two reads images

    def count_prompt_tokens(self, messages: list[dict]) -> int:
        return super().count_prompt_tokens(messages) + 64 * sum(len(m.get("images") or ()) for m in messages)

    async def stream(self, request):
        self.shown.append(sum(len(m.get("images") or ()) for m in request.messages or []))
        async for delta in super().stream(request):
            yield delta


def png(color: tuple[int, int, int], size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def heard() -> list:
    """The audio each transcription request carried, as the server decoded it (16 kHz samples)."""
    return []


@pytest.fixture(scope="module")
def seeing(tmp_path_factory, heard):
    from chatloom.models.speech.features import decode_audio
    from chatloom.models.speech.whisper import load_whisper
    from chatloom.serving.speech import SpeechBackend

    class ListeningSpeech(SpeechBackend):
        async def transcribe(self, data: bytes, language: str | None = None, max_seconds: float = 3600.0):
            heard.append(decode_audio(data, max_seconds))
            return await super().transcribe(data, language, max_seconds)

    root = tmp_path_factory.mktemp("e2e-vision")
    whisper = load_whisper(tw.write_whisper_folder(root / "tiny-whisper"))
    backend = SeeingBackend()
    settings = make_settings(root, sampling={"max_tokens": 50}, server={"max_body_bytes": 4_000_000})
    with LiveServer(create_app(settings, backend, speech=ListeningSpeech(whisper))) as live:
        yield live, backend


@pytest.fixture(scope="module")
def media_browser(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    tone = write_tone(tmp_path_factory.mktemp("e2e-audio") / "tone.wav")
    args = CHROMIUM_ARGS + ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                            f"--use-file-for-fake-audio-capture={tone}"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def vpage(media_browser, seeing):
    live, _ = seeing
    context = media_browser.new_context(viewport=DESKTOP, base_url=live.url)
    context.grant_permissions(["microphone"])
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.console_errors = []
    page.on("pageerror", lambda exc: page.console_errors.append(str(exc)))
    yield page
    context.close()


def paste_image(page, data: bytes) -> None:
    page.evaluate("""(bytes) => {
        const dt = new DataTransfer();
        dt.items.add(new File([new Uint8Array(bytes)], 'pasted.png', { type: 'image/png' }));
        const input = document.getElementById('input');
        input.dispatchEvent(new ClipboardEvent('paste', { clipboardData: dt, bubbles: true, cancelable: true }));
    }""", list(data))


def test_pasted_dropped_and_chosen_images_go_with_the_message_and_stay(vpage, seeing, tmp_path):
    _, backend = seeing
    page = vpage
    sign_up(page)
    assert page.locator("#model option").all_inner_texts() == ["scripted", "scripted-large"]  # not the speech model
    paste_image(page, png((200, 30, 30)))
    drop_file(page, "dropped.png", png((30, 200, 30)), "image/png")
    chosen = tmp_path / "chosen.png"
    chosen.write_bytes(png((30, 30, 200)))
    page.set_input_files("#file-input", str(chosen))
    wait_js(page, "document.querySelectorAll('#image-tray .thumb').length === 3")
    page.click("#image-tray .thumb:nth-child(2) .remove-image")  # changed our mind about one
    wait_js(page, "document.querySelectorAll('#image-tray .thumb').length === 2")

    send_and_wait(page, "What do you see?")
    assert backend.shown[-1] == 2
    assert page.locator("#image-tray").is_hidden()
    wait_js(page, "[...document.querySelectorAll('#messages .message.user .message-image')]"
                  ".filter((img) => img.complete && img.naturalWidth === 40).length === 2")
    assert page.locator("#attachments .chip").count() == 0  # images are not documents

    # A follow-up carries the conversation's images again; a reload shows them from the server.
    send_and_wait(page, "And now?")
    assert backend.shown[-1] == 2
    page.reload()
    # Each image is fetched from the server after the message is drawn: wait until both are in.
    wait_js(page, "[...document.querySelectorAll('#messages .message.user .message-image')]"
                  ".filter((img) => img.src.startsWith('blob:') && img.complete).length === 2")
    sources = page.evaluate("[...document.querySelectorAll('.message-image')].map((i) => i.src)")
    assert len(sources) == 2 and all(s.startswith("blob:") for s in sources)
    assert page.console_errors == []


def test_a_model_that_reads_no_images_says_so(vpage):
    page = vpage
    sign_up(page)
    page.select_option("#model", "scripted-large")
    paste_image(page, png((10, 10, 10)))
    page.wait_for_selector("#notice:not([hidden])")
    assert "does not read images" in page.locator("#notice").inner_text()
    assert page.locator("#image-tray .thumb").count() == 0


def test_the_microphone_records_and_puts_the_transcript_in_the_box(vpage, heard):
    page = vpage
    sign_up(page)
    page.wait_for_selector("#mic:not([hidden])")
    page.fill("#input", "Note:")
    with page.expect_response("**/v1/audio/transcriptions") as answer:
        page.click("#mic")
        wait_js(page, "document.getElementById('mic').getAttribute('aria-pressed') === 'true'")
        page.wait_for_timeout(1200)  # what is recorded: 1.2 s of the WAV (no state to wait for)
        page.click("#mic")
    response = answer.value
    assert response.status == 200, response.text()
    text = response.json()["text"]
    wait_js(page, "!document.getElementById('mic').disabled")
    assert page.input_value("#input") == ("Note: " + text if text else "Note:")
    assert page.console_errors == []
    # What the server heard is the tone the microphone played, about as long as the recording.
    samples = heard[-1]
    assert 0.5 <= len(samples) / 16_000 <= 5.0, len(samples)
    spectrum = np.abs(np.fft.rfft(samples))
    peak_hz = np.argmax(spectrum[1:]) + 1
    assert abs(peak_hz * 16_000 / len(samples) - TONE_HZ) < 10, peak_hz * 16_000 / len(samples)

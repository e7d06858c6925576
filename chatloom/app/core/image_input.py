"""Images at the edge: each API's image input (an OpenAI data URL, an Anthropic base64 block) read,
checked and decoded once, with a 400 that names the problem.

Refused: more images than `vision.max_images_per_request`, an http(s) URL unless `vision.fetch_urls`
is on (then fetched by `ImageReader.fetch` before the body is read, with safe_fetch's protection: no
private, loopback or link-local address unless `vision.fetch_allow` names it, at most
`vision.max_image_bytes` within `vision.fetch_timeout_s`), any other URL scheme, data that is not
base64, a file over `vision.max_image_bytes`, data that is not an image or is corrupt (sniffed from its
bytes, whatever the server's Content-Type said), and an image over `vision.max_image_pixels` (checked
from its header, so a decompression bomb is refused before it is decoded).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any, Callable, TypeVar

from chatloom.app.core.errors import ApiError
from chatloom.app.core.safe_fetch import FetchPolicy, FetchRefused, display_url, safe_fetch
from chatloom.serving import Backend
from chatloom.serving.images import IMAGE_MARKER, ImageData, ImageError, read_image
from chatloom.settings.tree import VisionSettings


T = TypeVar("T")


async def reading_images(has_images: bool, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), in a worker thread when the request has images: decoding one takes tens of
    milliseconds, which must not stall every other user's stream on the event loop."""
    return await asyncio.to_thread(fn, *args) if has_images else fn(*args)


def without_markers(text: str) -> str:
    """User text with the image marker character removed: typed text never stands for an image."""
    return text.replace(IMAGE_MARKER, "") if IMAGE_MARKER in text else text


def require_vision(backend: Backend, model: str | None) -> None:
    """400 unless `model` reads images (checked before any quota or queue)."""
    if not backend.takes_images(model):
        raise ApiError(400, f"the model {model or backend.model_ids[0]!r} does not take images; send text only "
                       "or choose a model whose capabilities include vision (GET /v1/models)",
                       "unsupported_content", "messages")


class ImageReader:
    """The images of one request, in order, checked as they are read."""

    def __init__(self, settings: VisionSettings, param: str) -> None:
        self.settings = settings
        self.param = param
        self.images: list[ImageData] = []
        self.fetched: dict[str, bytes] = {}  # http(s) image URLs' bodies, fetched ahead of reading

    async def fetch(self, urls: list[str]) -> None:
        """Fetch the request's http(s) image URLs (others are left to data_url), refusing them by name
        unless vision.fetch_urls is on."""
        remote = [u for u in dict.fromkeys(urls) if u.startswith(("http://", "https://"))]
        if not remote:
            return
        if not self.settings.fetch_urls:
            raise self._refuse("image URLs are not fetched by this server (vision.fetch_urls is off); send the "
                               "image inline as a data URL (data:image/png;base64,...)", "unsupported_image_url")
        if len(urls) > self.settings.max_images_per_request:
            raise self._refuse(f"at most {self.settings.max_images_per_request} images per request",
                               "too_many_images")
        policy = FetchPolicy(allow=tuple(self.settings.fetch_allow), max_bytes=self.settings.max_image_bytes,
                             timeout_s=self.settings.fetch_timeout_s)
        for url in remote:
            try:
                got = await safe_fetch(url, policy, headers={"Accept": "image/*"})
            except FetchRefused as exc:
                raise self._refuse(f"the image URL was not fetched: {exc}", "image_url_refused") from None
            if got.status != 200:
                raise self._refuse(f"the image URL {display_url(url)} answered HTTP {got.status}",
                                   "image_url_refused")
            self.fetched[url] = got.body

    def _refuse(self, message: str, code: str = "invalid_image") -> ApiError:
        return ApiError(400, message, code, self.param)

    def data_url(self, url: str) -> ImageData:
        """An OpenAI image_url: data:image/...;base64,..., or an http(s) URL already fetched."""
        if url in self.fetched:
            return self.raw(self.fetched[url])
        if not url.startswith("data:"):
            scheme = url.split(":", 1)[0] if ":" in url else ""
            raise self._refuse(f"image URLs{f' ({scheme})' if scheme else ''} are not fetched; send the image "
                               "inline as a data URL (data:image/png;base64,...)", "unsupported_image_url")
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise self._refuse("an image data URL must be base64: data:image/png;base64,...")
        media = head[len("data:"):-len(";base64")]
        if media and not media.startswith("image/"):
            raise self._refuse(f"the data URL's media type {media!r} is not an image")
        return self.base64(payload)

    def base64(self, payload: str) -> ImageData:
        """Base64 image bytes (an Anthropic image block's data, a data URL's payload)."""
        limit = self.settings.max_image_bytes
        if len(payload) * 3 // 4 > limit + 3:
            raise self._refuse(f"the image is larger than {limit} bytes", "image_too_large")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise self._refuse("the image data is not valid base64") from None
        return self.raw(data)

    def raw(self, data: bytes) -> ImageData:
        if len(self.images) >= self.settings.max_images_per_request:
            raise self._refuse(f"at most {self.settings.max_images_per_request} images per request",
                               "too_many_images")
        image = self.check(data, f"image {len(self.images) + 1}")
        self.images.append(image)
        return image

    def check(self, data: bytes, what: str) -> ImageData:
        """`data` decoded, or a 400 naming `what` and its problem: too many bytes or pixels, not an image
        (sniffed from the bytes), corrupt. Not counted among the request's images."""
        if len(data) > self.settings.max_image_bytes:
            raise self._refuse(f"{what} has {len(data)} bytes; at most {self.settings.max_image_bytes} are "
                               "accepted", "image_too_large")
        try:
            return read_image(data, self.settings.max_image_pixels)
        except ImageError as exc:
            code = "image_too_large" if "pixels" in str(exc) else "invalid_image"
            raise self._refuse(f"{what}: {exc}", code) from None

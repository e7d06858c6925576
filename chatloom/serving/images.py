"""Images as they travel from the product to a backend, and a vision model's chat prompt.

A chat message that carries images keeps them beside its text: `{"role", "content", "images"}`, the
content holding one IMAGE_MARKER where each image goes, in order. The product decodes and checks each
image once at its edge (`read_image`); a local vision model renders the messages with its own chat
template (content as text and image parts, as transformers' processors take them) and expands each
image into its tokens (models/vision/prompt.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chatloom.models.chat_template import render_chat
from chatloom.models.vision.images import FORMATS, ImageError, content_hash, open_image
from chatloom.models.vision.prompt import ImageInput, expand_images

# Where an image sits in a message's text: the Unicode object replacement character, which the
# product strips from what users type, so text can never stand for an image.
IMAGE_MARKER = "\ufffc"

__all__ = ["IMAGE_MARKER", "ImageData", "ImageError", "read_image", "message_images", "encode_vision_chat",
           "FORMATS"]


@dataclass(frozen=True, eq=False)
class ImageData:
    """One image of a request, checked and decoded."""

    content_hash: str
    data: bytes
    media_type: str  # image/png, image/jpeg...
    width: int
    height: int
    image: Any = field(default=None, repr=False)  # the decoded PIL image


def read_image(data: bytes, max_pixels: int) -> ImageData:
    """Decode and check untrusted image bytes; ImageError names what is wrong."""
    image = open_image(data, max_pixels)
    media_type = f"image/{(image.format or 'png').lower()}"
    return ImageData(content_hash(data), data, media_type, image.width, image.height, image)


def message_images(messages: list[dict]) -> list[ImageData]:
    """Every image of the messages, in prompt order."""
    return [image for m in messages for image in m.get("images") or ()]


def _parts(message: dict) -> list[dict]:
    """A message's content as text and image parts (what vision chat templates iterate over)."""
    content = message.get("content") or ""
    pieces = content.split(IMAGE_MARKER)
    if len(pieces) - 1 != len(message.get("images") or ()):
        raise ImageError(f"a {message.get('role')} message has {len(pieces) - 1} image places for "
                         f"{len(message.get('images') or ())} images")
    parts: list[dict] = []
    for i, text in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def encode_vision_chat(loaded, messages: list[dict], continue_text: str = "") -> tuple[list[int], list[ImageInput]]:
    """Token ids of `messages` for a vision model (`loaded.vision`), and where each image's
    embeddings go. Raises ImageError or ModelError."""
    tokenizer = loaded.tokenizer
    turns = [{**{k: v for k, v in m.items() if k != "images"}, "content": _parts(m)} for m in messages]
    text = render_chat(tokenizer.chat_template, turns, bos_token=tokenizer.bos_token,
                       eos_token=tokenizer.eos_token) + continue_text
    images = message_images(messages)
    return expand_images(loaded.vision, tokenizer, text,
                         [(i.content_hash, i.image if i.image is not None else open_image(i.data, 1 << 62))
                          for i in images])

"""A prompt with images: the chat text's `<image>` markers expanded into each image's tokens, and
where each image's embeddings go.

The chat template writes one `<image>` per image; each becomes the tile tags and image tokens the
model was trained on (Idefics3Vision.prompt_for), the whole text is tokenized once (as transformers'
processor does), and each image is given the positions of its own run of image tokens, in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

from chatloom.models.config import ModelError
from chatloom.models.vision.idefics3 import IMAGE_TOKEN, Idefics3Vision
from chatloom.models.vision.llava import LlavaVision


@dataclass(eq=False)
class ImageInput:
    """One image of a prompt: its content hash (the encoder cache's and the prefix cache's key), the
    decoded image (preprocessed only if the encoder must run), and the prompt positions of its image
    tokens, one per embedding row, in order."""

    content_hash: str
    image: Image.Image
    positions: list[int]
    # Embeddings per piece of encoder work (vision.piece_tokens: an Idefics3 tile's; 0: the whole image).
    # Piece i gives the embeddings at positions[i * piece_len:(i + 1) * piece_len].
    piece_tokens: int = 0
    # The vision side's prepared image (vision.prepare) while pieces of it are left to encode.
    prepared: object = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def piece_len(self) -> int:
        return self.piece_tokens or self.num_tokens

    @property
    def num_pieces(self) -> int:
        return -(-self.num_tokens // self.piece_len)

    def piece_first_position(self, index: int) -> int:
        return self.positions[index * self.piece_len]

    def piece_last_position(self, index: int) -> int:
        return self.positions[min((index + 1) * self.piece_len, self.num_tokens) - 1]


def expand_images(vision: "Idefics3Vision | LlavaVision", tokenizer, text: str,
                  images: list[tuple[str, Image.Image]]) -> tuple[list[int], list[ImageInput]]:
    """Token ids of `text` with its `<image>` markers expanded for `images` ((hash, image) each, in the
    markers' order), and each image's placement. ModelError if markers and images disagree."""
    parts = text.split(IMAGE_TOKEN)
    if len(parts) - 1 != len(images):
        raise ModelError(f"the prompt has {len(parts) - 1} image markers for {len(images)} images")
    bos = tokenizer.bos_token
    if getattr(vision, "image_token_in_vocab", True):
        expanded = parts[0] + "".join(vision.prompt_for(image) + part for (_, image), part in zip(images, parts[1:]))
        ids = tokenizer.encode(expanded, add_special=not (bos and expanded.startswith(bos)))
    else:  # no image token to write: each text piece on its own, placeholders between (as llama.cpp does)
        ids = tokenizer.encode(parts[0], add_special=not (bos and parts[0].startswith(bos)))
        for (_, image), part in zip(images, parts[1:]):
            ids += [vision.image_token_id] * vision.num_image_tokens(image.width, image.height)
            ids += tokenizer.encode(part, add_special=False) if part else []
    slots = [i for i, t in enumerate(ids) if t == vision.image_token_id]
    out, at = [], 0
    for content_hash, image in images:
        n = vision.num_image_tokens(image.width, image.height)
        out.append(ImageInput(content_hash, image, slots[at:at + n], vision.piece_tokens))
        at += n
    if at != len(slots):
        raise ModelError(f"the prompt has {len(slots)} image tokens; its images need {at}")
    return ids, out

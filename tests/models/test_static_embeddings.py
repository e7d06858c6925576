"""The static embedding model shipped in the wordllama package: loaded from the package's files without
importing it, unit float32 vectors of its width, similar texts nearer than unrelated ones, and a clear
error naming the package when it is not installed."""
from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from chatloom.models.config import ModelError
from chatloom.models import static_embeddings
from chatloom.models.static_embeddings import load_static_embedder, model_files
from chatloom.settings.tree import DEFAULT_EMBEDDING_MODEL

needs_wordllama = pytest.mark.skipif(importlib.util.find_spec("wordllama") is None,
                                     reason="needs the wordllama package: pip install --no-deps wordllama==0.4.0.post1")

PASSWORD = ("To reset a forgotten password, open the sign-in page and ask for a reset link; it arrives by email "
            "within a minute and works once.")
UNRELATED = ["Knead the dough for ten minutes, let it rise in a warm place until doubled, then bake it.",
             "Quarterly tax payments are due in April, June, September and January; late payments accrue interest.",
             "A bicycle chain that skips under load is usually worn: measure its stretch and replace it."]


@needs_wordllama
def test_it_loads_from_the_package_and_gives_unit_float32_vectors_of_its_width():
    model = load_static_embedder()
    assert model.id == DEFAULT_EMBEDDING_MODEL and model.dim == 256
    vectors = model.embed(["hello world", PASSWORD, "x" * 5000])
    assert vectors.shape == (3, 256) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(model.embed(["hello world"])[0], vectors[0])  # alone or batched, the same
    assert "wordllama" not in sys.modules  # its files are read, the package is never imported


@needs_wordllama
def test_a_paraphrase_is_nearer_than_unrelated_texts():
    model = load_static_embedder()
    question, passage, *others = model.embed(["What should I do when I cannot remember my passcode?", PASSWORD,
                                             *UNRELATED])
    near = float(question @ passage)
    assert near > 0.25
    assert all(near > float(question @ o) + 0.15 for o in others)


@needs_wordllama
def test_punctuation_and_byte_pieces_weigh_nothing_and_an_empty_text_is_a_zero_row():
    model = load_static_embedder()
    for text in ("?!", "\n\n", ""):
        assert not model.embed([text]).any(), text
    ids = model.encode(["the zebra"])[0]
    assert model.weights[ids].min() > 0
    # Punctuation around the words does not move the vector.
    assert np.allclose(model.embed(["zebra, savanna!"])[0], model.embed(["zebra savanna"])[0], atol=1e-6)


def test_a_missing_package_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(static_embeddings.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wordllama" else real(name, *a))
    with pytest.raises(ModelError, match=r"wordllama package.*pip install --no-deps wordllama==0\.4\.0\.post1"):
        model_files(DEFAULT_EMBEDDING_MODEL)
    with pytest.raises(ModelError, match="unknown static embedding model"):
        model_files("no-such-model")

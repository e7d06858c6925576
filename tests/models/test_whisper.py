"""Whisper through chatloom against transformers, on a tiny random checkpoint built offline: the same
log-mel features, the same greedy tokens, batched or not; and audio decoding with PyAV."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from chatloom.models.speech.features import (SAMPLE_RATE, AudioError, FeatureExtractor, decode_audio,
                                             mel_filters)
from chatloom.models.speech.whisper import load_whisper

import tiny_whisper as tw


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tw.write_whisper_folder(tmp_path_factory.mktemp("whisper") / "tiny-whisper")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration
    return WhisperForConditionalGeneration.from_pretrained(folder).eval(), WhisperFeatureExtractor.from_pretrained(folder)


@pytest.fixture(scope="module")
def whisper(folder):
    return load_whisper(folder)


def test_audio_is_decoded_to_16_khz_mono():
    samples = decode_audio(tw.wav_bytes(2.5, rate=8000, channels=2), max_seconds=60)
    assert samples.dtype == np.float32 and abs(len(samples) - 2.5 * SAMPLE_RATE) < 200
    assert 0.1 < np.abs(samples).max() <= 1.0


@pytest.mark.parametrize("data,words", [(b"", "empty"), (b"this is not audio at all" * 10, "not audio"),
                                        ("cut", "corrupt"), ("long", "longer than")])
def test_bad_audio_is_refused_by_name(data, words):
    if data == "cut":
        data = tw.wav_bytes(1.0)[:30]
    elif data == "long":
        data = tw.wav_bytes(3.0)
    with pytest.raises(AudioError, match=words):
        decode_audio(data, max_seconds=2)


def test_mel_filters_match(hf):
    np.testing.assert_allclose(mel_filters(80), hf[1].mel_filters, atol=1e-8)


@pytest.mark.parametrize("seconds", [0.5, 7.0, 30.0])
def test_features_match_the_feature_extractor(hf, seconds):
    samples = decode_audio(tw.wav_bytes(seconds, seed=1), max_seconds=60)
    want = hf[1](samples, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features[0]
    torch.testing.assert_close(FeatureExtractor(80)(samples), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_tokens_match_transformers(hf, whisper, seed):
    model, extractor = hf
    samples = decode_audio(tw.wav_bytes(3.0 + seed, seed=seed), max_seconds=60)
    features = extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
    prompt = whisper.prompt("en")
    with torch.no_grad():
        want = model.generate(features, decoder_input_ids=torch.tensor([prompt]), max_new_tokens=20,
                              do_sample=False)[0].tolist()
    if want[:len(prompt)] == prompt:  # transformers returns the new tokens alone (Whisper strips the prompt)
        want = want[len(prompt):]
    eos = whisper.config.eos_token_id
    want = want[:want.index(eos)] if eos in want else want
    got = whisper.model.transcribe(FeatureExtractor(80)(samples)[None], [prompt], 20)[0]
    assert got == want and len(got) >= 10


def test_a_batch_gives_each_window_its_own_tokens(whisper):
    extractor = FeatureExtractor(80)
    feats = [extractor(decode_audio(tw.wav_bytes(2.0 + s, seed=s), max_seconds=60)) for s in range(3)]
    prompts = [whisper.prompt("en"), whisper.prompt("fr"), whisper.prompt("en")]
    alone = [whisper.model.transcribe(f[None], [p], 12)[0] for f, p in zip(feats, prompts)]
    together = whisper.model.transcribe(torch.stack(feats), prompts, 12)
    assert together == alone and alone[0] != alone[1]


def test_an_unknown_language_is_refused(whisper):
    from chatloom.models import ModelError
    with pytest.raises(ModelError, match="language 'xx'"):
        whisper.prompt("xx")

"""Audio in, Whisper's input out: decoding any container with PyAV to 16 kHz mono, and the log-mel
spectrogram of each 30-second window (the same values as transformers' WhisperFeatureExtractor).
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE


class AudioError(ValueError):
    """Audio that cannot be used; the message says why, for the user."""


def decode_audio(data: bytes, max_seconds: float) -> np.ndarray:
    """The audio of `data` (any format FFmpeg reads) as float32 mono samples at 16 kHz. AudioError for
    data that is not audio, is corrupt, or is longer than `max_seconds`."""
    import av

    if not data:
        raise AudioError("the audio file is empty")
    limit = int(max_seconds * SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise AudioError("the file has no audio stream")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    samples = out.to_ndarray().reshape(-1)
                    chunks.append(samples)
                    total += samples.size
                    if total > limit:
                        raise AudioError(f"the audio is longer than {max_seconds:g} seconds")
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except AudioError:
        raise
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise AudioError(f"the file is not audio FFmpeg can read, or it is corrupt: {exc}") from None
    if not chunks or sum(c.size for c in chunks) == 0:
        raise AudioError("the file holds no audio samples")
    return np.concatenate(chunks).astype(np.float32)


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    """The Slaney mel scale: linear below 1 kHz, logarithmic above."""
    mels = 3.0 * freq / 200.0
    above = freq >= 1000.0
    mels[above] = 15.0 + np.log(freq[above] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    above = mels >= 15.0
    freq[above] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mels[above] - 15.0))
    return freq


def mel_filters(num_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Slaney-normalized triangular mel filters [1 + n_fft/2, num_mels] over 0-8 kHz (librosa's)."""
    bins = 1 + n_fft // 2
    mel_points = np.linspace(_hz_to_mel(np.array([0.0]))[0], _hz_to_mel(np.array([8000.0]))[0], num_mels + 2)
    filter_freqs = _mel_to_hz(mel_points)
    fft_freqs = np.linspace(0, sample_rate // 2, bins)
    diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (filter_freqs[2:num_mels + 2] - filter_freqs[:num_mels]))[None, :]


@dataclass
class FeatureExtractor:
    num_mels: int = 80

    def __post_init__(self) -> None:
        self.filters = torch.from_numpy(mel_filters(self.num_mels)).float()
        self.window = torch.hann_window(N_FFT)

    def windows(self, samples: np.ndarray) -> list[tuple[float, np.ndarray]]:
        """The audio cut into 30-second windows: (start second, samples), the last one shorter."""
        return [(start / SAMPLE_RATE, samples[start:start + WINDOW_SAMPLES])
                for start in range(0, max(len(samples), 1), WINDOW_SAMPLES)]

    def __call__(self, window: np.ndarray) -> torch.Tensor:
        """One window's log-mel features [num_mels, 3000], the window padded with silence to 30 s."""
        padded = np.zeros(WINDOW_SAMPLES, dtype=np.float32)
        padded[:min(len(window), WINDOW_SAMPLES)] = window[:WINDOW_SAMPLES]
        stft = torch.stft(torch.from_numpy(padded), N_FFT, HOP, window=self.window, return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()
        log_spec = torch.clamp(self.filters.T @ power, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return (log_spec + 4.0) / 4.0

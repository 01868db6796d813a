"""80-dim log-mel filterbank features at exactly 100 frames per second, from audio of any sample rate.

Written in NumPy rather than with librosa: librosa would add a dependency (and with it numba, llvmlite,
soundfile, audioread, ...) for a computation of a few lines, which
`tests/experiments/test_speech_data.py` checks against a slow, obviously correct reference (a dense
DFT, explicit loops).

The recipe, the same at every sample rate `sr`, so that features of 22.05 kHz synthetic speech and of
16 kHz recorded corpora are comparable:

- Frames: frame `i` starts at sample `floor(i * sr / 100)` (exactly 100 frames per second, also at
  22,050 Hz where 10 ms is not a whole number of samples) and is `round(0.025 * sr)` samples long (25 ms).
  There is one frame per started 10 ms: `T = ceil(num_samples * 100 / sr)` frames (1 s of audio gives 100),
  and samples past the end of the audio read as zeros (the last frames are zero-padded, not dropped).
- Spectrum: each frame times a periodic Hann window, zero-padded to `n_fft`, the next power of two >= the
  window (512 at 16 kHz, 1024 at 22.05 kHz); the power spectrum `|rfft|^2`.
- Mel: `num_mels` triangular filters evenly spaced on the Slaney mel scale (linear below 1 kHz,
  logarithmic above; librosa's default, `htk=False`) from 20 Hz to `min(8000, sr / 2)` Hz, each scaled to
  unit area in Hz (Slaney normalisation, librosa's `norm="slaney"`), so a filter's output is the mean
  power density over its band whatever its width.
- `log(mel + 1e-6)`: the floor keeps digital silence (eSpeak's pauses are exact zeros) finite.

The features are not normalised; `normalise_utterance` does that per utterance (when loading), which
also removes the constant offsets between sample rates (the window length in samples differs).
"""

from __future__ import annotations

import math

import numpy as np

NUM_MELS = 80
FRAME_RATE = 100  # frames per second
WINDOW_SECONDS = 0.025
FMIN = 20.0
FMAX = 8000.0
LOG_FLOOR = 1e-6


def hz_to_mel(hz):
    """Slaney's mel scale: linear (3 / 200 mel per Hz) below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz / (200.0 / 3.0)
    logarithmic = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, logarithmic, linear)


def mel_to_hz(mel):
    """The inverse of `hz_to_mel`."""
    mel = np.asarray(mel, dtype=np.float64)
    linear = mel * (200.0 / 3.0)
    logarithmic = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0))
    return np.where(mel >= 15.0, logarithmic, linear)


def window_length(sample_rate: int) -> int:
    """Samples in a 25 ms analysis window at `sample_rate` (rounded)."""
    return int(round(WINDOW_SECONDS * sample_rate))


def fft_size(sample_rate: int) -> int:
    """The next power of two >= the window length."""
    return 1 << (window_length(sample_rate) - 1).bit_length()


def num_frames(num_samples: int, sample_rate: int) -> int:
    """`ceil(num_samples * 100 / sample_rate)`: one frame per started 10 ms."""
    return -(-num_samples * FRAME_RATE // sample_rate)


def mel_filterbank(sample_rate: int, n_fft: int, num_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """Triangular Slaney-mel filters, unit area in Hz: float64 [num_mels, n_fft // 2 + 1].

    Filter `m` rises from mel point `m` to `m + 1` and falls to `m + 2`, the `num_mels + 2` points evenly
    spaced in mel from `fmin` to `fmax`; it weighs the rfft bin at `k * sample_rate / n_fft` Hz.

    Raises:
      ValueError: unless 0 <= fmin < fmax <= sample_rate / 2 and num_mels >= 1.
    """
    if num_mels < 1 or not 0 <= fmin < fmax <= sample_rate / 2:
        raise ValueError(
            f"mel_filterbank needs num_mels >= 1 and 0 <= fmin < fmax <= sample_rate / 2, got "
            f"num_mels={num_mels}, fmin={fmin}, fmax={fmax}, sample_rate={sample_rate}."
        )
    bins_hz_K = np.arange(n_fft // 2 + 1) * (sample_rate / n_fft)
    points_hz = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), num_mels + 2))
    lower, centre, upper = points_hz[:-2, None], points_hz[1:-1, None], points_hz[2:, None]
    rising = (bins_hz_K - lower) / (centre - lower)
    falling = (upper - bins_hz_K) / (upper - centre)
    weights_MK = np.maximum(0.0, np.minimum(rising, falling))
    return weights_MK * (2.0 / (upper - lower))


def log_mel(audio: np.ndarray, sample_rate: int, *, num_mels: int = NUM_MELS) -> np.ndarray:
    """Log-mel features of mono `audio` (module docstring): float32 [T, num_mels], T = ceil(n * 100 / sr).

    `audio`: int16 (scaled by 1 / 32768) or floating point (taken as is, nominally in [-1, 1]), 1-D.

    Raises:
      ValueError: for audio that is not 1-D, of another dtype, or a sample rate below 200 Hz.
    """
    audio = np.asarray(audio)
    if audio.ndim != 1:
        raise ValueError(f"log_mel takes mono audio of shape [num_samples], got shape {audio.shape}.")
    if audio.dtype == np.int16:
        audio_N = audio.astype(np.float32) / 32768.0
    elif np.issubdtype(audio.dtype, np.floating):
        audio_N = audio.astype(np.float32)
    else:
        raise ValueError(f"log_mel takes int16 or floating-point audio, got {audio.dtype}.")
    if int(sample_rate) != sample_rate or sample_rate < 2 * FRAME_RATE:
        raise ValueError(f"sample_rate={sample_rate} must be a whole number of Hz >= {2 * FRAME_RATE}.")
    sample_rate = int(sample_rate)
    window = window_length(sample_rate)
    n_fft = fft_size(sample_rate)
    T = num_frames(audio_N.shape[0], sample_rate)
    starts_T = np.arange(T, dtype=np.int64) * sample_rate // FRAME_RATE
    padded_N = np.zeros(max(audio_N.shape[0], (starts_T[-1] if T else 0) + window), np.float32)
    padded_N[: audio_N.shape[0]] = audio_N
    frames_TW = padded_N[starts_T[:, None] + np.arange(window)]
    hann_W = (0.5 - 0.5 * np.cos(2.0 * math.pi * np.arange(window) / window)).astype(np.float32)
    power_TK = np.abs(np.fft.rfft(frames_TW * hann_W, n=n_fft, axis=-1)) ** 2
    fmax = min(FMAX, sample_rate / 2)
    filters_MK = mel_filterbank(sample_rate, n_fft, num_mels, FMIN, fmax).astype(np.float32)
    mel_TM = power_TK.astype(np.float32) @ filters_MK.T
    return np.log(mel_TM + LOG_FLOOR).astype(np.float32)


def normalise_utterance(features_TF: np.ndarray) -> np.ndarray:
    """Per-utterance mean 0, variance 1 in each feature bin: float32 [T, F].

    A constant bin (std <= 1e-8, e.g. the log floor throughout) becomes zeros instead of dividing by zero.
    """
    features_TF = np.asarray(features_TF, dtype=np.float64)
    if features_TF.ndim != 2:
        raise ValueError(f"normalise_utterance takes features [T, F], got shape {features_TF.shape}.")
    if features_TF.shape[0] == 0:
        return features_TF.astype(np.float32)
    centred_TF = features_TF - features_TF.mean(axis=0)
    std_F = centred_TF.std(axis=0)
    varying_F = std_F > 1e-8
    return np.where(varying_F, centred_TF / np.where(varying_F, std_F, 1.0), 0.0).astype(np.float32)


def stack_frames(features_TF: np.ndarray, k: int) -> np.ndarray:
    """Concatenates each `k` consecutive frames: [ceil(T / k), k * F], the tail zero-padded.

    Row `j` is frames `j*k .. j*k + k - 1` side by side (frame `j*k` first): a `k`-fold lower frame rate
    (k = 4: 25 frames per second), so attention runs over `k` times shorter sequences.
    """
    features_TF = np.asarray(features_TF)
    if features_TF.ndim != 2 or k < 1:
        raise ValueError(f"stack_frames takes features [T, F] and k >= 1, got {features_TF.shape}, k={k}.")
    T, F = features_TF.shape
    rows = -(-T // k)
    padded_TF = np.zeros((rows * k, F), features_TF.dtype)
    padded_TF[:T] = features_TF
    return padded_TF.reshape(rows, k * F)

"""Reading speech audio files: FLAC (LibriSpeech, through `soundfile`), NIST SPHERE (WSJ's .wv1,
uncompressed PCM only) and 16-bit WAV (what `sph2pipe -f wav` writes). Each reader returns
(int16 samples [n], sample rate)."""

from __future__ import annotations

import os
import re
import wave

import numpy as np


def _soundfile():
    """The `soundfile` module, imported only when FLAC files are read."""
    try:
        import soundfile
    except (ImportError, OSError) as e:  # OSError: the module is there but libsndfile is not
        raise ImportError(
            "Reading LibriSpeech's FLAC files needs the `soundfile` package (libsndfile): "
            "`pip install soundfile` (or the `experiments` extra: `pip install -e .[experiments]`)."
        ) from e
    return soundfile


def read_flac(path: os.PathLike | str) -> tuple[np.ndarray, int]:
    """The samples of the mono FLAC file `path` as int16 [num_samples], and its sample rate.

    Decoded by `soundfile` (libsndfile): neither NumPy nor the standard library reads FLAC.

    Raises:
      ValueError: for a file with more than one channel.
    """
    audio, sample_rate = _soundfile().read(os.fspath(path), dtype="int16", always_2d=True)
    if audio.shape[1] != 1:
        raise ValueError(f"{path} has {audio.shape[1]} channels; LibriSpeech audio is mono.")
    return np.ascontiguousarray(audio[:, 0]), int(sample_rate)


SPHERE_HEADER_MAGIC = b"NIST_1A"


def parse_sphere_header(raw: bytes, path: os.PathLike | str = "<bytes>") -> dict[str, int | float | str]:
    """The fields of a NIST SPHERE header (`NIST_1A`, its size, then "name -type value" lines to `end_head`).

    `raw`: the file's bytes (at least its header). Types: `-i` integer, `-r` real, `-sN` a string of N
    characters. Also returns `header_size`, the bytes before the samples (normally 1024).

    Raises:
      ValueError: naming `path`, for bytes that do not start with a SPHERE header or a malformed one.
    """
    magic, _, rest = raw[:64].partition(b"\n")
    size = rest.split(b"\n", 1)[0].strip()
    if magic.strip() != SPHERE_HEADER_MAGIC or not size.isdigit():
        raise ValueError(f"{path} is not a NIST SPHERE file: it does not start with 'NIST_1A\\n   1024\\n'.")
    header_size = int(size)
    fields: dict[str, int | float | str] = {"header_size": header_size}
    for line in raw[:header_size].decode("ascii", errors="replace").split("\n")[2:]:
        if line.strip() == "end_head":
            return fields
        if not line.strip() or line.lstrip().startswith(";"):
            continue
        parts = line.split(None, 2)
        if len(parts) < 3:
            raise ValueError(f"{path}: SPHERE header line {line.strip()!r} is not 'name -type value'.")
        name, kind, value = parts
        try:
            if kind == "-i":
                fields[name] = int(value)
            elif kind == "-r":
                fields[name] = float(value)
            elif re.fullmatch(r"-s\d+", kind):
                fields[name] = value[: int(kind[2:])].strip()
            else:
                raise ValueError(f"unknown type {kind!r} (not -i, -r or -sN)")
        except ValueError as e:
            raise ValueError(f"{path}: SPHERE header line {line.strip()!r}: {e}.") from None
    raise ValueError(f"{path}: the SPHERE header has no 'end_head' line within its {header_size} bytes.")


def read_sphere(path: os.PathLike | str) -> tuple[np.ndarray, int]:
    """The samples of an uncompressed 16-bit PCM mono NIST SPHERE file (WSJ's `.wv1`): int16 [n], rate.

    Reads `sample_rate`, `sample_count`, `sample_n_bytes` (must be 2), `channel_count` (must be 1),
    `sample_byte_format` ("01" little-endian, "10" big-endian) and `sample_coding` ("pcm" or absent).

    Raises:
      ValueError: for shorten-compressed files (as the LDC ships WSJ: convert them first with
        `sph2pipe -f wav`), other codings, sample sizes or channel counts, or a truncated file.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    header = parse_sphere_header(raw, path)
    coding = str(header.get("sample_coding", "pcm")).lower()
    if "shorten" in coding:
        raise ValueError(
            f"{path} is shorten-compressed (sample_coding {coding!r}), as the LDC distributes WSJ; it cannot "
            "be read here. Convert the corpus first with sph2pipe (part of Kaldi's tools, or from the LDC): "
            "for every .wv1 file, `sph2pipe -f wav FILE.wv1 FILE.wav`, keeping the .wav beside the .wv1 "
            "(in the same folder): the .wav files are then read instead."
        )
    if coding != "pcm":
        raise ValueError(f"{path}: sample_coding {coding!r} is not supported; only 16-bit 'pcm' is.")
    for name in ("sample_rate", "sample_count"):
        if name not in header:
            raise ValueError(f"{path}: the SPHERE header has no {name} field.")
    n_bytes, channels = header.get("sample_n_bytes", 2), header.get("channel_count", 1)
    if n_bytes != 2 or channels != 1:
        raise ValueError(
            f"{path}: {n_bytes}-byte samples in {channels} channel(s); only 2-byte mono audio is supported."
        )
    byte_format = str(header.get("sample_byte_format", ""))
    if byte_format not in ("01", "10"):
        raise ValueError(
            f"{path}: sample_byte_format {byte_format!r} is not '01' (little-endian) or '10' (big)."
        )
    count, start = int(header["sample_count"]), int(header["header_size"])
    if len(raw) < start + 2 * count:
        raise ValueError(
            f"{path}: the header says {count} samples, but the file holds {(len(raw) - start) // 2}."
        )
    dtype = "<i2" if byte_format == "01" else ">i2"
    samples = np.frombuffer(raw, dtype=dtype, count=count, offset=start).astype(np.int16)
    return samples, int(header["sample_rate"])


def read_wav(path: os.PathLike | str) -> tuple[np.ndarray, int]:
    """The samples of a 16-bit PCM mono WAV file (as `sph2pipe -f wav` writes): int16 [n], rate.

    Raises:
      ValueError: for other sample sizes or channel counts.
    """
    with wave.open(os.fspath(path), "rb") as f:
        if f.getsampwidth() != 2 or f.getnchannels() != 1:
            raise ValueError(
                f"{path}: {8 * f.getsampwidth()}-bit samples in {f.getnchannels()} channel(s); "
                "only 16-bit mono WAV is supported."
            )
        frames = f.readframes(f.getnframes())
        return np.frombuffer(frames, dtype="<i2").astype(np.int16), f.getframerate()

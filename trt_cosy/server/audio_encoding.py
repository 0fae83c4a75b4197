"""Response audio: WAV, raw PCM, FLAC, MP3, Ogg Opus and AAC from float32 chunks.

WAV and PCM are written here (a WAV header of unknown length first when streaming, then 16-bit
samples). The compressed formats are encoded chunk by chunk by PyAV where it is installed
(``streaming_encoders``, the ``codecs`` extra; AAC only then); without it FLAC, MP3 and Opus are
encoded by libsndfile (through soundfile) once the audio is complete, MP3 and Opus only where the
installed libsndfile has those encoders.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import struct
from typing import Final

import numpy as np

from .errors import APIError

__all__ = [
    "available_formats",
    "check_format",
    "content_type",
    "encode_audio",
    "pcm16",
    "pyav_available",
    "wav_header",
]

_LOGGER = logging.getLogger(__name__)

_PCM_SCALE: Final = 32767.0
_UNKNOWN_SIZE: Final = 0xFFFFFFFF  # RIFF/data sizes of a stream whose length is not known yet
_CONTENT_TYPES: Final = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
}
# response_format -> (libsndfile major format, subtype)
_SNDFILE: Final = {
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}


def pyav_available() -> bool:
    """Whether PyAV (the ``codecs`` extra) is importable."""
    return importlib.util.find_spec("av") is not None


def available_formats() -> tuple[str, ...]:
    """The response formats this installation can encode (wav and pcm always; all six with PyAV)."""
    import soundfile

    with_pyav = pyav_available()
    majors = soundfile.available_formats()
    names = ["wav", "pcm"]
    for name, (major, subtype) in _SNDFILE.items():
        if with_pyav or (major in majors and subtype in soundfile.available_subtypes(major)):
            names.append(name)
    if with_pyav:
        names.append("aac")
    return tuple(names)


def check_format(name: str, formats: tuple[str, ...]) -> str:
    """``name`` if it can be served, else a 400 listing what can."""
    if name not in formats:
        hint = ""
        if name in _CONTENT_TYPES:  # a known format this installation lacks the encoder of
            hint = " (PyAV encodes flac, mp3, opus and aac: pip install 'trt-cosy[codecs]')"
        raise APIError(
            400,
            f"response_format {name!r} is not supported here; use one of {', '.join(formats)}{hint}.",
            "unsupported_format",
            "response_format",
        )
    return name


def content_type(name: str) -> str:
    return _CONTENT_TYPES[name]


def pcm16(samples: np.ndarray) -> bytes:
    """Little-endian signed 16-bit PCM of a float waveform in [-1, 1]."""
    scaled = np.round(np.clip(samples, -1.0, 1.0) * _PCM_SCALE)  # scaled: [N]
    return scaled.astype("<i2").tobytes()


def wav_header(sample_rate: int, num_samples: int | None = None) -> bytes:
    """A 44-byte mono 16-bit PCM WAV header; ``None`` samples: unknown length (for streaming)."""
    if num_samples is None:
        data_size = riff_size = _UNKNOWN_SIZE
    else:
        data_size = 2 * num_samples
        riff_size = 36 + data_size
    byte_rate = sample_rate * 2
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, byte_rate, 2, 16)
        + b"data"
        + struct.pack("<I", data_size)
    )


def encode_audio(samples: np.ndarray, sample_rate: int, name: str) -> bytes:
    """The whole waveform (float32 [N]) as one file of format ``name``."""
    if name == "pcm":
        return pcm16(samples)
    if name == "wav":
        return wav_header(sample_rate, samples.shape[0]) + pcm16(samples)
    import soundfile

    major, subtype = _SNDFILE[name]
    sink = io.BytesIO()
    clipped = np.clip(samples, -1.0, 1.0).astype(np.float32)  # clipped: [N]
    soundfile.write(sink, clipped, sample_rate, subtype=subtype, format=major)
    return sink.getvalue()

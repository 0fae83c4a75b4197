"""Incremental response encoders: one per request, fed the engine's float32 chunks as they are made.

    encoder = open_encoder("mp3", 24000)
    for chunk in chunks:
        send(encoder.encode(chunk.samples))   # the bytes the encoder has ready (possibly b"")
    send(encoder.finish())                    # the rest: encoder delay, last frame, trailer

wav and pcm need nothing. mp3, Ogg Opus, AAC (ADTS) and FLAC are encoded by FFmpeg through PyAV
(the ``codecs`` extra: ``pip install 'trt-cosy[codecs]'``) into a write-only sink, so every muxer
writes its stream front to back and never seeks: the bytes can go out at once. Without PyAV, flac,
mp3 and opus are still served as one complete file by libsndfile (``audio_encoding.encode_audio``),
only once the whole answer is made; aac needs PyAV.

Encoder settings (speech, mono): mp3 64 kbit/s (LAME quality 7: half LAME's default cost, no
audible difference on speech), Opus 48 kbit/s in Ogg pages of at most 100 ms, AAC-LC 64 kbit/s,
FLAC 16-bit. docs/benchmarks.md ("Streaming formats") has what they cost.
"""

from __future__ import annotations

import fractions
import io
import logging
import time
from typing import Final

import numpy as np

from . import audio_encoding
from .audio_encoding import encode_audio, pcm16, wav_header
from .errors import APIError

__all__ = [
    "CODECS_EXTRA",
    "AudioEncoder",
    "codec_formats",
    "encode_file",
    "open_encoder",
    "streams_incrementally",
]

_LOGGER = logging.getLogger(__name__)

CODECS_EXTRA: Final = "codecs"
"""The pyproject extra that installs PyAV (``pip install 'trt-cosy[codecs]'``)."""


# response_format -> (FFmpeg muxer, encoder, bit rate or None, muxer options, encoder options)
_CODECS: Final[dict[str, tuple[str, str, int | None, dict[str, str], dict[str, str]]]] = {
    # No ID3 tag and no Xing frame: a plain run of MPEG frames, decodable from any point of the stream.
    "mp3": (
        "mp3",
        "libmp3lame",
        64000,
        {"id3v2_version": "0", "write_xing": "0"},
        {"compression_level": "7"},
    ),
    # page_duration (microseconds): a page is written every 100 ms of audio, not every second.
    "opus": ("ogg", "libopus", 48000, {"page_duration": "100000"}, {}),
    "aac": ("adts", "aac", 64000, {}, {}),
    "flac": ("flac", "flac", None, {}, {}),
}
_OPUS_RATES: Final = (48000, 24000, 16000, 12000, 8000)


def codec_formats() -> tuple[str, ...]:
    """The compressed formats PyAV encodes here (all four when it is installed, else none)."""
    return tuple(_CODECS) if audio_encoding.pyav_available() else ()


def streams_incrementally(name: str) -> bool:
    """Whether ``name`` goes out chunk by chunk (wav, pcm; the compressed ones with PyAV)."""
    return name in ("wav", "pcm") or name in codec_formats()


class AudioEncoder:
    """Turns float32 chunks (mono, [-1, 1]) into the bytes of one response, front to back.

    Subclasses implement ``_encode`` and ``_finish``; ``encode``/``finish`` add up the CPU time they
    take in ``cpu_s`` (the calling thread's, ``time.thread_time``: what encoding costs the machine,
    whichever thread ran it), which the server exports per format (``trt_cosy_encode_cpu_seconds``).
    """

    costly = False
    """Whether ``encode``/``finish`` take long enough to belong in a worker thread."""
    cpu_s = 0.0
    """CPU seconds spent in ``encode`` and ``finish`` so far."""
    format = ""
    """The response format (set by ``open_encoder``)."""

    def encode(self, samples: np.ndarray) -> bytes:
        """The bytes ready after ``samples`` (float32 [N]); may be empty while the encoder fills a frame."""
        started = time.thread_time()
        try:
            return self._encode(samples)
        finally:
            self.cpu_s += time.thread_time() - started

    def finish(self) -> bytes:
        """Everything still held (the encoder's delay, the last frame, the container's end)."""
        started = time.thread_time()
        try:
            return self._finish()
        finally:
            self.cpu_s += time.thread_time() - started

    def close(self) -> None:
        """Free the encoder without finishing (a stream that ended early); idempotent."""

    def _encode(self, samples: np.ndarray) -> bytes:
        raise NotImplementedError

    def _finish(self) -> bytes:
        raise NotImplementedError


class _PCMEncoder(AudioEncoder):
    def _encode(self, samples: np.ndarray) -> bytes:
        return pcm16(samples)

    def _finish(self) -> bytes:
        return b""


class _WAVEncoder(_PCMEncoder):
    """A header of unknown length first (``wav_header(rate)``), then 16-bit samples."""

    def __init__(self, sample_rate: int):
        self._header: bytes | None = wav_header(sample_rate)

    def _encode(self, samples: np.ndarray) -> bytes:
        header, self._header = self._header or b"", None
        return header + pcm16(samples)

    def _finish(self) -> bytes:
        header, self._header = self._header or b"", None
        return header


class _WholeFileEncoder(AudioEncoder):
    """Without PyAV: keeps the samples and encodes one complete file with libsndfile at ``finish``."""

    costly = True

    def __init__(self, name: str, sample_rate: int):
        self._name = name
        self._sample_rate = sample_rate
        self._pieces: list[np.ndarray] = []

    def _encode(self, samples: np.ndarray) -> bytes:
        self._pieces.append(samples)
        return b""

    def _finish(self) -> bytes:
        samples = np.concatenate(self._pieces) if self._pieces else np.zeros(0, np.float32)  # [N]
        self._pieces = []
        return encode_audio(samples, self._sample_rate, self._name)


class _Sink:
    """The muxer's output: write-only, so FFmpeg's muxers never seek back (``flush_packets`` makes
    them hand over every packet at once instead of filling a 32 KiB buffer first)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data


class _CodecEncoder(AudioEncoder):
    """One FFmpeg encoder and muxer (PyAV). Frames of any length go in: PyAV's resampler cuts them
    into the codec's frame size (and converts the rate where Opus needs one of its own)."""

    costly = True

    def __init__(self, name: str, sample_rate: int, whole_file: bool = False):
        import av

        muxer, codec, bit_rate, muxer_options, codec_options = _CODECS[name]
        rate = sample_rate
        if name == "opus" and sample_rate not in _OPUS_RATES:
            rate = 48000  # CosyVoice 1's 22050 Hz: resampled by PyAV
        # A whole file goes to a seekable buffer: the muxers then complete their headers at the end
        # (FLAC's sample count and MD5, MP3's Xing frame); a stream goes to the write-only sink.
        self._file = io.BytesIO() if whole_file else None
        self._sink = _Sink()
        options = {"flush_packets": "1", **muxer_options}
        if whole_file:
            options = {key: value for key, value in muxer_options.items() if key != "write_xing"}
        self._container = av.open(self._file or self._sink, "w", format=muxer, container_options=options)
        self._stream = self._container.add_stream(codec, rate=rate, options=codec_options)
        self._stream.layout = "mono"
        if bit_rate is not None:
            self._stream.bit_rate = bit_rate
        self._lossless = name == "flac"
        self._sample_rate = sample_rate
        self._time_base = fractions.Fraction(1, sample_rate)
        self._samples_in = 0
        self._closed = False

    def _encode(self, samples: np.ndarray) -> bytes:
        import av

        if samples.size:
            if self._lossless:  # the very samples of pcm and wav (FFmpeg would scale by 32768, not 32767)
                pcm = np.frombuffer(pcm16(samples), "<i2")  # pcm: [N]
                frame = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")  # [1, N]
            else:
                clipped = np.clip(samples, -1.0, 1.0).astype(np.float32)  # clipped: [N]
                frame = av.AudioFrame.from_ndarray(clipped[None, :], format="flt", layout="mono")  # [1, N]
            frame.sample_rate = self._sample_rate
            frame.time_base = self._time_base
            frame.pts = self._samples_in
            self._samples_in += samples.size
            self._mux(frame)
        return self._sink.take()

    def _finish(self) -> bytes:
        self._mux(None)  # drains the encoder
        self.close()
        if self._file is not None:
            return self._file.getvalue()
        return self._sink.take()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._container.close()  # writes the container's end (nothing for mp3/adts)

    def _mux(self, frame) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)


def open_encoder(name: str, sample_rate: int) -> AudioEncoder:
    """A fresh encoder of response format ``name`` (checked by ``audio_encoding.check_format``).

    Raises:
        APIError: 400 naming the ``codecs`` extra when ``name`` needs PyAV and it is missing.
    """
    encoder: AudioEncoder
    if name == "pcm":
        encoder = _PCMEncoder()
    elif name == "wav":
        encoder = _WAVEncoder(sample_rate)
    elif name in codec_formats():
        encoder = _CodecEncoder(name, sample_rate)
    elif name == "aac":
        raise APIError(
            400,
            f"response_format 'aac' needs PyAV: pip install 'trt-cosy[{CODECS_EXTRA}]'.",
            "unsupported_format",
            "response_format",
        )
    else:
        encoder = _WholeFileEncoder(name, sample_rate)
    encoder.format = name
    return encoder


def encode_file(samples: np.ndarray, sample_rate: int, name: str) -> bytes:
    """The whole waveform (float32 [N]) as one complete file (``"stream": false``): PyAV's encoder of a
    streamed answer with the headers completed where it is installed, else ``encode_audio``."""
    if name in codec_formats():
        encoder = _CodecEncoder(name, sample_rate, whole_file=True)
        try:
            encoder.encode(samples)
            return encoder.finish()
        finally:
            encoder.close()
    if name == "aac":
        open_encoder(name, sample_rate)  # the 400 naming the extra
    return encode_audio(samples, sample_rate, name)

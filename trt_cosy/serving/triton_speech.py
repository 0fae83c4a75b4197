"""The Triton model's request logic without Triton: input arrays in, audio chunks out.

``triton_model`` adapts this to the Python backend (``pb_utils``); keeping the checks here lets
tests run them without a server. Every refusal is an ``InputError`` whose message is the one the
CLI prints for the same mistake (the engine's own checks raise them unchanged).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from ..errors import InputError
from ..frontend.voice import Voice
from ..synthesis import SynthesisConfig

__all__ = ["SpeechInputs", "TritonSpeech", "parse_inputs", "samples_of", "INPUT_NAMES"]

_LOGGER = logging.getLogger(__name__)

DEFAULT_MAX_TEXT_CHARS: Final = 4096
INPUT_NAMES: Final = (
    "text", "voice", "reference_audio", "reference_sample_rate", "reference_text", "seed", "stream",
    "source_audio", "source_sample_rate", "instructions",
)
MAX_INSTRUCTIONS_CHARS: Final = 1000
_REFERENCE_NAME: Final = "reference_audio"
_SOURCE_NAME: Final = "source_audio"  # voice conversion: speech to say again in the voice, instead of text


@dataclass(frozen=True)
class SpeechInputs:
    """One request's inputs, decoded and checked."""

    text: str
    voice: str | None
    """A stored voice's name (``voice`` input), or None when ``reference_audio`` is given."""
    reference_audio: np.ndarray | None
    """float32 [N], mono, in [-1, 1]."""
    reference_sample_rate: int | None
    reference_text: str | None
    seed: int | None
    stream: bool
    source_audio: np.ndarray | None = None
    """Voice conversion (instead of ``text``, which is then ""): float32 [N], mono, in [-1, 1]."""
    source_sample_rate: int | None = None
    instructions: str | None = None
    """How to speak (the model's instruct mode, CosyVoice2/3); None or empty: none."""


def _one(inputs: Mapping[str, np.ndarray], name: str) -> Any:
    """The single element of an input declared with dims [1]."""
    array = np.asarray(inputs[name]).reshape(-1)  # array: [1]
    if array.size != 1:
        raise InputError(f"input {name!r} must hold exactly one element, got {array.size}.")
    return array[0]


def _string(inputs: Mapping[str, np.ndarray], name: str) -> str:
    value = _one(inputs, name)
    if isinstance(value, bytes | np.bytes_):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"input {name!r} is not UTF-8 text; send it UTF-8 encoded.") from None
    return str(value)


def parse_inputs(inputs: Mapping[str, np.ndarray], max_text_chars: int = DEFAULT_MAX_TEXT_CHARS) -> SpeechInputs:
    """Decode the request's tensors (by input name) and check what does not need the engine.

    Raises:
        InputError: a missing or extra voice, a text longer than ``max_text_chars``, a bad reference
            rate or array, a negative seed.
    """
    unknown = sorted(set(inputs) - set(INPUT_NAMES))
    if unknown:
        raise InputError(f"unknown inputs {unknown}; this model takes {', '.join(INPUT_NAMES)}.")
    source, source_rate = None, None
    if _SOURCE_NAME in inputs:
        if "text" in inputs:
            raise InputError("send either 'text' or 'source_audio' (voice conversion), not both.")
        source, source_rate = _audio(inputs, _SOURCE_NAME, "source_sample_rate")
        if "reference_text" in inputs:
            raise InputError(
                "'reference_text' does not go with 'source_audio': voice conversion uses no transcript."
            )
    elif "source_sample_rate" in inputs:
        raise InputError("'source_sample_rate' goes with 'source_audio'.")
    elif "text" not in inputs:
        raise InputError("input 'text' is missing; send the words to speak (or 'source_audio' to convert).")
    text = _string(inputs, "text") if "text" in inputs else ""
    if len(text) > max_text_chars:
        raise InputError(
            f"text is {len(text)} characters; at most {max_text_chars} are accepted. Send the text in parts."
        )
    has_voice, has_reference = "voice" in inputs, _REFERENCE_NAME in inputs
    if has_voice == has_reference:
        raise InputError(
            "send either 'voice' (a stored voice's name) or 'reference_audio' with 'reference_sample_rate', "
            "not both and not neither."
        )
    reference, rate, reference_text = None, None, None
    if has_reference:
        reference, rate = _audio(inputs, _REFERENCE_NAME, "reference_sample_rate")
        if "reference_text" in inputs:
            reference_text = _string(inputs, "reference_text")
    elif "reference_sample_rate" in inputs or "reference_text" in inputs:
        raise InputError("'reference_sample_rate' and 'reference_text' go with 'reference_audio', not 'voice'.")
    seed = int(_one(inputs, "seed")) if "seed" in inputs else None
    if seed is not None and seed < 0:
        raise InputError(f"seed must be a non-negative integer, got {seed}.")
    stream = bool(_one(inputs, "stream")) if "stream" in inputs else False
    voice = _string(inputs, "voice") if has_voice else None
    instructions = _string(inputs, "instructions").strip() if "instructions" in inputs else ""
    if len(instructions) > MAX_INSTRUCTIONS_CHARS:
        raise InputError(
            f"instructions are {len(instructions)} characters; at most {MAX_INSTRUCTIONS_CHARS} are accepted."
        )
    return SpeechInputs(
        text, voice, reference, rate, reference_text, seed, stream, source, source_rate, instructions or None
    )


def _audio(inputs: Mapping[str, np.ndarray], name: str, rate_name: str) -> tuple[np.ndarray, int]:
    """An audio input and its rate input: (float32 [N], Hz)."""
    if rate_name not in inputs:
        raise InputError(f"'{name}' needs '{rate_name}' (Hz, INT32 [1]).")
    rate = int(_one(inputs, rate_name))
    if rate <= 0:
        raise InputError(f"{rate_name} must be positive (Hz), got {rate}.")
    audio = np.asarray(inputs[name], dtype=np.float32).reshape(-1)  # audio: [N]
    if audio.size == 0:
        raise InputError(f"{name} contains no samples. Send a recording of a few seconds of speech.")
    if not np.isfinite(audio).all():
        raise InputError(f"{name} contains NaN or infinite samples; send audio in [-1, 1].")
    return audio, rate


class TritonSpeech:
    """What one Triton model instance runs: the engine plus the stored voices.

    Args:
        tts: a loaded ``CosyVoice`` (or anything with its ``synthesize``/``convert``/``voice_from_wav``).
        voices: a ``VoiceStore`` of the voices folder, or None when the repository has none.
        max_text_chars: the longest text accepted, in characters.
    """

    def __init__(self, tts: Any, voices: Any | None, max_text_chars: int = DEFAULT_MAX_TEXT_CHARS):
        self.tts = tts
        self.voices = voices
        self.max_text_chars = max_text_chars

    def chunks(self, inputs: Mapping[str, np.ndarray]) -> tuple[SpeechInputs, Iterator[np.ndarray]]:
        """Check a request and start it: (its inputs, a lazy iterator of float32 [N] audio chunks).

        The text and voice are checked before this returns (``InputError``); the models run while the
        iterator is consumed, and closing it stops them.
        """
        request, chunks = self.start(inputs)
        return request, _samples(chunks)

    def start(self, inputs: Mapping[str, np.ndarray]) -> tuple[SpeechInputs, Iterator[Any]]:
        """Like ``chunks``, but the engine's own iterator of ``AudioChunk`` (its planned segments on
        ``.request``: what admission by expected work reads; ``samples_of`` gives each chunk's audio)."""
        request = parse_inputs(inputs, self.max_text_chars)
        voice = self._voice(request)
        config = SynthesisConfig(stream=request.stream, instruct=request.instructions)
        if request.source_audio is not None:  # voice conversion (official inference_vc)
            source = (request.source_audio, request.source_sample_rate)
            return request, self.tts.convert(source, voice, request.seed, config)
        return request, self.tts.synthesize(request.text, voice, request.seed, config)

    def text_stream(self, inputs: Mapping[str, np.ndarray]) -> tuple[Any, Iterator[np.ndarray]]:
        """Start a request whose text comes in pieces (a text-streaming sequence's START request; its
        ``text`` is the first piece, maybe empty): (its ``TextStream``, a lazy iterator of audio chunks)."""
        from ..stages.bistream import TextStream

        request = parse_inputs({"text": np.array([b""], dtype=object), **inputs}, self.max_text_chars)
        if request.source_audio is not None:
            raise InputError("a text-streaming sequence speaks text; send 'source_audio' to the other model.")
        voice = self._voice(request)
        text = TextStream(self.tts.tokenizer.encode)
        config = SynthesisConfig(stream=True, instruct=request.instructions)
        chunks = self.tts.synthesize(text, voice, request.seed, config)
        if request.text:
            text.put(request.text)
        return text, _samples(chunks)

    def _voice(self, request: SpeechInputs) -> Voice:
        if request.voice is None:
            return self._voice_from_reference(request)
        if self.voices is None:
            raise InputError(
                f"voice {request.voice!r}: this model repository has no voices folder. Write it with "
                "`trt-cosy triton-repo --voices-dir DIR`, or send reference_audio instead."
            )
        return self._stored_voice(request.voice)

    def _stored_voice(self, name: str) -> Voice:
        from ..server.errors import APIError

        for attempt in range(2):
            try:
                return self.voices.get(name).voice
            except APIError:
                if attempt == 0:
                    self.voices.load()  # a voice saved into the folder since start
        names = ", ".join(stored.name for stored in self.voices.list()) or "none"
        raise InputError(
            f"voice {name!r} is not in {self.voices.folder} (stored voices: {names}). Save one there with "
            f"`trt-cosy voices save --ref ref.wav -o {self.voices.folder}/{name}.npz`."
        )

    def _voice_from_reference(self, request: SpeechInputs) -> Voice:
        import soundfile

        with tempfile.TemporaryDirectory(prefix="trt-cosy-triton-") as folder:
            path = Path(folder) / "reference.wav"
            soundfile.write(path, request.reference_audio, request.reference_sample_rate, subtype="FLOAT")
            try:
                if request.source_audio is not None:  # the official VC prompt of the reference
                    return self.tts.vc_voice_from_wav(path)
                return self.tts.voice_from_wav(path, request.reference_text)
            except InputError as exc:  # too short, silent...: name the input, not the temp file
                raise InputError(str(exc).replace(str(path), _REFERENCE_NAME)) from None


def samples_of(chunk: Any) -> np.ndarray:
    """An ``AudioChunk``'s audio as Triton sends it: float32 [N], contiguous."""
    return np.ascontiguousarray(chunk.samples, dtype=np.float32)  # samples: [N]


def _samples(chunks: Iterator[Any]) -> Iterator[np.ndarray]:
    try:
        for chunk in chunks:
            yield samples_of(chunk)
    finally:
        chunks.close()

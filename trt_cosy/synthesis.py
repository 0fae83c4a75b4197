"""The per-call pieces of synthesis (numpy only): configs, audio chunks, text planning, wav writing.

``CosyVoice`` (``trt_cosy.tts``) ties these to the stages. Everything here is either an immutable
value (``EngineConfig``, ``SynthesisConfig``, ``AudioChunk``, ``Segment``) or a pure function, so a
request never shares mutable state with another.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import tempfile
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Self

import numpy as np

from .errors import InputError
from .stages.speed import check_speed

if TYPE_CHECKING:
    from .frontend.voice import Voice

__all__ = [
    "EngineConfig", "SynthesisConfig", "AudioChunk", "Segment", "LLMPrompt", "plan_segments", "check_text",
    "segment_token_limit", "llm_prompt", "request_rngs", "write_audio", "AudioPlayer"
]

_LOGGER = logging.getLogger(__name__)

NORMALIZER_ENGINES: Final = ("wetext", "none")
_WAV_FORMAT: Final = "WAV"
_OUTPUT_MODE: Final = 0o644  # mkstemp creates 0600 files; the output is an ordinary file


class _DictOptions:
    """``to_dict`` and ``from_dict`` of an options dataclass; ``from_dict`` refuses unknown fields by name."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Self:
        if not isinstance(raw, Mapping):
            raise InputError(f"{cls.__name__}.from_dict needs a mapping, got {type(raw).__name__}.")
        known = {item.name for item in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InputError(f"unknown {cls.__name__} fields {unknown}; known fields: {sorted(known)}.")
        return cls(**raw)


def _check_normalizer(engine: str | None) -> None:
    if engine is not None and engine not in NORMALIZER_ENGINES:
        raise InputError(f"unknown text normaliser {engine!r}; use one of {', '.join(NORMALIZER_ENGINES)}.")


@dataclass(frozen=True)
class EngineConfig(_DictOptions):
    """Load-time options of ``CosyVoice.load``. ``None`` means the default."""

    threads: int | None = None
    """Intra-op CPU threads of every ONNX Runtime session, >= 1. None: the physical cores."""
    normalizer: str | None = None
    """Default text normaliser: ``"wetext"`` (numbers, dates, money verbalised first) or ``"none"``
    (rules only). None: wetext when installed, else ``"none"`` (what the official code falls back to)."""
    llm_slots: int | None = None
    """Continuous batching of the speech LLM (CosyVoice2/3 on ONNX Runtime, engines with
    ``llm_batch.onnx``): the KV slots of the shared decode loop = the most requests decoded in one
    batch, >= 0. None: ``stages.llm_batch.DEFAULT_SLOTS`` (a server passes its concurrency limit);
    0: every request decodes alone."""
    llm_slot_positions: int | None = None
    """Cached positions per KV slot (prompt + speech tokens), >= 1; a longer request decodes alone.
    None: enough for the longest segment the engines accept (CosyVoice2/3: 8012 positions, reserved
    as address space; pages are committed as a row fills and returned when it leaves)."""
    deterministic: bool | None = None
    """Batch-invariant decoding in the shared decode loop: every step runs all KV slots with the same
    shapes, so a request's logits, and with a seed its tokens and audio, are bit-identical whatever
    else the loop decodes (docs/determinism.md). None: ``stages.llm_batch.DETERMINISTIC_DEFAULT``.
    False: steps over the active rows only (faster with few requests; a seed's audio may then differ
    under load in about one request in 1,000)."""

    def __post_init__(self) -> None:
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise InputError(f"threads must be a positive integer or None, got {self.threads!r}.")
        for name, least in (("llm_slots", 0), ("llm_slot_positions", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise InputError(f"{name} must be an integer >= {least} or None, got {value!r}.")
        if self.deterministic is not None and not isinstance(self.deterministic, bool):
            raise InputError(f"deterministic must be True, False or None, got {self.deterministic!r}.")
        _check_normalizer(self.normalizer)


@dataclass(frozen=True)
class SynthesisConfig(_DictOptions):
    """Per-call options of ``CosyVoice.synthesize``. ``None`` means the model default."""

    max_text_tokens: int | None = None
    """Refuse a text segment with more text tokens than this, >= 1. None: the most the engines
    support for the voice (the flow's fixed noise covers at most 15000 mel frames = 300 s)."""
    speed: float | None = None
    """Speaking-rate factor, 0.25-4.0 (None: 1.0), as the official ``speed``: each segment's mel is stretched
    in time (linear interpolation) before the vocoder, so it works only without ``stream``."""
    text_frontend: bool | None = None
    """Normalise and split the text into sentences (official ``text_frontend``). None: True.
    False synthesises the text exactly as given, in one segment."""
    normalizer: str | None = None
    """``"wetext"`` or ``"none"`` for this call. None: the engine's default (``EngineConfig``)."""
    stream: bool = False
    """Yield audio while the LLM is still speaking: several chunks per text segment on the official
    streaming schedule (CosyVoice2/3: hops of 25 + prompt padding, 50, then 100 speech tokens = 1, 2,
    4 s; CosyVoice 1: 100 tokens = 2 s with a 20-token overlap). False: one chunk per text segment."""
    stream_schedule: str = "official"
    """With ``stream``, CosyVoice2/3: ``"official"`` (the hops above, then a full-attention call over the
    whole segment) or ``"fast"``, trt-cosy's cheaper schedule: hops keep doubling past 100 tokens and the
    last call keeps chunk attention; its audio differs from the official schedule's (trt_cosy.streaming,
    docs/benchmarks.md)."""
    instruct: str | None = None
    """An instruction on how to speak (style, emotion, dialect, role), official instruct modes:
    CosyVoice-300M-Instruct with a preset speaker (``inference_instruct``), CosyVoice2/3 with a
    reference voice (``inference_instruct2``: the instruction replaces the voice's transcript in the
    LLM prompt). The end-of-prompt marker is added when missing. None: no instruction."""

    def __post_init__(self) -> None:
        if not isinstance(self.stream, bool):
            raise InputError(f"stream must be True or False, got {self.stream!r}.")
        if self.stream_schedule not in ("official", "fast"):
            raise InputError(f"stream_schedule must be 'official' or 'fast', got {self.stream_schedule!r}.")
        if self.max_text_tokens is not None and (
            not isinstance(self.max_text_tokens, int) or self.max_text_tokens < 1
        ):
            raise InputError(
                f"max_text_tokens must be a positive integer or None, got {self.max_text_tokens!r}."
            )
        check_speed(self.speed)
        if self.stream and self.speed is not None and self.speed != 1.0:
            raise InputError(
                f"speed {self.speed!r} works only without stream (officially too: the mel of a whole segment is "
                "stretched); set stream=False, or leave speed at 1.0."
            )
        if self.text_frontend is not None and not isinstance(self.text_frontend, bool):
            raise InputError(f"text_frontend must be True, False or None, got {self.text_frontend!r}.")
        if self.instruct is not None and (not isinstance(self.instruct, str) or not self.instruct.strip()):
            raise InputError(f"instruct must be a non-empty string or None, got {self.instruct!r}.")
        _check_normalizer(self.normalizer)


@dataclass(frozen=True, eq=False)
class AudioChunk:
    """One piece of synthesised audio: one per text segment, or several with ``stream=True``.

    Attributes:
        samples: mono waveform, float32 [N], values in [-1, 1].
        sample_rate: Hz (24000 for CosyVoice2).
        index: position of this chunk in the request, from 0.
        is_last: True for the request's final chunk.
        timings: seconds unless noted. ``llm_wait_s``: waiting for this chunk's speech tokens (the
            LLM time not hidden by the pipeline); ``llm_s``: the LLM's decoding time for this segment
            so far (in its worker thread); ``flow_s``, ``vocoder_s``: rendering this chunk;
            ``tokens``: speech tokens this chunk speaks; ``audio_s``: its length; ``first_audio_s``:
            the request's time to first audio; ``elapsed_s``: since the request started; ``rtf``:
            ``elapsed_s`` / audio so far in the request (the request's RTF on its last chunk).
        text: the normalised text segment this chunk speaks.
        segment: the position of that text segment in the request, from 0.
        segments: how many text segments the request has.
    """

    samples: np.ndarray
    sample_rate: int
    index: int
    is_last: bool
    timings: Mapping[str, float] = field(default_factory=dict)
    text: str = ""
    segment: int = 0
    segments: int = 1

    @property
    def duration(self) -> float:
        """Length in seconds."""
        return self.samples.shape[0] / self.sample_rate


@dataclass(frozen=True, eq=False)
class Segment:
    """One text segment to synthesise: its (normalised) text and its text token ids, int64 [N]."""

    text: str
    ids: np.ndarray


@dataclass(frozen=True, eq=False)
class LLMPrompt:
    """What the speech LLM gets besides the text to speak, per official mode (spec §2.4).

    Attributes:
        text_ids: prompt text ids placed before the text (transcript, instruction or the CosyVoice3
            system prompt), int64 [Nt]; may be empty.
        speech_ids: prompt speech tokens after the task token (zero-shot only), int64 [Ns].
        embedding: CosyVoice 1 only: the speaker embedding of the LLM's ``spk`` row, float32 [1, 192];
            None leaves the row out (v1 instruct, and every CosyVoice2/3 mode).
    """

    text_ids: np.ndarray
    speech_ids: np.ndarray
    embedding: np.ndarray | None = None


def _only_punctuation(text: str) -> bool:
    """True when ``text`` holds nothing but punctuation, symbols and whitespace."""
    return all(unicodedata.category(char)[0] in "PSZ" or char.isspace() for char in text)


def check_text(text: object, what: str = "text") -> str:
    """``text`` when it is a ``str`` of valid Unicode without control characters; else ``InputError``.

    Refused: lone UTF-16 surrogates (U+D800-U+DFFF; JSON's ``"\\ud800"`` decodes to one, and no
    tokenizer can encode it) and control characters (category Cc: NUL, ESC, DEL, C1) other than
    whitespace (tab, newlines, form feed). Format characters (zero-width joiner, BOM, bidi marks)
    are ordinary text and pass.
    """
    if not isinstance(text, str):
        raise InputError(f"{what} must be a str, got {type(text).__name__}.")
    for position, char in enumerate(text):
        category = unicodedata.category(char)
        if category == "Cs":
            raise InputError(
                f"{what} has an unpaired UTF-16 surrogate U+{ord(char):04X} at character {position}; "
                "send valid Unicode (a surrogate must be half of a pair, such as \\ud83d\\ude00)."
            )
        if category == "Cc" and not char.isspace():
            raise InputError(
                f"{what} has the control character U+{ord(char):04X} at character {position}; remove "
                "control characters (NUL, escape sequences...) from the text."
            )
    return text


def plan_segments(
    text: str,
    split: Callable[[str], list[str]] | None,
    encode: Callable[[str], Sequence[int]],
    limit: int,
) -> list[Segment]:
    """Check the request text and cut it into the segments to synthesise one after another.

    Args:
        text: the user's text.
        split: ``text -> list[str]`` (``TextNormalizer.split``), or None to keep the text as one
            segment without normalisation (the official ``text_frontend=False``).
        encode: ``text -> list[int]`` (``QwenTextTokenizer.encode``).
        limit: the most text tokens one segment may have.

    Raises:
        InputError: the text is not a string, has a lone surrogate or a control character
            (``check_text``), is empty, whitespace or punctuation only, or a segment has more than
            ``limit`` tokens.
    """
    check_text(text)
    if not text.strip():
        raise InputError("the text is empty; pass the words to speak.")
    if _only_punctuation(text):
        raise InputError(f"the text {text!r} has only punctuation or symbols; pass words to speak.")
    pieces = split(text) if split is not None else [text]
    segments = [Segment(piece, np.asarray(encode(piece), dtype=np.int64)) for piece in pieces]
    segments = [segment for segment in segments if segment.ids.size]
    if not segments:
        raise InputError(f"the text {text!r} has nothing to speak after normalisation; pass words to speak.")
    for number, segment in enumerate(segments, start=1):
        if segment.ids.size > limit:
            raise InputError(
                f"text segment {number} has {segment.ids.size} text tokens; at most {limit} fit in one "
                f"segment. Split the text into shorter sentences with punctuation (. ! ? ;), or send it "
                f"in parts. Segment starts: {segment.text[:60]!r}"
            )
    return segments


def segment_token_limit(
    noise_frames: int, token_mel_ratio: int, max_token_text_ratio: float, prompt_tokens: int
) -> int:
    """The most text tokens of one segment whose longest possible speech still fits the flow.

    The LLM may produce up to ``max_token_text_ratio`` speech tokens per text token; the flow runs on
    prompt + new tokens at ``token_mel_ratio`` frames each and has ``noise_frames`` of start noise.
    """
    speech_budget = noise_frames // token_mel_ratio - prompt_tokens
    return max(0, int(speech_budget // max_token_text_ratio))


def llm_prompt(voice: Voice) -> tuple[np.ndarray, np.ndarray]:
    """(prompt text ids, prompt speech ids) for the LLM input (spec §2.4).

    Zero-shot (the voice has a transcript): both. Cross-lingual (no transcript): neither — the
    LLM sees only the text to speak; the flow still gets the voice's prompt tokens, mel and embedding.
    """
    if voice.prompt_text_ids.size:
        return voice.prompt_text_ids.astype(np.int64), voice.speech_tokens.astype(np.int64)
    return np.zeros(0, np.int64), np.zeros(0, np.int64)


def request_rngs(seed: int | None) -> tuple[np.random.Generator, np.random.Generator]:
    """(LLM sampling rng, vocoder noise rng) of one request: independent streams from one seed.

    The LLM samples in its worker thread while the vocoder draws noise in the caller's thread, so
    each needs its own generator for a seed to give the same audio whatever the thread timing.
    """
    llm_seed, vocoder_seed = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(llm_seed), np.random.default_rng(vocoder_seed)


def _audio_format(path: Path) -> str:
    import soundfile

    if not path.suffix:
        return _WAV_FORMAT
    name = path.suffix[1:].upper()
    formats = soundfile.available_formats()
    if name not in formats:
        raise InputError(
            f"cannot write audio as {path.suffix!r}; use one of .wav, .flac, .ogg "
            f"(libsndfile formats: {', '.join(sorted(formats)).lower()})."
        )
    return name


def write_audio(
    chunks: Iterable[AudioChunk],
    path: str | Path,
    sample_rate: int,
    on_chunk: Callable[[AudioChunk], None] | None = None,
) -> Path:
    """Write every chunk to ``path`` (format from the suffix, WAV without one) atomically.

    Each chunk is written as it arrives (a streaming synthesis lands on disk progressively); the
    audio goes to a temporary file next to ``path`` whose header is completed and which replaces
    ``path`` only when all chunks were written. On any error (or interruption) the temporary file is
    removed, ``path`` is left as it was, and a generator of chunks is closed. ``on_chunk`` is called
    after each chunk is written (progress, playback). Returns ``path``.
    """
    import soundfile

    path = Path(path)
    try:
        if not path.parent.is_dir():
            raise InputError(f"cannot write {path}: folder {path.parent} does not exist. Create it first.")
        audio_format = _audio_format(path)
        handle, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(handle)
        try:
            subtype = soundfile.default_subtype(audio_format)
            with soundfile.SoundFile(temp_name, "w", sample_rate, 1, subtype, format=audio_format) as sink:
                for chunk in chunks:
                    sink.write(np.clip(chunk.samples, -1.0, 1.0))  # samples: [N]
                    if on_chunk is not None:
                        on_chunk(chunk)
            os.chmod(temp_name, _OUTPUT_MODE)
            os.replace(temp_name, path)
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    _LOGGER.debug("wrote %s", path)
    return path


# Players that read raw mono float32 little-endian PCM from stdin: (program, arguments).
_PLAYERS: Final = (
    ("aplay", ("-q", "-t", "raw", "-f", "FLOAT_LE", "-c", "1", "-r", "{rate}", "-")),
    ("paplay", ("--raw", "--format=float32le", "--channels=1", "--rate={rate}")),
    ("ffplay", ("-nodisp", "-autoexit", "-loglevel", "quiet", "-f", "f32le", "-ar", "{rate}", "-i", "-")),
)


class AudioPlayer:
    """Plays chunks as they come through an external player reading raw PCM from stdin."""

    def __init__(self, process: subprocess.Popen):
        self.process = process

    @classmethod
    def open(cls, sample_rate: int) -> AudioPlayer | None:
        """Start the first player found on PATH (aplay, paplay, ffplay); None when there is none."""
        for program, arguments in _PLAYERS:
            executable = shutil.which(program)
            if executable is None:
                continue
            command = [executable, *(item.format(rate=sample_rate) for item in arguments)]
            try:
                process = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)
            except OSError as exc:
                _LOGGER.debug("could not start %s: %s", program, exc)
                continue
            _LOGGER.debug("playing through %s", program)
            return cls(process)
        return None

    def play(self, chunk: AudioChunk) -> None:
        """Queue the chunk's samples (a player that went away is ignored)."""
        data = np.clip(chunk.samples, -1.0, 1.0).astype("<f4").tobytes()  # [N] float32 LE
        try:
            self.process.stdin.write(data)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            _LOGGER.debug("the player stopped reading")

    def close(self, wait: bool = True) -> None:
        """End the input; with ``wait``, until the player has played everything."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        if wait:
            self.process.wait()
        else:
            self.process.terminate()

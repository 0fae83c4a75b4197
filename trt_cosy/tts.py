"""The Python API: ``CosyVoice``, a handle on loaded engines that speaks text in a voice.

    tts = CosyVoice.load("engines/cosyvoice2/onnxruntime-fp32")
    voice = tts.voice_from_wav("ref.wav", text="transcript of ref.wav")   # zero-shot
    tts.synthesize_to_file("Hello there.", "out.wav", voice, seed=0)
    tts.synthesize_to_file("Hello.", "sft.wav", "英文女")                   # preset speaker (300M-SFT)

Every family works the same way (CosyVoice-300M/-SFT/-Instruct, CosyVoice2, Fun-CosyVoice3); what
differs per family is in ``trt_cosy.families``.

The engine holds only read-only resources (graphs, tables, tokenizer, normaliser); every request
keeps its own state (sampler, random generators, LLM worker thread, hop schedule, vocoder cache) in
a ``trt_cosy.pipeline.Request``, so one ``CosyVoice`` serves many threads at once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Final

import numpy as np

from . import families
from .config import YAML_BY_FAMILY
from .errors import EngineMismatchError, InputError, MissingDependencyError
from .frontend.text import TextNormalizer
from .frontend.tokenizer import QwenTextTokenizer
from .frontend.voice import Voice, VoiceBuilder
from .models.registry import family_named
from .pipeline import CancellableChunks, Request, iterate_in_thread
from .runtime.backends.onnxruntime.runner import LazyOrtRunner
from .runtime.model import LoadedModel
from .stages.bistream import TextStream, pump_async_text
from .synthesis import (
    AudioChunk,
    EngineConfig,
    LLMPrompt,
    Segment,
    SynthesisConfig,
    check_text,
    plan_segments,
    write_audio,
)

__all__ = ["CosyVoice", "model_id_from_checkpoint"]

_LOGGER = logging.getLogger(__name__)

_ORT_NAMES: Final = ("auto", "onnxruntime", "ort")
_TRT_NAMES: Final = ("trt", "tensorrt")
_OV_NAMES: Final = ("openvino", "ov")
_MIXED_NAMES: Final = ("mixed",)  # per-graph backends (trt-cosy build --backend mixed)


def model_id_from_checkpoint(family: str, checkpoint_hashes: Mapping[str, str]) -> str:
    """A short id of a checkpoint (``"v2-<16 hex>"``) from the sha256 of its files; voices record it."""
    digest = hashlib.sha256(json.dumps(dict(sorted(checkpoint_hashes.items()))).encode("utf-8"))
    return f"{family}-{digest.hexdigest()[:16]}"


def _engine_backend(backend: str, path: Path) -> str:
    """The ``load_engines`` backend for a ``CosyVoice.load`` backend name; ``"auto"`` follows the
    manifest for OpenVINO engines, and for TensorRT engines where a CUDA GPU and TensorRT are present
    (elsewhere their fp16 graphs run on ONNX Runtime; a missing or unreadable manifest is reported by
    ``load_engines``)."""
    if backend in _TRT_NAMES:
        return "tensorrt"
    if backend in _OV_NAMES:
        return "openvino"
    if backend in _MIXED_NAMES:
        return "mixed"
    if backend == "auto":
        from .runtime.manifest import Manifest

        try:
            built_for = Manifest.read(path).backend
            if built_for in ("openvino", "mixed"):
                return built_for
            if built_for == "tensorrt":
                from .runtime.backend_choice import gpu_unavailable_reason

                if gpu_unavailable_reason() is None:
                    return "tensorrt"
        except EngineMismatchError:
            pass
    return "onnxruntime"


class CosyVoice:
    """Text to speech with a CosyVoice model (1, 2 or 3) on loaded engines.

    Build it with ``CosyVoice.load(engines_dir)``; the constructor takes ready-made parts so that
    tests and servers can inject them.

    Args:
        model: the graphs, tables and config (``trt_cosy.runtime.engines.load_engines`` or the torch
            reference ``trt_cosy.builder.reference.load_torch_model``).
        tokenizer: the text tokenizer (``QwenTextTokenizer``; ``families.V1TextTokenizer`` for v1).
        voice_builder: makes voices from reference recordings; its ``model_id`` is checked against
            every voice used.
        normalizer: the default text normaliser (``TextNormalizer`` with the tokenizer's token count).
        engine_config: the options the engine was loaded with.
        speakers: preset speakers (CosyVoice-300M-SFT/-Instruct): name -> embedding float32 [192].
    """

    def __init__(
        self,
        model: LoadedModel,
        tokenizer: QwenTextTokenizer | families.V1TextTokenizer,
        voice_builder: VoiceBuilder,
        normalizer: TextNormalizer,
        engine_config: EngineConfig | None = None,
        speakers: Mapping[str, np.ndarray] | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.voice_builder = voice_builder
        self.normalizer = normalizer
        self.engine_config = engine_config or EngineConfig()
        self.speaker_embeddings = dict(speakers or {})
        self._normalizers: dict[str, TextNormalizer] = {}
        self._normalizers_lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path, backend: str = "auto", config: EngineConfig | None = None) -> CosyVoice:
        """Load an engines directory written by ``trt-cosy build`` (any family).

        Args:
            path: the engines directory (``manifest.json``, the graphs, ``tokenizer/``, ``campplus.onnx``,
                ``speakers.npz`` for the -SFT/-Instruct releases...).
            backend: ``"auto"`` (OpenVINO or mixed engines as built, any other on ONNX Runtime),
                ``"onnxruntime"`` (CPU), ``"openvino"`` (CPU; engines built with ``trt-cosy build
                --backend openvino``), ``"mixed"`` (CPU; the LLM on ONNX Runtime, the rest on OpenVINO:
                ``trt-cosy build --backend mixed``), or ``"trt"`` / ``"tensorrt"`` (the plans of an engines directory
                built with ``trt-cosy build --backend tensorrt``; NVIDIA GPU).
            config: load-time options (threads, default text normaliser).

        Raises:
            EngineMismatchError: the engines are missing, incomplete or stale; the message gives the
                ``trt-cosy build`` command to run.
            InputError: an unknown backend.
        """
        config = config or EngineConfig()
        names = _ORT_NAMES + _TRT_NAMES + _OV_NAMES + _MIXED_NAMES
        if backend not in names:
            raise InputError(f"unknown backend {backend!r}; use one of {', '.join(names)}.")
        from .models.v1.stages import load_speakers
        from .runtime.engines import SPEAKERS_NAME, TOKENIZER_DIR, load_engines
        from .runtime.manifest import Manifest

        path = Path(path)
        yamls = [name for name in YAML_BY_FAMILY.values() if (path / name).is_file()]
        if yamls and not (path / "manifest.json").is_file():
            raise EngineMismatchError(
                f"{path} is a release directory, not an engines directory. Build engines from it with "
                f"`trt-cosy build --model-dir {path} --out ENGINES` and load ENGINES, or run "
                f"`trt-cosy say --model-dir {path} ...` (it builds into the cache)."
            )
        engine_backend = _engine_backend(backend, path)
        model = load_engines(path, threads=config.threads, backend=engine_backend)
        family = model.config.family
        model_id = model_id_from_checkpoint(family, Manifest.read(path).checkpoint)
        tokenizer = families.load_text_tokenizer(family, path / TOKENIZER_DIR)
        builder = families.make_voice_builder(
            model,
            lambda name, graph: LazyOrtRunner(path / name, graph, config.threads, check_now=False),
            model_id,
        )
        speakers = load_speakers(path / SPEAKERS_NAME) if (path / SPEAKERS_NAME).is_file() else {}
        normalizer = _make_normalizer(config.normalizer, tokenizer)
        _LOGGER.info(
            "loaded %s (%s, normaliser %s, %d preset speakers) from %s",
            model_id,
            model.backend,
            normalizer.engine,
            len(speakers),
            path,
        )
        return cls(model, tokenizer, builder, normalizer, config, speakers)

    def __repr__(self) -> str:
        return (
            f"CosyVoice(model_id={self.model_id!r}, family={self.family!r}, "
            f"backend={getattr(self.model, 'backend', '?')!r}, sample_rate={self.sample_rate}, "
            f"speakers={len(self.speakers)})"
        )

    @property
    def sample_rate(self) -> int:
        """Output sample rate in Hz (24000 for CosyVoice2/3, 22050 for CosyVoice 1)."""
        return self.model.config.sample_rate

    @property
    def family(self) -> str:
        """``"v1"`` (CosyVoice-300M family), ``"v2"`` (CosyVoice2) or ``"v3"`` (Fun-CosyVoice3)."""
        return self.model.config.family

    @property
    def speakers(self) -> tuple[str, ...]:
        """Names of the model's preset speakers (CosyVoice-300M-SFT/-Instruct); empty for the others."""
        return tuple(self.speaker_embeddings)

    def preset_voice(self, name: str) -> Voice:
        """The preset speaker ``name`` as a voice: its embedding, no prompt (official SFT mode).

        Raises:
            InputError: the model has no speaker of that name (the message lists those it has).
        """
        embedding = self.speaker_embeddings.get(name)
        if embedding is None:
            if not self.speaker_embeddings:
                raise InputError(
                    f"voice must be a trt_cosy.Voice (from voice_from_wav or Voice.load) or the name of a "
                    f"preset speaker, got {name!r}; this model has no preset speakers (only the "
                    "CosyVoice-300M-SFT and -Instruct releases have them)."
                )
            raise InputError(f"unknown preset speaker {name!r}; this model has: {', '.join(self.speakers)}.")
        mels = self.model.config.mel.num_mels
        return Voice(
            prompt_text="",
            prompt_text_ids=np.zeros(0, np.int32),
            speech_tokens=np.zeros(0, np.int32),
            prompt_mel=np.zeros((0, mels), np.float32),
            speaker_embedding=embedding,
            sample_rate=self.sample_rate,
            model_id=self.model_id,
        )

    @property
    def model_id(self) -> str:
        """The id of the checkpoint these engines were built from (recorded in every voice made)."""
        return self.voice_builder.model_id

    def voice_from_wav(self, path: str | Path, text: str | None = None) -> Voice:
        """Make a voice from a reference recording (1–30 s of speech, any rate >= 16 kHz).

        Args:
            path: the recording.
            text: its transcript: zero-shot cloning. None (or blank): cross-lingual — the LLM gets no
                prompt text and no prompt speech tokens, only the flow uses the reference. For
                CosyVoice3 the system prompt and ``<|endofprompt|>`` go in front of the transcript
                (``families.prompt_text_for_voice``).

        Raises:
            InputError: unreadable, too short, too long or silent audio.
        """
        if text is not None:
            check_text(text, "the voice's transcript")
        if text is None or not text.strip():
            return self.voice_builder.from_wav(path)
        prompt_text = self.normalizer.normalize(families.prompt_text_for_voice(self.family, text))
        ids = np.asarray(self.tokenizer.encode(prompt_text), dtype=np.int32)  # ids: [Nt]
        return self.voice_builder.from_wav(path, prompt_text_ids=ids, prompt_text=prompt_text)

    def synthesize(
        self,
        text: str | Iterable[str] | TextStream,
        voice: Voice | str,
        seed: int | None = None,
        config: SynthesisConfig | None = None,
    ) -> Iterator[AudioChunk]:
        """Speak ``text`` in ``voice``: one ``AudioChunk`` per text segment, or several with
        ``config.stream`` (the official streaming schedule: first audio after ~1 s of speech).

        The text and voice are checked at once (``InputError`` with what to do); the models are
        lazy: nothing runs until you iterate, and closing the iterator stops the work (the LLM
        worker thread stops after its current token). Its ``cancel()`` may be called from another
        thread while a worker iterates: the iteration then ends at the next LLM step or chunk. One ``CosyVoice`` serves many threads at
        once; the same seed gives the same audio whatever else runs.

        Args:
            text: what to say; it is normalised, split into sentences and merged into segments as the
                official frontend does (``AudioChunk.segment`` / ``segments`` say where a chunk belongs).
                Or text still being written (CosyVoice2/3): an iterable of str pieces (pulled by the
                request's LLM thread as it needs text) or a ``TextStream`` you ``put`` pieces into;
                the official bistream decoding (``stages.bistream``): the speech starts after the first
                few words; the pieces are tokenised one by one, not normalised and not split (as the
                official code does with a text generator); one segment.
            voice: from ``voice_from_wav`` or ``Voice.load``, made for this model; or the name of a
                preset speaker (``speakers``; CosyVoice-300M-SFT/-Instruct).
            seed: the same seed gives the same audio; None draws fresh entropy.
            config: per-call options (``instruct``, ``stream``...); None for the defaults.
        """
        return CancellableChunks(self._request(text, voice, seed, config))

    async def asynthesize(
        self,
        text: str | Iterable[str] | AsyncIterable[str] | TextStream,
        voice: Voice | str,
        seed: int | None = None,
        config: SynthesisConfig | None = None,
    ) -> AsyncIterator[AudioChunk]:
        """``synthesize`` for asyncio: the same chunks, computed in a worker thread; ``text`` may also be
        an async iterable of str pieces (read by a task of this loop while the audio comes).

        The checks run at the first ``__anext__`` (``InputError``). Errors of the work are raised in
        the consumer; when the consumer stops iterating (``break``, ``aclose``) or its task is
        cancelled, the work is cancelled too (the LLM stops after its current token, a chunk being
        rendered is finished and dropped).
        """
        if isinstance(text, AsyncIterable):
            stream = TextStream(self.tokenizer.encode)
            request = self._request(stream, voice, seed, config)
            async with pump_async_text(text, stream):
                async for chunk in iterate_in_thread(request):
                    yield chunk
            return
        request = self._request(text, voice, seed, config)
        async for chunk in iterate_in_thread(request):
            yield chunk

    def _request(
        self,
        text: str | Iterable[str] | TextStream,
        voice: Voice | str,
        seed: int | None,
        config: SynthesisConfig | None,
    ) -> Request:
        """Check the inputs and plan the request (nothing runs yet)."""
        config = config or SynthesisConfig()
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise InputError(f"seed must be a non-negative integer or None, got {seed!r}.")
        if isinstance(voice, str):
            voice = self.preset_voice(voice)
        self._check_voice(voice)
        prompt = self.llm_prompt(voice, config.instruct)
        budget = families.speech_budget(self.model, voice)  # speech tokens the engines can render
        limit = self._segment_limit(voice, budget, config)
        stream = self._text_stream(text)
        if stream is None:
            split = None if config.text_frontend is False else self._normalizer_for(config.normalizer).split
            segments = plan_segments(text, split, self.tokenizer.encode, limit)  # type: ignore[arg-type]
        else:
            segments = [Segment("", np.zeros(0, np.int64))]  # streamed text: one segment, as officially
        request_class = families.request_class(self.family)
        schedules = family_named(self.family).stream_schedules
        if config.stream_schedule not in schedules:
            raise InputError(
                f"stream_schedule {config.stream_schedule!r} is not available for this model "
                f"({family_named(self.family).title}); use one of {', '.join(schedules)}."
            )
        request = request_class(
            self._stages,
            self.model.config,
            segments,
            voice,
            seed,
            config.stream,
            budget,
            prompt,
            schedule=config.stream_schedule,
        )
        request.speed = 1.0 if config.speed is None else float(config.speed)
        if stream is not None:
            family = family_named(self.family)
            request.bistream_prompt = family.bistream_prompt(
                self.model.config, prompt, self.tokenizer.token_to_id
            )
            request.text_stream = stream
        return request

    def _text_stream(self, text: object) -> TextStream | None:
        """None for a str; the ``TextStream`` of streamed text (checked: the family must take it)."""
        if isinstance(text, str):
            return None
        family = family_named(self.family)
        if not family.text_streaming:
            raise InputError(
                f"{family.title} cannot take text while it speaks (the official code streams text into "
                "CosyVoice2 and CosyVoice3 only); pass the whole text as one str."
            )
        if isinstance(text, TextStream):
            return text.claim()
        if isinstance(text, (bytes, bytearray)) or not isinstance(text, Iterable):
            raise InputError(
                f"text must be a str, an iterable of str pieces or a TextStream, got {type(text).__name__}."
            )
        return TextStream(self.tokenizer.encode, text).claim()

    def vc_voice_from_wav(self, path: str | Path) -> Voice:
        """The target voice of a voice conversion from a reference recording, as the official
        ``frontend_vc`` makes it (speech tokens and prompt mel not trimmed to each other; no transcript).

        Raises:
            InputError: unreadable, too short, too long or silent audio.
        """
        from .conversion import vc_voice

        return vc_voice(self.voice_builder, path)

    def convert(
        self,
        source: str | Path | tuple[np.ndarray, int] | Voice,
        voice: Voice | str,
        seed: int | None = None,
        config: SynthesisConfig | None = None,
        max_source_seconds: float | None = None,
    ) -> Iterator[AudioChunk]:
        """Voice conversion (official ``inference_vc``): the words, timing and intonation of
        ``source`` spoken in ``voice``; chunks as ``synthesize`` gives them (lazy, ``cancel()``).

        The source's speech tokens (the speech tokenizer) replace the LLM's output; the flow renders
        them with the voice's prompt tokens, prompt mel and speaker embedding, then the vocoder, on the
        streaming schedule of text-to-speech with ``config.stream``. A source longer than 30 s is cut
        at pauses into windows converted in order (``trt_cosy.conversion``; one ``segment`` each).

        Args:
            source: a recording (path), ``(samples, sample_rate)`` (any rate >= 8 kHz, [N] or
                [N, channels]), or a ``Voice`` (its reference's speech tokens).
            voice: the target: ``vc_voice_from_wav`` (the official VC prompt), a stored ``Voice``, or a
                preset speaker's name.
            seed: the vocoder noise's seed; None draws fresh entropy.
            config: ``stream``, ``stream_schedule`` and ``speed`` (not streaming, as officially) apply;
                ``instruct`` must stay unset.
            max_source_seconds: refuse longer sources (default ``conversion.MAX_SOURCE_SECONDS``).

        Raises:
            InputError: a bad source or voice (checked at once, before anything runs).
        """
        return CancellableChunks(self._conversion(source, voice, seed, config, max_source_seconds))

    async def aconvert(
        self,
        source: str | Path | tuple[np.ndarray, int] | Voice,
        voice: Voice | str,
        seed: int | None = None,
        config: SynthesisConfig | None = None,
        max_source_seconds: float | None = None,
    ) -> AsyncIterator[AudioChunk]:
        """``convert`` for asyncio: the same chunks, computed in a worker thread (see ``asynthesize``)."""
        request = self._conversion(source, voice, seed, config, max_source_seconds)
        async for chunk in iterate_in_thread(request):
            yield chunk

    def convert_to_file(
        self,
        source: str | Path | tuple[np.ndarray, int] | Voice,
        path: str | Path,
        voice: Voice | str,
        seed: int | None = None,
        config: SynthesisConfig | None = None,
    ) -> Path:
        """``convert`` into an audio file, written atomically (nothing left behind on error)."""
        return write_audio(self.convert(source, voice, seed, config), path, self.sample_rate)

    def _conversion(
        self,
        source: str | Path | tuple[np.ndarray, int] | Voice,
        voice: Voice | str,
        seed: int | None,
        config: SynthesisConfig | None,
        max_source_seconds: float | None,
    ) -> Request:
        """Check a conversion's inputs and plan it (the source is read, nothing is tokenised yet)."""
        from . import conversion

        config = config or SynthesisConfig()
        if config.instruct is not None:
            raise InputError("instruct does not apply to voice conversion; leave it unset.")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise InputError(f"seed must be a non-negative integer or None, got {seed!r}.")
        if isinstance(voice, str):
            voice = self.preset_voice(voice)
        cfg = self.model.config
        conversion.check_vc_voice(voice, self.sample_rate, cfg.mel.num_mels, cfg.flow.spk_embed_dim)
        if voice.model_id and self.model_id and voice.model_id != self.model_id:
            raise InputError(
                f"this voice was made for model {voice.model_id}, not for {self.model_id}; make it again "
                "with this model (`trt-cosy voices save` or CosyVoice.vc_voice_from_wav)."
            )
        if config.stream_schedule not in family_named(self.family).stream_schedules:
            raise InputError(f"stream_schedule {config.stream_schedule!r} is not available for this model.")
        budget = families.speech_budget(self.model, voice)  # tokens one window may have
        if isinstance(source, Voice):
            if source.model_id and self.model_id and source.model_id != self.model_id:
                raise InputError(
                    f"the source voice was made for model {source.model_id}, not for {self.model_id}: its "
                    "speech tokens mean nothing to this model. Pass the recording instead."
                )
            voice_tokens = np.asarray(source.speech_tokens, np.int64)  # [n]
            if voice_tokens.size == 0 or voice_tokens.size > budget:
                raise InputError(
                    f"the source voice has {voice_tokens.size} speech tokens; 1 to {budget} can be converted "
                    "(a preset speaker has none: pass a recording)."
                )
            windows, tokens_of = [None], lambda index: voice_tokens
            segments = [Segment("voice prompt", np.zeros(0, np.int64))]
        else:
            limit = conversion.MAX_SOURCE_SECONDS if max_source_seconds is None else max_source_seconds
            wav16k = conversion.read_source(source, limit)  # wav16k: [N]
            window_s = min(conversion.WINDOW_SECONDS, (budget - 2) / cfg.token_frame_rate)
            if window_s < 1.0:
                raise InputError("the voice's prompt leaves no room for speech; use a shorter reference.")
            shortest = min(conversion.MIN_WINDOW_SECONDS, window_s / 2)
            windows = conversion.pause_windows(wav16k, window_s, shortest)
            segments = conversion.window_segments(windows)

            def tokens_of(index: int) -> np.ndarray:
                window = windows[index]
                return self.voice_builder.speech_tokens(wav16k[window.start : window.end])[0].astype(np.int64)

        request_class = conversion.conversion_request_class(families.request_class(self.family))
        request = request_class(
            self._stages,
            cfg,
            segments,
            voice,
            seed,
            config.stream,
            budget,
            LLMPrompt(np.zeros(0, np.int64), np.zeros(0, np.int64)),
            schedule=config.stream_schedule,
        )
        request.attach_source(tokens_of, len(windows))
        request.speed = 1.0 if config.speed is None else float(config.speed)  # official inference_vc(speed=)
        return request

    def llm_prompt(self, voice: Voice, instruct: str | None = None) -> LLMPrompt:
        """What the LLM gets besides the text for ``voice`` and an optional instruction (spec §2.4).

        Zero-shot: the transcript and the prompt speech tokens; cross-lingual and preset speakers:
        neither (CosyVoice 1 adds the speaker row); an instruction replaces the transcript and drops
        the prompt speech (and, for CosyVoice 1, the speaker row). See ``trt_cosy.families``.
        """
        instruct_ids = None
        if instruct is not None:
            check_text(instruct, "instruct")
            text = families.instruct_text(self.family, instruct, self.normalizer.normalize)
            instruct_ids = np.asarray(self.tokenizer.encode(text), np.int64)  # [Ni]
        return families.llm_prompt_for(self.family, voice, instruct_ids, self.tokenizer.encode)

    def synthesize_to_file(
        self,
        text: str,
        path: str | Path,
        voice: Voice | str,
        seed: int | None = None,
        config: SynthesisConfig | None = None,
    ) -> Path:
        """Speak ``text`` into an audio file (WAV, or the format of the suffix), written atomically.

        On any error no new file is left behind and an existing ``path`` is untouched.
        """
        return write_audio(self.synthesize(text, voice, seed, config), path, self.sample_rate)

    def prepare_voice(self, voice: Voice) -> bool:
        """Precompute what a voice's first request would otherwise compute: the flow's prompt prefix
        (``FlowStage.prepare_voice``; engines with the incremental streaming graph). The voice's prompt
        features, speech tokens and embedding are in the ``Voice`` already. True when a prefix is kept
        (the server calls this when a voice is uploaded, ``POST /v1/voices``)."""
        self._check_voice(voice)
        flow = getattr(self._stages, "flow", None)
        if flow is None or not hasattr(flow, "prepare_voice"):
            return False
        return flow.prepare_voice(
            voice.speech_tokens.astype(np.int64)[None],  # [1, P], as pipeline.render_chunk passes it
            voice.prompt_mel[None],  # [1, 2P, 80]
            voice.speaker_embedding[None],  # [1, 192]
        )

    def _check_voice(self, voice: Voice) -> None:
        if not isinstance(voice, Voice):
            raise InputError(
                f"voice must be a trt_cosy.Voice (from voice_from_wav or Voice.load), got {type(voice).__name__}."
            )
        if voice.model_id and self.model_id and voice.model_id != self.model_id:
            raise InputError(
                f"this voice was made for model {voice.model_id}, not for {self.model_id}; make it again "
                "with this model (`trt-cosy voices save` or CosyVoice.voice_from_wav)."
            )
        families.check_voice(self.model, voice)

    def _segment_limit(self, voice: Voice, budget: int, config: SynthesisConfig) -> int:
        """The most text tokens of one segment whose longest speech (``max_token_text_ratio``) fits."""
        limit = int(budget // self.model.config.llm.max_token_text_ratio)
        if limit < 1:
            raise InputError(
                f"the voice's prompt ({voice.speech_tokens.shape[0]} speech tokens) leaves no room for "
                "speech in these engines; make the voice from a shorter reference (3-10 s)."
            )
        return limit if config.max_text_tokens is None else min(limit, config.max_text_tokens)

    def _normalizer_for(self, engine: str | None) -> TextNormalizer:
        if engine is None or engine == self.normalizer.engine:
            return self.normalizer
        with self._normalizers_lock:
            if engine not in self._normalizers:
                self._normalizers[engine] = TextNormalizer(engine, count_tokens=self.tokenizer.count_tokens)
            return self._normalizers[engine]

    @functools.cached_property
    def _stages(self):
        """The stateless stages of the family (``pipeline.Stages``, ``V1Stages``, ``V3Stages``)."""
        options = self.engine_config
        stages = families.build_stages(self.model, options.llm_slots, options.llm_slot_positions)
        scheduler = getattr(getattr(stages, "llm", None), "scheduler", None)  # the shared decode loop, if any
        if scheduler is not None:
            from .stages.llm_batch import DETERMINISTIC_DEFAULT

            scheduler.deterministic = DETERMINISTIC_DEFAULT if options.deterministic is None else options.deterministic
        return stages


def _make_normalizer(
    engine: str | None, tokenizer: QwenTextTokenizer | families.V1TextTokenizer
) -> TextNormalizer:
    """The engine's default normaliser; with no choice made, wetext when installed, else rules only."""
    if engine is not None:
        return TextNormalizer(engine, count_tokens=tokenizer.count_tokens)
    try:
        return TextNormalizer("wetext", count_tokens=tokenizer.count_tokens)
    except MissingDependencyError as exc:
        _LOGGER.warning("%s Numbers and dates will not be verbalised.", exc)
        return TextNormalizer("none", count_tokens=tokenizer.count_tokens)

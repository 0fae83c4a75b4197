"""Voices: the prompt features of a reference recording, made once and saved as one file.

``VoiceBuilder.from_wav`` runs the official zero-shot frontend (docs/cosyvoice-spec §2.5–2.8) on a
reference wav: the campplus speaker embedding, the speech tokens, the flow prompt mel and the
CosyVoice2 token/mel length alignment. ``Voice.save``/``Voice.load`` store the result as one ``.npz``
(a JSON header plus the arrays), so a voice costs nothing to reuse.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from ..audio import load_audio
from ..config import MelConfig
from ..errors import InputError
from ..runtime.backends.base import Runner
from .features import (
    SPEAKER_SAMPLE_RATE,
    align_prompt,
    flow_prompt_mel,
    speaker_features,
    whisper_log_mel,
)

__all__ = ["Voice", "VoiceBuilder", "VOICE_FORMAT_VERSION"]

_LOGGER = logging.getLogger(__name__)

VOICE_FORMAT: Final = "trt-cosy-voice"
VOICE_FORMAT_VERSION: Final = 1
MIN_REFERENCE_SECONDS: Final = 1.0
MAX_REFERENCE_SECONDS: Final = 30.0  # the official frontend asserts this before the speech tokenizer
SILENCE_PEAK: Final = 1e-4  # a reference whose absolute peak is below this is treated as silent
_TOKENIZER_MEL_BINS: Final = 128  # whisper log-mel bins of the v1/v2/v3 speech tokenizers
_ARRAY_DTYPES: Final = {
    "prompt_text_ids": np.int32,
    "speech_tokens": np.int32,
    "prompt_mel": np.float32,
    "speaker_embedding": np.float32,
}
_ARRAY_RANKS: Final = {"prompt_text_ids": 1, "speech_tokens": 1, "prompt_mel": 2, "speaker_embedding": 1}
_NOT_A_VOICE: Final = "is not a trt-cosy voice file; make one with `trt-cosy voices save`"


@dataclass(frozen=True, eq=False)
class Voice:
    """The prompt of a zero-shot voice, ready for the LLM and flow stages. Arrays are read-only.

    Attributes:
        prompt_text: the transcript of the reference recording ("" when unknown).
        prompt_text_ids: its text token ids, int32 [Nt] (empty when unknown).
        speech_tokens: the aligned prompt speech tokens, int32 [P].
        prompt_mel: the aligned flow prompt mel, float32 [token_mel_ratio * P, num_mels].
        speaker_embedding: the raw campplus embedding, float32 [192] (not normalised).
        sample_rate: the rate the prompt mel was computed at (the model output rate), Hz.
        model_id: the checkpoint family/hash the voice was made for ("" when not recorded).
    """

    prompt_text: str
    prompt_text_ids: np.ndarray
    speech_tokens: np.ndarray
    prompt_mel: np.ndarray
    speaker_embedding: np.ndarray
    sample_rate: int
    model_id: str = ""

    def __post_init__(self) -> None:
        for key, dtype in _ARRAY_DTYPES.items():
            array = np.array(getattr(self, key), dtype=dtype)  # a private copy
            if array.ndim != _ARRAY_RANKS[key]:
                raise InputError(
                    f"voice field {key} must have {_ARRAY_RANKS[key]} dimension(s), got shape "
                    f"{array.shape}. Make the voice again with `trt-cosy voices save`."
                )
            array.setflags(write=False)
            object.__setattr__(self, key, array)
        object.__setattr__(self, "sample_rate", int(self.sample_rate))
        object.__setattr__(self, "prompt_text", str(self.prompt_text))
        object.__setattr__(self, "model_id", str(self.model_id))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Voice):
            return NotImplemented
        scalars = ("prompt_text", "sample_rate", "model_id")
        return all(getattr(self, key) == getattr(other, key) for key in scalars) and all(
            np.array_equal(getattr(self, key), getattr(other, key)) for key in _ARRAY_DTYPES
        )

    __hash__ = None  # type: ignore[assignment]  # holds arrays

    def __repr__(self) -> str:
        """One line: mode, transcript, prompt length and model (never the arrays)."""
        tokens = self.speech_tokens.shape[0]
        mode = "zero-shot" if self.prompt_text_ids.size else "cross-lingual" if tokens else "preset speaker"
        text = self.prompt_text if len(self.prompt_text) <= 40 else self.prompt_text[:37] + "..."
        return (
            f"Voice({mode}, prompt_text={text!r}, {tokens} prompt tokens, "
            f"{self.prompt_mel.shape[0]} mel frames at {self.sample_rate} Hz, model_id={self.model_id!r})"
        )

    def save(self, path: str | Path) -> Path:
        """Write the voice to ``path`` as one ``.npz``, atomically (temp file + rename). Returns the path."""
        path = Path(path)
        if not path.parent.is_dir():
            raise InputError(
                f"cannot save the voice to {path}: folder {path.parent} does not exist. Create it first."
            )
        header = {
            "format": VOICE_FORMAT,
            "version": VOICE_FORMAT_VERSION,
            "prompt_text": self.prompt_text,
            "sample_rate": self.sample_rate,
            "model_id": self.model_id,
        }
        arrays = {key: getattr(self, key) for key in _ARRAY_DTYPES}
        handle, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(handle, "wb") as stream:
                np.savez(stream, header=np.array(json.dumps(header, ensure_ascii=False)), **arrays)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temp_name, path)
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise
        _LOGGER.debug("saved voice to %s (%d prompt tokens)", path, self.speech_tokens.shape[0])
        return path

    @classmethod
    def load(cls, path: str | Path) -> Voice:
        """Read a voice written by ``save``.

        Raises:
            InputError: the file is missing, is not a voice file, or was written by a newer trt-cosy.
        """
        path = Path(path)
        if not path.is_file():
            raise InputError(f"voice file {path} does not exist. Make one with `trt-cosy voices save`.")
        try:
            with np.load(path, allow_pickle=False) as archive:
                header = json.loads(str(archive["header"][()]))
                arrays = {key: archive[key] for key in _ARRAY_DTYPES}
        except (OSError, ValueError, KeyError, AttributeError, TypeError, zipfile.BadZipFile) as exc:
            # np.load returns a bare array for .npy files (no context manager: AttributeError/TypeError).
            # numpy's own words for pickled content suggest allow_pickle=True, which runs code: never.
            detail = (
                "it holds pickled Python objects, which trt-cosy never loads"
                if "pickle" in str(exc)
                else f"{type(exc).__name__}: {exc}"
            )
            raise InputError(f"{path} {_NOT_A_VOICE} ({detail}).") from exc
        return cls._from_parts(path, header, arrays)

    @classmethod
    def _from_parts(cls, path: Path, header: Any, arrays: dict[str, np.ndarray]) -> Voice:
        if not isinstance(header, dict) or header.get("format") != VOICE_FORMAT:
            raise InputError(f"{path} {_NOT_A_VOICE} (its header has no trt-cosy voice format tag).")
        version = header.get("version")
        if not isinstance(version, int) or version > VOICE_FORMAT_VERSION:
            raise InputError(
                f"{path} is voice format version {version}; this trt-cosy reads up to "
                f"{VOICE_FORMAT_VERSION}. Upgrade trt-cosy or make the voice again with `trt-cosy voices save`."
            )
        try:
            return cls(
                prompt_text=header["prompt_text"],
                sample_rate=header["sample_rate"],
                model_id=header.get("model_id", ""),
                **arrays,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{path} {_NOT_A_VOICE} (bad field: {exc!r}).") from exc


class VoiceBuilder:
    """Makes ``Voice`` objects from reference recordings with the official frontend steps.

    Args:
        campplus: the speaker model (``campplus.onnx``): fbank [1, T, 80] -> embedding [1, 192].
        speech_tokenizer: the speech tokenizer (``speech_tokenizer_v2.onnx``): whisper log-mel
            [1, 128, T] and its length [1] -> tokens [1, T']. Inputs are taken by position, as the
            official frontend does.
        mel_config: the model's prompt mel settings (``ModelConfig.mel``).
        token_mel_ratio: mel frames per speech token (``ModelConfig.token_mel_ratio``).
        model_id: recorded in every voice made (the checkpoint family/hash).
    """

    def __init__(
        self,
        campplus: Runner,
        speech_tokenizer: Runner,
        mel_config: MelConfig,
        token_mel_ratio: int = 2,
        *,
        model_id: str = "",
    ):
        self.campplus = campplus
        self.speech_tokenizer = speech_tokenizer
        self.mel_config = mel_config
        self.token_mel_ratio = token_mel_ratio
        self.model_id = model_id

    def from_wav(
        self, path: str | Path, prompt_text_ids: np.ndarray | None = None, prompt_text: str = ""
    ) -> Voice:
        """Build the voice of the reference recording at ``path`` (1–30 s of speech, any rate >= 16 kHz).

        Raises:
            InputError: the file is unreadable, shorter than 1 s, longer than 30 s, or silent.
        """
        wav16k = load_audio(path, SPEAKER_SAMPLE_RATE)  # wav16k: [N16]
        _check_reference(path, wav16k)
        embedding = self.speaker_embedding(wav16k)  # embedding: [192]
        tokens = self.speech_tokens(wav16k)  # tokens: [1, n]
        wav_model = load_audio(path, self.mel_config.sampling_rate)  # wav_model: [N]
        mel = flow_prompt_mel(wav_model, self.mel_config)  # mel: [1, T, num_mels]
        tokens, mel = self._pair_prompt(tokens, mel)  # [1, P], [1, T_P, num_mels]
        if tokens.shape[1] == 0:
            raise InputError(
                f"reference audio {path} gave no speech tokens. Use a recording of 3-10 s of clear speech."
            )
        ids = np.zeros(0, np.int32) if prompt_text_ids is None else np.asarray(prompt_text_ids).reshape(-1)
        _LOGGER.debug("voice from %s: %d tokens, %d mel frames", path, tokens.shape[1], mel.shape[1])
        return Voice(
            prompt_text=prompt_text,
            prompt_text_ids=ids,
            speech_tokens=tokens[0],
            prompt_mel=mel[0],
            speaker_embedding=embedding,
            sample_rate=self.mel_config.sampling_rate,
            model_id=self.model_id,
        )

    def _pair_prompt(self, tokens: np.ndarray, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Trim the prompt tokens [1, n] and mel [1, T, num_mels] to each other (``align_prompt``)."""
        return align_prompt(tokens, mel, self.token_mel_ratio)  # [1, P], [1, ratio * P, num_mels]

    def speaker_embedding(self, wav16k: np.ndarray) -> np.ndarray:
        """campplus on the mean-normalised Kaldi fbank (spec §2.5): float32 [D] (192 for campplus)."""
        features = speaker_features(wav16k)  # features: [1, T, 80]
        outputs = self.campplus.infer({self.campplus.input_names[0]: features})
        return np.asarray(outputs[self.campplus.output_names[0]], dtype=np.float32).reshape(-1)  # [192]

    def speech_tokens(self, wav16k: np.ndarray) -> np.ndarray:
        """The speech tokenizer on the whisper log-mel (spec §2.6): int32 [1, n]."""
        feats = whisper_log_mel(wav16k, _TOKENIZER_MEL_BINS)  # feats: [1, 128, T]
        feats_name, length_name = self.speech_tokenizer.input_names[:2]
        feed = {feats_name: feats, length_name: np.array([feats.shape[2]], dtype=np.int32)}  # length: [1]
        outputs = self.speech_tokenizer.infer(feed)
        indices = outputs[self.speech_tokenizer.output_names[0]]  # indices: [1, T']
        return np.asarray(indices).astype(np.int32).reshape(1, -1)  # tokens: [1, n]


def _check_reference(path: str | Path, wav16k: np.ndarray) -> None:
    """Reject references the official frontend cannot use or that make a useless voice."""
    seconds = wav16k.shape[0] / SPEAKER_SAMPLE_RATE
    if seconds < MIN_REFERENCE_SECONDS:
        raise InputError(
            f"reference audio {path} is {seconds:.2f} s long; at least {MIN_REFERENCE_SECONDS:g} s is "
            "needed. Use a recording of 3-10 s of clear speech."
        )
    if seconds > MAX_REFERENCE_SECONDS:
        raise InputError(
            f"reference audio {path} is {seconds:.1f} s long; the speech tokenizer accepts at most "
            f"{MAX_REFERENCE_SECONDS:g} s. Trim it to 3-10 s of clear speech."
        )
    peak = float(np.max(np.abs(wav16k)))
    if peak < SILENCE_PEAK:
        raise InputError(
            f"reference audio {path} is silent (peak {peak:.2g}). Use a recording of 3-10 s of clear speech."
        )

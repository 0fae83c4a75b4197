"""The tiny ONNX Runtime CosyVoice of the streaming and concurrency tests, and runners that count (and
block or fail) their ``infer`` calls (test_streaming, test_concurrency, test_llm_batch)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from _support import REF_TEXT, reference_wavs, tiny_engines

from trt_cosy import CosyVoice, EngineConfig

TEXT_60 = "Hi."  # 3 text tokens -> 60 speech tokens


class CountingRunner:
    """Counts ``infer`` calls; optionally blocks call number ``block_at`` until ``release`` is set."""

    def __init__(self, inner, block_at: int | None = None, fail_at: int | None = None):
        self.inner, self.name = inner, inner.name
        self.calls = 0
        self.block_at, self.fail_at = block_at, fail_at
        self.blocked, self.release = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    @property
    def input_names(self):
        return self.inner.input_names

    @property
    def output_names(self):
        return self.inner.output_names

    def infer(self, feed):
        with self._lock:
            self.calls += 1
            call = self.calls
        if call == self.block_at:
            self.blocked.set()
            self.release.wait(60)
        if call == self.fail_at:
            raise RuntimeError(f"{self.name} failed at call {call}")
        return self.inner.infer(feed)


def with_runners(tts: CosyVoice, **wrappers) -> CosyVoice:
    """A CosyVoice on the same engines with some runners replaced (``name=runner``)."""
    model = dataclasses.replace(tts.model, runners={**tts.model.runners, **wrappers})
    return CosyVoice(model, tts.tokenizer, tts.voice_builder, tts.normalizer, tts.engine_config)


def counting(tts: CosyVoice, **options) -> tuple[CosyVoice, dict[str, CountingRunner]]:
    counters = {
        name: CountingRunner(runner, **options.get(name, {})) for name, runner in tts.model.runners.items()
    }
    return with_runners(tts, **counters), counters


def llm_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "trt-cosy-llm" and thread.is_alive()]


def load_tiny_ort(factory: pytest.TempPathFactory, golden_dir) -> CosyVoice:
    """CosyVoice on the tiny ORT engines (built once per session), one thread per graph."""
    return CosyVoice.load(tiny_engines(factory, golden_dir), config=EngineConfig(threads=1))


def make_tiny_voice(tts: CosyVoice, factory: pytest.TempPathFactory):
    """A zero-shot voice from a 1.5 s reference: 37 prompt tokens, so the first hop is 25 + 13."""
    wavs = reference_wavs(factory.mktemp("stream-wavs"))
    return tts.voice_from_wav(wavs["ref"], REF_TEXT)

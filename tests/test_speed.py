"""``speed`` as the official code does it: each segment's mel stretched in time (torch ``F.interpolate``,
linear) before the vocoder, non-streaming only."""

from __future__ import annotations

import numpy as np
import pytest
from _support import reference_wavs, tiny_engines

from trt_cosy import CosyVoice, EngineConfig, SynthesisConfig
from trt_cosy.errors import InputError
from trt_cosy.stages.speed import stretch_mel


@pytest.mark.parametrize("speed", (0.25, 0.5, 0.8, 1.25, 2.0, 3.3, 4.0))
@pytest.mark.parametrize("frames", (1, 7, 50, 333, 1200))
def test_stretch_mel_is_the_official_interpolation(speed, frames):
    """The official call, ``F.interpolate(tts_mel, size=int(F / speed), mode='linear')``, run by torch."""
    torch = pytest.importorskip("torch")
    if int(frames / speed) == 0:
        pytest.skip("torch refuses an empty output; the engine keeps one frame")
    mel = np.random.default_rng(frames).standard_normal((1, 80, frames)).astype(np.float32)  # [1, 80, F]
    official = torch.nn.functional.interpolate(torch.from_numpy(mel), size=int(frames / speed), mode="linear")
    stretched = stretch_mel(mel, speed)
    assert stretched.shape == tuple(official.shape) and stretched.dtype == np.float32
    # torch rounds the source positions to float32 (6e-5 of a frame at frame 1000); here they are float64.
    np.testing.assert_allclose(stretched, official.numpy(), rtol=0, atol=2e-3)


def test_stretch_mel_keeps_speed_one_and_one_frame():
    mel = np.ones((1, 80, 3), np.float32)
    assert stretch_mel(mel, 1.0) is mel
    assert stretch_mel(mel, 4.0).shape == (1, 80, 1)


@pytest.fixture(scope="module")
def engine_and_voice(tmp_path_factory, v2_tiny_dir):
    tts = CosyVoice.load(tiny_engines(tmp_path_factory, v2_tiny_dir), config=EngineConfig(threads=1))
    wavs = reference_wavs(tmp_path_factory.mktemp("speed-wavs"))
    return tts, tts.voice_from_wav(wavs["ref"], "Hello, this is me.")


@pytest.mark.slow
def test_speed_stretches_each_segment_before_the_vocoder(engine_and_voice):
    tts, voice = engine_and_voice
    text = "Good morning. How are you today?"
    runs = {}
    for speed in (1.0, 0.5, 2.0):
        chunks = list(tts.synthesize(text, voice, seed=4, config=SynthesisConfig(speed=speed)))
        runs[speed] = chunks
    hop = 480  # samples per mel frame at 24 kHz (HiFT)
    for speed in (0.5, 2.0):
        assert len(runs[speed]) == len(runs[1.0])  # one chunk per segment, as at speed 1
        for plain, fast in zip(runs[1.0], runs[speed], strict=True):
            assert fast.timings["tokens"] == plain.timings["tokens"]  # the same speech tokens (same seed)
            frames = plain.samples.shape[0] // hop
            assert plain.samples.shape[0] == frames * hop
            assert fast.samples.shape[0] == int(frames / speed) * hop, (speed, frames, fast.samples.shape)
            assert np.isfinite(fast.samples).all() and np.abs(fast.samples).max() > 0


def test_speed_needs_the_non_streaming_schedule():
    with pytest.raises(InputError, match="only without stream"):
        SynthesisConfig(speed=2.0, stream=True)
    with pytest.raises(InputError, match="between 0.25 and 4.0"):
        SynthesisConfig(speed=0.1)

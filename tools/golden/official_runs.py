"""Drive the official model's ``tts()`` with reproducible random draws and record what it did
(golden-making scripts only; run with /work/official-venv, see official_env.py).

Random draws. The official CosyVoice 1 flow (``randn_like`` start noise) and the CosyVoice 1/2 HiFT
(``torch.rand`` phases, ``randn_like`` sine and source noise) draw from torch's global RNG, which no
ONNX/TensorRT graph can reproduce. Inside ``Draws`` every ``torch.rand`` / ``torch.randn_like`` call
(including the one inside ``torch.distributions.Uniform.sample``) returns instead draw number ``i`` of
``numpy.random.default_rng([seed, i])`` (``.random(shape, float32)`` / ``.standard_normal(shape,
float32)``), and the call is logged as ``[chunk, "rand" | "randn", shape]``. A golden stores only that
log; a test (or ``trt-cosy verify``) regenerates the values with ``trt_cosy.verify.official_draws`` and feeds
them to trt-cosy. CosyVoice 3 draws nothing at inference: its noise buffers, drawn at construction, are
rounded to float16 as in the golden set (README §8.3), and must equal the golden ``reference.npz``'s.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def _load_draw_values():
    """``trt_cosy.verify.official_draws.draw_values``, loaded by path (trt_cosy is not installed here)."""
    path = Path(__file__).resolve().parents[2] / "trt_cosy" / "verify" / "official_draws.py"
    spec = importlib.util.spec_from_file_location("official_draws", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.draw_values


draw_values = _load_draw_values()  # the tests and `trt-cosy verify` regenerate the draws with it

DRAW_SEED = 20261205


@dataclass
class Draws:
    """Reproducible stand-ins for torch's global RNG while the official ``tts()`` runs."""

    seed: int = DRAW_SEED
    chunk: int = -1  # the official token2wav call the draw belongs to
    log: list = field(default_factory=list)

    def _next(self, kind: str, shape, like=None):
        import torch

        values = draw_values(self.seed, len(self.log), kind, shape)
        self.log.append([self.chunk, kind, [int(size) for size in shape]])
        tensor = torch.from_numpy(values)
        return tensor.to(like.dtype) if like is not None else tensor

    @contextlib.contextmanager
    def installed(self):
        import torch

        real_rand, real_randn_like = torch.rand, torch.randn_like

        def rand(*size, **kwargs):
            shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            return self._next("rand", shape).to(kwargs.get("dtype") or torch.float32)

        def randn_like(tensor, **kwargs):
            return self._next("randn", tensor.shape, tensor)

        torch.rand, torch.randn_like = rand, randn_like
        try:
            yield self
        finally:
            torch.rand, torch.randn_like = real_rand, real_randn_like


@dataclass
class Recording:
    """What one official ``tts()`` run did: its inputs, each token2wav call, each flow mel, the audio."""

    model_input: dict = field(default_factory=dict)
    calls: list = field(
        default_factory=list
    )  # per token2wav: {"tokens", "token_offset", "finalize", "stream"}
    flow_mels: list = field(default_factory=list)  # per call: the flow output [1, 80, F] (numpy)
    chunks: list = field(default_factory=list)  # yielded tts_speech [N] (numpy)

    @property
    def wav(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)


@contextlib.contextmanager
def recording(cosy, draws: Draws):
    """Record the official model's ``tts`` inputs, token2wav calls and flow outputs while in the block."""
    import torch

    model, record = cosy.model, Recording()
    real_tts, real_token2wav, real_flow = model.tts, model.token2wav, model.flow.inference

    def tts(**kwargs):
        record.model_input = {
            key: value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
            for key, value in kwargs.items()
        }
        yield from real_tts(**kwargs)

    def token2wav(*args, **kwargs):
        draws.chunk += 1
        token = kwargs["token"] if "token" in kwargs else args[0]
        record.calls.append(
            {
                "tokens": int(token.shape[1]),
                "token_offset": int(kwargs.get("token_offset", 0)),
                "finalize": bool(kwargs.get("finalize", False)),
                "stream": bool(kwargs.get("stream", False)),
            }
        )
        return real_token2wav(*args, **kwargs)

    def flow_inference(*args, **kwargs):
        mel, cache = real_flow(*args, **kwargs)
        record.flow_mels.append(mel.detach().cpu().numpy().astype(np.float32))
        return mel, cache

    model.tts, model.token2wav, model.flow.inference = tts, token2wav, flow_inference
    try:
        with draws.installed():
            yield record
    finally:
        model.tts, model.token2wav, model.flow.inference = real_tts, real_token2wav, real_flow


def run_official(cosy, call, draws: Draws, stream: bool) -> Recording:
    """``call(stream)`` is an official ``inference_*`` generator; its chunks are recorded."""
    if hasattr(cosy.model, "token_hop_len") and cosy.model.__class__.__name__ != "CosyVoiceModel":
        cosy.model.token_hop_len = 25  # official tts() grows it and never resets it: a fresh load's value
    with recording(cosy, draws) as record:
        for output in call(stream):
            record.chunks.append(output["tts_speech"].detach().cpu().numpy()[0].astype(np.float32))
    return record


def round_v3_buffers(cosy) -> None:
    """Golden README §8.3: the v3 HiFT noise buffers rounded to float16 before any run."""
    sine = cosy.model.hift.m_source.l_sin_gen
    sine.sine_waves = sine.sine_waves.half().float()
    sine.rand_ini = sine.rand_ini.half().float()
    cosy.model.hift.m_source.uv = cosy.model.hift.m_source.uv.half().float()


def pcm16(wav: np.ndarray) -> np.ndarray:
    """Samples in [-1, 1] as int16 steps of 2^-15 (error <= 1.6e-5, far below the 1e-3 tolerance)."""
    return np.clip(np.round(wav.astype(np.float64) * 32768.0), -32768, 32767).astype(np.int16)

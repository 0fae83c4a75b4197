"""Where a render's memory goes: the working memory of the flow and of the vocoder for one chunk of
N speech tokens, and what the LLM's caches reserve, per stage, in one process.

    python tools/experiments/memory/memory_stages.py --engines /work/fullsize/int4-030 --tokens 400 800 1600

Works for CosyVoice2 and CosyVoice3 engines (v3: the causal HiFT on its fixed noise buffer).

For each N (random speech tokens, the voice of tools/experiments/memory/memory_load.py as prompt) the flow runs
non-streaming on prompt + N tokens, then the vocoder on its mel frames; each stage's cost is its
peak RSS (VmHWM, reset through /proc/self/clear_refs) minus the RSS before it. ONNX Runtime's arena
is shrunk after every run (``TRT_COSY_ARENA_SHRINK=all`` inside a run scope), so each size starts
from the same level. The LLM's caches are sized from the model config: what one request's KV cache
holds per position, and what the batched decoder's slots reserve. Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from trt_cosy import CosyVoice
from trt_cosy.models.v3.stages import V3VocoderStage
from trt_cosy.runtime.heap import return_large_blocks
from trt_cosy.runtime.run_scope import RunScope
from trt_cosy.stages.llm_batch import DEFAULT_POSITIONS, DEFAULT_SLOTS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_load import make_voice, reset_peak, status_mib  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", required=True)
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[400, 800, 1600], help="speech tokens per render"
    )
    args = parser.parse_args(argv)
    os.environ["TRT_COSY_ARENA_SHRINK"] = "all"
    return_large_blocks()
    tts = CosyVoice.load(args.engines)
    voice = make_voice(tts)
    stages = tts._stages
    config = tts.model.config
    qwen = config.llm.qwen
    per_position = qwen.num_layers * 2 * qwen.num_kv_heads * qwen.head_dim * 4  # keys + values, fp32
    print(
        f"LLM KV cache: {per_position / 1024:.1f} KiB per position ({qwen.num_layers} layers x "
        f"{qwen.num_kv_heads} KV heads x {qwen.head_dim}); batched slots {DEFAULT_SLOTS} x "
        f"{DEFAULT_POSITIONS} positions reserve {DEFAULT_SLOTS * DEFAULT_POSITIONS * per_position / 2**20:.0f} MiB"
    )
    prompt_tokens = voice.speech_tokens.astype(np.int64)[None]  # [1, P]
    rng = np.random.default_rng(0)
    scope = RunScope()
    print(f"loaded: RSS {status_mib('VmRSS'):.0f} MiB; prompt {prompt_tokens.shape[1]} speech tokens")
    for count in args.tokens:
        tokens = rng.integers(0, config.flow.vocab_size, (1, count), dtype=np.int64)  # [1, N]
        with scope.active():
            before = status_mib("VmRSS")
            reset_peak()
            started = time.perf_counter()
            mel = stages.flow.token2mel(
                tokens,
                prompt_tokens,
                voice.prompt_mel[None],  # [1, 2P, 80]
                voice.speaker_embedding[None],  # [1, 192]
                streaming=False,
                finalize=True,
            ).mel  # [1, 80, 2N]
            flow_s, flow_peak = time.perf_counter() - started, status_mib("VmHWM")
            between = status_mib("VmRSS")
            reset_peak()
            started = time.perf_counter()
            samples = _vocode(stages.vocoder, mel)
            hift_s, hift_peak = time.perf_counter() - started, status_mib("VmHWM")
        print(
            f"{count} tokens ({mel.shape[2]} mel frames, {samples.size / config.sample_rate:.1f} s): "
            f"flow +{flow_peak - before:.0f} MiB over {before:.0f} ({flow_s:.1f} s), "
            f"vocoder +{hift_peak - between:.0f} MiB over {between:.0f} ({hift_s:.1f} s); "
            f"after {status_mib('VmRSS'):.0f} MiB",
            flush=True,
        )
        del mel, samples
    return 0


def _vocode(vocoder, mel: np.ndarray) -> np.ndarray:
    """One final, one-shot vocoder call on ``mel`` [1, 80, F]: the samples [N]."""
    if isinstance(vocoder, V3VocoderStage):  # CosyVoice3: the fixed NSF noise buffer, no rng
        return vocoder.render(mel, final=True)[0]
    return vocoder.render(mel, np.random.default_rng(0), None, final=True)[0]


if __name__ == "__main__":
    sys.exit(main())

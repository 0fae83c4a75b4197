"""LiveKit Agents' OpenAI TTS plugin against a running ``trt-cosy serve``, with the plugin's defaults (mp3,
``stream_format: "sse"`` since the model is not tts-1): prints when the first audio arrives.

    trt-cosy serve --engines ENGINES            # and a stored voice, e.g. "fox" (POST /v1/voices)
    pip install -r examples/agents/requirements.txt
    python examples/agents/livekit_tts.py --url http://127.0.0.1:8000 --voice fox "Hello from LiveKit."
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def speak(url: str, voice: str, text: str) -> None:
    from livekit.plugins import openai

    tts = openai.TTS(base_url=url.rstrip("/") + "/v1", api_key="unused", model="cosyvoice2", voice=voice)
    started, first, samples = time.perf_counter(), None, 0
    async for event in tts.synthesize(text):
        first = first if first is not None else time.perf_counter() - started
        samples += event.frame.samples_per_channel
    await tts.aclose()
    print(f"first audio after {first:.2f} s; {samples / 24000:.1f} s of audio in {time.perf_counter() - started:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description="LiveKit's OpenAI TTS plugin against trt-cosy serve")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--voice", required=True, help="a stored voice (or an OpenAI name with --default-voice)")
    parser.add_argument("text")
    args = parser.parse_args()
    asyncio.run(speak(args.url, args.voice, args.text))


if __name__ == "__main__":
    main()

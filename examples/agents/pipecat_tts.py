"""Pipecat's ``OpenAITTSService`` against a running ``trt-cosy serve``. Pipecat accepts only OpenAI's voice
names, so start the server with ``--default-voice NAME`` (or ``--voice-alias alloy=NAME``).

    trt-cosy serve --engines ENGINES --default-voice fox
    pip install -r examples/agents/requirements.txt
    python examples/agents/pipecat_tts.py --url http://127.0.0.1:8000 "Hello from Pipecat."

``run_tts`` is driven directly here (no pipeline around it), which is all a TTS service does per sentence.
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def speak(url: str, voice: str, text: str) -> None:
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame
    from pipecat.services.openai.tts import OpenAITTSService

    service = OpenAITTSService(
        api_key="unused", base_url=url.rstrip("/") + "/v1", settings=OpenAITTSService.Settings(voice=voice)
    )
    service._sample_rate = 24000  # what its StartFrame would set inside a pipeline
    started, first, size = time.perf_counter(), None, 0
    async for frame in service.run_tts(text, "example"):
        if isinstance(frame, TTSAudioRawFrame):
            first = first if first is not None else time.perf_counter() - started
            size += len(frame.audio)
        elif isinstance(frame, ErrorFrame):
            raise SystemExit(frame.error)
    print(f"first audio after {first:.2f} s; {size / 48000:.1f} s of pcm in {time.perf_counter() - started:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description="Pipecat's OpenAI TTS service against trt-cosy serve")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--voice", default="alloy", help="one of OpenAI's names (the server maps it)")
    parser.add_argument("text")
    args = parser.parse_args()
    asyncio.run(speak(args.url, args.voice, args.text))


if __name__ == "__main__":
    main()

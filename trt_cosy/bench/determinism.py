"""The determinism soak of the speech server: a seed's audio must not depend on the load.

A real server (uvicorn on a free 127.0.0.1 port, ``server.ThreadedServer``) over one ``CosyVoice``
whose shared decode loop has one KV slot per concurrent synthesis. Every (text, seed) case is first
requested alone: twice whole as a WAV file (the two must carry the same samples: the case's
reference) and streamed twice, as raw PCM and as WAV (the same samples: the streamed reference; the
streaming schedule renders other audio than one whole call). Then ``requests`` requests, cases and streamed/not drawn at random
(seeded), are sent ``concurrency`` at a time, and every answer is compared sample for sample with
its reference; an answer that differs is checked against every other case's reference (cross-talk).

    python bench/determinism_soak.py --engines ENGINES --requests 1000 --concurrency 8

tests/test_server_determinism.py runs a bounded version on the tiny int4 engines.
"""

from __future__ import annotations

import io
import random
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["SoakReport", "TEXTS", "run_soak", "soak_server"]

TEXTS = (
    "Hi.",
    "Hello there.",
    "Good day.",
    "Hi there.",
    "See you soon.",
    "Thank you.",
    "Good morning.",
    "Well done.",
)
SPEECH = "/v1/audio/speech"


@dataclass
class SoakReport:
    """What a soak saw (``ok``: every answer 200 and equal to its reference)."""

    cases: int = 0
    requests: int = 0
    equal: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    differing: list[dict] = field(default_factory=list)  # case, stream, length, first differing sample
    cross_talk: int = 0  # answers equal to another case's reference
    alone_mismatch: list[str] = field(default_factory=list)  # cases whose alone answers disagree
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.alone_mismatch and self.equal == self.requests

    def summary(self) -> str:
        lines = [
            f"{self.cases} cases alone: {'all consistent' if not self.alone_mismatch else self.alone_mismatch}",
            f"{self.requests} requests in {self.seconds:.1f} s: statuses {self.statuses}, "
            f"{self.equal} equal to their alone reference, {len(self.differing)} differ, {self.cross_talk} cross-talk",
        ]
        lines += [f"  differs: {item}" for item in self.differing[:10]]
        return "\n".join(lines)


def _samples(payload: bytes, stream: bool) -> np.ndarray:
    """The int16 samples of a raw PCM body (``stream``) or a WAV file."""
    if stream:
        return np.frombuffer(payload, np.int16)
    import soundfile

    samples, _ = soundfile.read(io.BytesIO(payload), dtype="int16")
    return samples


def run_soak(
    url: str,
    voice: str,
    requests: int,
    concurrency: int,
    texts: Sequence[str] = TEXTS,
    seeds: Sequence[int] = (1, 2),
    shuffle_seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> SoakReport:
    """Run the soak against a server at ``url`` (loopback) holding ``voice``; see the module doc."""
    import httpx

    report = SoakReport()
    cases = [(text, seed) for text in texts for seed in seeds]
    report.cases = len(cases)

    def ask(client: httpx.Client, case: tuple[str, int], stream: bool, form: str | None = None) -> tuple[int, np.ndarray]:
        form = form or ("pcm" if stream else "wav")
        body = {"model": "tts-1", "input": case[0], "voice": voice, "seed": case[1], "stream": stream,
                "response_format": form}  # fmt: skip
        response = client.post(url + SPEECH, json=body, timeout=600)
        if response.status_code != 200:
            return response.status_code, np.zeros(0, np.int16)
        return 200, _samples(response.content, form == "pcm")

    references: dict[tuple[tuple[str, int], bool], np.ndarray] = {}  # (case, streamed) -> samples
    with httpx.Client() as client:
        _wait_ready(client, url)
        for case in cases:
            whole = [ask(client, case, False) for _ in range(2)]  # WAV files, twice
            streamed = [ask(client, case, True), ask(client, case, True, "wav")]  # PCM, then WAV, streamed
            if any(status != 200 for status, _ in whole + streamed):
                report.alone_mismatch.append(f"{case}: statuses {[status for status, _ in whole + streamed]}")
                continue
            if not np.array_equal(whole[0][1], whole[1][1]):
                report.alone_mismatch.append(f"{case}: two WAV answers alone differ")
            if not np.array_equal(streamed[0][1], streamed[1][1]):
                report.alone_mismatch.append(f"{case}: streamed PCM and streamed WAV alone differ")
            references[case, False], references[case, True] = whole[0][1], streamed[0][1]
    if progress:
        progress(f"{len(references)} references made")
    draws = random.Random(shuffle_seed)
    plan = [(cases[draws.randrange(len(cases))], draws.random() < 0.5) for _ in range(requests)]
    local, lock = threading.local(), threading.Lock()

    def one(number: int) -> None:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client()
        case, stream = plan[number]
        status, samples = ask(client, case, stream)
        with lock:
            report.requests += 1
            report.statuses[status] = report.statuses.get(status, 0) + 1
            reference = references.get((case, stream))
            if status == 200 and reference is not None and np.array_equal(samples, reference):
                report.equal += 1
            elif status == 200 and reference is not None:
                size = min(samples.size, reference.size)
                unequal = np.flatnonzero(samples[:size] != reference[:size])
                first = int(unequal[0]) if unequal.size else size
                report.differing.append(
                    {"case": case, "stream": stream, "samples": (samples.size, reference.size), "first": first}
                )
                report.cross_talk += any(
                    np.array_equal(samples, other) for key, other in references.items() if key[0] != case
                )
            if progress and report.requests % 100 == 0:
                progress(f"{report.requests} requests, {report.equal} equal")

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))
    report.seconds = time.perf_counter() - started
    return report


def _wait_ready(client, url: str, timeout_s: float = 600.0) -> None:
    """Wait until ``/health`` answers 200 (the server loads its sessions first)."""
    deadline = time.monotonic() + timeout_s
    while (status := client.get(url + "/health", timeout=30).status_code) != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health still answers {status} after {timeout_s:.0f} s")
        time.sleep(0.05)


def soak_server(
    engines: Path,
    reference_wav: Path,
    reference_text: str,
    requests: int,
    concurrency: int,
    deterministic: bool | None = True,
    threads: int | None = None,
    seeds: Sequence[int] = (1, 2),
    progress: Callable[[str], None] | None = None,
) -> SoakReport:
    """Load ``engines`` (one KV slot per concurrent request, as ``trt-cosy serve --max-concurrent``
    gives), serve them on a free loopback port with one voice made from ``reference_wav`` and run
    ``run_soak``."""
    from ..server import ServerSettings, ThreadedServer, create_app
    from ..synthesis import EngineConfig
    from ..tts import CosyVoice

    config = EngineConfig(threads=threads, normalizer="none", llm_slots=concurrency, deterministic=deterministic)
    tts = CosyVoice.load(engines, config=config)
    with tempfile.TemporaryDirectory(prefix="trt-cosy-soak-") as folder:
        tts.voice_from_wav(reference_wav, reference_text).save(Path(folder) / "alice.npz")
        settings = ServerSettings(voices_dir=Path(folder), max_concurrent=concurrency, max_queue=2 * concurrency)
        with ThreadedServer(create_app(tts, settings)) as server:
            return run_soak(server.url, "alice", requests, concurrency, seeds=seeds, progress=progress)

"""What a listener hears of a streamed answer: a player that starts at the first chunk and plays in real time.

``playback_stalls`` takes when each chunk arrived (seconds from the request's start) and how much audio it
holds, and replays it through a player that starts playing the moment the first chunk arrives and then
plays without pause while it has audio; when it runs dry before the next chunk arrives, the listener
hears a gap (a *stall*) until that chunk comes. Pure arithmetic: ``trt-cosy bench --stream`` feeds it the
chunks of a real streaming request.

``first_chunk_breakdown`` splits the time to first audio of one request into the parts that make it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

__all__ = ["Stalls", "playback_stalls", "first_chunk_breakdown", "BREAKDOWN_PARTS"]

BREAKDOWN_PARTS = ("prefill_s", "decode_s", "waiting_s", "flow_s", "vocoder_s")


@dataclass(frozen=True)
class Stalls:
    """A streamed answer as heard: first audio, the gaps after it, and how long it played."""

    first_audio_s: float
    """Seconds from the request's start to its first chunk (when playing starts)."""
    total_s: float
    """Seconds of silence the listener hears after playing started (sum of the gaps)."""
    longest_s: float
    """The longest single gap."""
    count: int
    """How many gaps."""
    audio_s: float
    """Seconds of audio in the answer."""
    finished_s: float
    """Seconds from the request's start until the player has played the last sample."""

    def as_dict(self) -> dict[str, float]:
        return {key: float(value) for key, value in asdict(self).items()}


def playback_stalls(arrivals_s: Sequence[float], durations_s: Sequence[float]) -> Stalls:
    """Replay chunks that arrived at ``arrivals_s`` (seconds, non-decreasing) holding ``durations_s`` of
    audio each through a real-time player that starts at the first chunk.

    A gap smaller than 1 microsecond is rounding, not a stall. Chunks without audio (a segment the
    LLM ended at once) are heard as nothing and never count as the first chunk.
    """
    if len(arrivals_s) != len(durations_s):
        raise ValueError(f"{len(arrivals_s)} arrival times for {len(durations_s)} chunk durations")
    chunks = [(float(at), float(length)) for at, length in zip(arrivals_s, durations_s, strict=True) if length > 0]
    if not chunks:
        raise ValueError("the answer holds no audio: nothing was played")
    if any(later < earlier for (earlier, _), (later, _) in zip(chunks, chunks[1:], strict=False)):
        raise ValueError("chunk arrival times must not decrease")
    first_at = chunks[0][0]
    playing_until = first_at  # when the player runs out of the audio it has so far
    total = longest = 0.0
    count = 0
    for at, length in chunks:
        gap = at - playing_until
        if gap > 1e-6:
            total += gap
            longest = max(longest, gap)
            count += 1
            playing_until = at
        playing_until += length
    audio = sum(length for _, length in chunks)
    return Stalls(first_at, total, longest, count, audio, playing_until)


def first_chunk_breakdown(
    first_token_s: float, timings: Mapping[str, float], first_audio_s: float
) -> dict[str, float]:
    """Where the time to the first chunk went (seconds from the request's start; the parts add up to
    ``first_audio_s``).

    ``first_token_s``: when the first speech token was published (``TokenFeed.token_times``; it comes
    from the prefill's logits); ``timings``: the first ``AudioChunk.timings`` (``tokens_ready_s``: when
    the chunk's tokens were all there, ``render_wait_s``: the render gate and turns, ``flow_s``,
    ``vocoder_s``); ``first_audio_s``: when the chunk was handed out.

    * ``prefill_s``: the LLM worker starting, the prompt's prefill and the first sample;
    * ``decode_s``: the decode steps up to the chunk's last token (look-ahead included);
    * ``waiting_s``: the render gate and turns, and what is left (handing the chunk out);
    * ``flow_s`` / ``vocoder_s``: the chunk's flow (encoder + solver) and vocoder calls.
    """
    ready = float(timings["tokens_ready_s"])
    if not 0.0 <= first_token_s <= ready <= first_audio_s:
        raise ValueError(
            f"inconsistent times: first token {first_token_s:.4f} s, tokens ready {ready:.4f} s, "
            f"first audio {first_audio_s:.4f} s"
        )
    parts = {
        "prefill_s": first_token_s,
        "decode_s": ready - first_token_s,
        "flow_s": float(timings["flow_s"]),
        "vocoder_s": float(timings["vocoder_s"]),
    }
    parts["waiting_s"] = first_audio_s - sum(parts.values())
    return {**{name: parts[name] for name in BREAKDOWN_PARTS}, "first_audio_s": first_audio_s}

"""What a real-time listener hears of a streamed answer (``trt_cosy.bench.listening``): pure arithmetic."""

from __future__ import annotations

import pytest

from trt_cosy.bench.listening import BREAKDOWN_PARTS, first_chunk_breakdown, playback_stalls


def test_chunks_that_arrive_before_the_player_runs_dry_never_stall():
    # 1 s of audio at 1.0 s, 2 s at 1.9 s (the player still has 0.1 s), 4 s at 3.5 s
    heard = playback_stalls([1.0, 1.9, 3.5], [1.0, 2.0, 4.0])
    assert heard.first_audio_s == 1.0 and heard.total_s == 0.0 and heard.longest_s == 0.0
    assert heard.count == 0 and heard.audio_s == 7.0 and heard.finished_s == pytest.approx(8.0)


def test_a_late_chunk_is_heard_as_a_gap_and_the_player_resumes_from_it():
    # the player runs dry at 2.0 s; the second chunk comes at 2.5 s: 0.5 s of silence, playing to 4.5 s;
    # the third comes at 6.0 s: 1.5 s more
    heard = playback_stalls([1.0, 2.5, 6.0], [1.0, 2.0, 1.0])
    assert heard.total_s == pytest.approx(2.0) and heard.longest_s == pytest.approx(1.5)
    assert heard.count == 2 and heard.finished_s == pytest.approx(7.0)


def test_empty_chunks_are_not_audio_and_not_the_first_chunk():
    heard = playback_stalls([0.2, 1.0, 1.5], [0.0, 1.0, 1.0])
    assert heard.first_audio_s == 1.0 and heard.total_s == 0.0 and heard.audio_s == 2.0


def test_a_gap_below_a_microsecond_is_rounding():
    heard = playback_stalls([1.0, 2.0 + 1e-9], [1.0, 1.0])
    assert heard.count == 0 and heard.total_s == 0.0


@pytest.mark.parametrize(
    ("arrivals", "durations", "message"),
    [
        ([1.0], [1.0, 2.0], "1 arrival times for 2"),
        ([1.0, 0.5], [1.0, 1.0], "must not decrease"),
        ([1.0], [0.0], "no audio"),
    ],
)
def test_bad_inputs_say_what_is_wrong(arrivals, durations, message):
    with pytest.raises(ValueError, match=message):
        playback_stalls(arrivals, durations)


def test_the_first_chunk_breakdown_adds_up_to_the_first_audio():
    timings = {"tokens_ready_s": 0.9, "render_wait_s": 0.05, "flow_s": 0.3, "vocoder_s": 0.1}
    parts = first_chunk_breakdown(0.25, timings, 1.4)
    assert parts["prefill_s"] == 0.25 and parts["decode_s"] == pytest.approx(0.65)
    assert parts["flow_s"] == 0.3 and parts["vocoder_s"] == 0.1
    assert parts["waiting_s"] == pytest.approx(0.1)  # the gate's 0.05 and 0.05 handing the chunk out
    assert sum(parts[name] for name in BREAKDOWN_PARTS) == pytest.approx(parts["first_audio_s"]) == 1.4


def test_inconsistent_times_are_refused():
    timings = {"tokens_ready_s": 0.2, "render_wait_s": 0.0, "flow_s": 0.3, "vocoder_s": 0.1}
    with pytest.raises(ValueError, match="inconsistent"):
        first_chunk_breakdown(0.5, timings, 1.0)  # the first token after all tokens were ready

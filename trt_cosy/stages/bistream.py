"""Text-in streaming ("bistream") of the CosyVoice2/3 speech LLM (numpy only): the official
``Qwen2LM.inference_bistream`` (spec §3.5), for text that is still being written.

What the official code does with a text *generator* (``CosyVoice2.inference_zero_shot(tts_text=gen)``,
FunAudioLLM/CosyVoice ace7c47):

* the frontend neither normalises nor splits it (``text_normalize`` returns ``[gen]``: one segment);
  each piece is tokenised on its own (``_extract_text_token``) and its ids go to the LLM one at a time;
* the LLM sequence starts ``[sos]`` (CosyVoice3: ``[sos] ++ prompt_text[: <|endofprompt|> + 1]``); the
  prompt text (v3: the rest after the marker) is the start of a text cache. For each text id that
  arrives: it joins the cache; while prompt speech tokens remain and the cache has ``mix[0]`` (5) ids,
  5 text + ``mix[1]`` (15) prompt speech embeddings are appended to the input; once the prompt speech is
  used up, 5 cached text ids are appended whenever the model asked for text (the last output was the
  fill token, or nothing was fed but ``sos``) and the model then decodes until its next fill token;
* the fill token is forced every ``mix[1] + 1`` outputs (``next_fill_index``), counted over every output
  *including* fill tokens (the RAS window sees them too); it may also be sampled; it is never fed back:
  the next input is the 5 text ids. Sampling masks ``speech_token_size`` (eos for v2, sos for v3);
* after the last piece: the input that produced the last fill token (already in the cache: the official
  code feeds it a second time), the rest of the cache and ``task_id`` are fed and decoding runs to eos.
  Prompt speech tokens still unused then are dropped.

The whole schedule is a function of the concatenated ids (one decode round per arriving id at most),
not of when the pieces arrive: the same pieces give the same tokens however they are timed.

Where this differs from the official code, deliberately: the official code has no length limit in
bistream; here the speech stops after ``max_token_text_ratio`` (20) x the text ids received, after the
request's speech budget, or before the KV cache would overflow (each with a log line). An output id
above the speech range other than fill (interleaved phase) or eos (after the text) raises
``ValueError`` in the official code; here it ends the speech like eos, with a warning.

``bistream_program`` is the schedule as a coroutine: it yields ``Feed(rows)`` (run these embeddings
through the KV-cached LLM and send back the logits of the last row), ``NeedText(n)`` (wait until n more
ids or the end of the text are there, then send None) and speech token ids (send None). Drivers:
``decode_alone`` (any backend's per-request decoder; multi-row feeds in one run, as the official code)
and ``stages.llm_batch.BatchedLLMStage`` (the shared decode loop; multi-row feeds one row per step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import numpy as np

from ..errors import InputError
from ..token_feed import Cancelled
from .sampling import Sampler, log_softmax

__all__ = [
    "BistreamPrompt",
    "BistreamSpecials",
    "Feed",
    "NeedText",
    "Stop",
    "TextStream",
    "TextEnded",
    "bistream_program",
    "decode_alone",
    "advance",
    "pump_async_text",
]

_LOGGER = logging.getLogger(__name__)
END: Final = -1  # ``TextStream.take``: the text has ended
DEFAULT_MIX: Final = (5, 15)
MAX_STEP_ROWS: Final = 8  # rows per decode call after the prefill (``ProfileLimits.max_decode_step``)


class BistreamSpecials(NamedTuple):
    """The special speech ids of a family's bistream decoding."""

    fill: int  # v2 6563, v3 6564
    eos: int  # what ends the speech after the text: v2 6561, v3 6562
    masked: int  # what ``sampling_ids(ignore_eos=True)`` masks: speech_token_size (6561) in both


@dataclass(frozen=True, eq=False)
class BistreamPrompt:
    """A voice's prompt split for bistream (``Family.bistream_prompt``).

    Attributes:
        head_ids: text ids fed right after sos (v3: the prompt text through ``<|endofprompt|>``), int64.
        text_ids: prompt text ids that start the text cache, int64 [Nt].
        speech_ids: prompt speech tokens interleaved with the text, int64 [Ns].
        specials: fill / eos / masked ids.
        mix: (text ids, speech tokens) per interleaved block, the yaml's ``mix_ratio``.
    """

    head_ids: np.ndarray
    text_ids: np.ndarray
    speech_ids: np.ndarray
    specials: BistreamSpecials
    mix: tuple[int, int] = DEFAULT_MIX


class Feed(NamedTuple):
    """Run ``rows`` [T, D] through the LLM (after everything fed before); send back the logits [V]
    of the last row."""

    rows: np.ndarray


class NeedText(NamedTuple):
    """Wait until ``wanted`` more text ids (or the end of the text) are there, then send None."""

    wanted: int


class TextEnded(InputError):
    """A text piece came after the end of the text."""


class TextStream:
    """The text pieces of one streamed request, tokenised as they come (thread-safe).

    A producer calls ``put(piece)`` for each piece and ``end()`` after the last (or ``fail(exc)``);
    or give ``source`` (an iterable of str), which the consumer pulls itself when it needs text. Each
    piece is tokenised alone, as the official frontend does with a text generator; nothing is
    normalised or split.

    Args:
        encode: ``str -> list[int]`` (the model's text tokenizer).
        source: pieces pulled by the consumer (in its own thread); None: pieces are ``put``.
        vocab: ids must be below this (the text embedding's rows).
    """

    def __init__(
        self, encode: Callable[[str], Sequence[int]], source: Iterable[str] | None = None, vocab: int = 0
    ):
        self._encode = encode
        self._source: Iterator[str] | None = iter(source) if source is not None else None
        self._vocab = vocab
        self._ids: deque[int] = deque()
        self._ended = False
        self._error: BaseException | None = None
        self._aborted = False
        self._changed = threading.Condition()
        self.pieces = 0
        self.chars = 0
        self.ids_received = 0
        self.first_piece_at: float | None = None  # time.perf_counter() of the first piece
        self.last_piece_at: float | None = None
        self.claimed = False  # a request reads it (one request per stream: ``claim``)

    def claim(self) -> TextStream:
        """Mark the stream as read by a request; ``InputError`` when another request has it already."""
        with self._changed:
            if self.claimed:
                raise InputError("this TextStream already feeds a request; make one TextStream per request.")
            self.claimed = True
        return self

    @property
    def ended(self) -> bool:
        return self._ended

    def put(self, piece: str) -> None:
        """Add a piece (tokenised here). ``InputError`` for a non-str piece; ``TextEnded`` after ``end``."""
        if not isinstance(piece, str):
            raise InputError(f"text pieces must be str, got {type(piece).__name__}.")
        ids = [int(i) for i in self._encode(piece)] if piece else []
        if self._vocab and any(not 0 <= i < self._vocab for i in ids):
            raise InputError("a text piece gave token ids outside the model's text vocabulary.")
        now = time.perf_counter()
        with self._changed:
            if self._ended:
                raise TextEnded("text came after the end of the text; start a new request for more.")
            self.pieces += 1
            self.chars += len(piece)
            self.ids_received += len(ids)
            self._ids.extend(ids)
            self.first_piece_at = now if self.first_piece_at is None else self.first_piece_at
            self.last_piece_at = now
            self._changed.notify_all()

    def end(self) -> None:
        """No more pieces (idempotent)."""
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The producer failed: the consumer gets ``exc`` when it next needs text."""
        with self._changed:
            self._error, self._ended = exc, True
            self._changed.notify_all()

    def abort(self) -> None:
        """The request stopped: wake a consumer waiting for text (it gets ``Cancelled``)."""
        with self._changed:
            self._aborted = True
            self._changed.notify_all()

    def take(self) -> int | None:
        """The next text id, ``END`` after the last, None when none has come yet (never blocks)."""
        with self._changed:
            if self._ids:
                return self._ids.popleft()
            if self._error is not None:
                raise self._error
            return END if self._ended else None

    def wait(self, wanted: int) -> None:
        """Block until ``wanted`` ids are queued or the text has ended (a ``source`` is pulled here).

        Raises ``token_feed.Cancelled`` after ``abort``, or the producer's error."""
        if self._source is not None:
            while not self._ended and len(self._ids) < wanted and not self._aborted:
                try:
                    piece = next(self._source)
                except StopIteration:
                    self.end()
                    break
                self.put(piece)
        with self._changed:
            while len(self._ids) < wanted and not self._ended and not self._aborted:
                self._changed.wait()
            if self._aborted:
                raise Cancelled("the request was cancelled")
            if self._error is not None and not self._ids:
                raise self._error


@contextlib.asynccontextmanager
async def pump_async_text(pieces: AsyncIterable[str], stream: TextStream) -> AsyncIterator[TextStream]:
    """For the block, a task of the running loop reads ``pieces`` into ``stream`` (then ``end``; its
    error goes to the consumer through ``fail``); leaving the block stops the task."""

    async def pump() -> None:
        try:
            async for piece in pieces:
                stream.put(piece)
        except asyncio.CancelledError:
            stream.abort()
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            stream.fail(exc)
        else:
            stream.end()

    task = asyncio.ensure_future(pump())
    try:
        yield stream
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def bistream_program(
    embed_text: np.ndarray,
    embed_speech: np.ndarray,
    sos: np.ndarray,
    task: np.ndarray,
    prompt: BistreamPrompt,
    text: TextStream,
    sampler: Sampler,
    max_tokens: int,
    max_token_text_ratio: float = 20.0,
    max_positions: int | None = None,
) -> Generator[Any, Any, None]:
    """The official bistream schedule as a coroutine (see the module docstring for the protocol).

    Args:
        embed_text: the text embedding table [Vt, D]; embed_speech: the speech one [V, D].
        sos, task: the sos and task_id rows [D].
        prompt: the voice's split prompt; text: the arriving text.
        sampler: the request's sampler (``sampler(logp, decoded)``).
        max_tokens: the most speech tokens to yield (the request's budget).
        max_token_text_ratio: speech tokens per received text id at most (the non-streamed rule).
        max_positions: the most positions the KV cache holds (None: no limit).
    """
    fill, eos, masked = prompt.specials
    mix_text, mix_speech = prompt.mix
    speech_size = masked  # ids >= speech_token_size are specials
    lm_input = np.concatenate([sos[None], embed_text[prompt.head_ids]])  # [1 + Nh, D]
    text_cache = embed_text[prompt.text_ids]  # [Nt, D]
    prompt_speech = embed_speech[prompt.speech_ids]  # [Ns, D]
    n_prompt = int(prompt.speech_ids.size)
    next_fill = (n_prompt // mix_speech + 1) * mix_speech - n_prompt
    out: list[int] = []  # every output id, fill tokens included (official ``out_tokens``)
    state = {"yielded": 0, "positions": 0, "received": 0}

    def limited(rows: int) -> bool:
        """Whether the speech must stop here (a limit of this engine, not of the official code)."""
        cap = min(max_tokens, int(state["received"] * max_token_text_ratio))
        if state["yielded"] >= cap:
            _LOGGER.info("bistream: stopping after %d speech tokens (limit %d)", state["yielded"], cap)
            return True
        if max_positions is not None and state["positions"] + rows > max_positions:
            _LOGGER.warning(
                "bistream: stopping at %d cached positions (KV slot capacity)", state["positions"]
            )
            return True
        return False

    def feed(rows: np.ndarray) -> Generator[Any, Any, np.ndarray]:
        logits = yield Feed(rows)
        state["positions"] += rows.shape[0]
        return log_softmax(np.asarray(logits))  # [V]

    while True:
        token_id = text.take()
        while token_id is None:
            wanted = mix_text - len(text_cache) if out and out[-1] == fill and not len(prompt_speech) else 1
            yield NeedText(max(1, wanted))
            token_id = text.take()
        if token_id == END:
            break
        state["received"] += 1
        text_cache = np.concatenate([text_cache, embed_text[token_id][None]])  # [n + 1, D]
        while len(prompt_speech):  # interleave the prompt: 5 text + 15 speech rows per block
            if len(text_cache) < mix_text:
                break
            lm_input = np.concatenate([lm_input, text_cache[:mix_text], prompt_speech[:mix_speech]])
            text_cache, prompt_speech = text_cache[mix_text:], prompt_speech[mix_speech:]
        if len(prompt_speech):
            continue
        after_fill = bool(out) and out[-1] == fill
        if after_fill or (not out and len(lm_input) == 1):  # the model waits for text
            if len(text_cache) < mix_text:
                continue
            block = text_cache[:mix_text]
            lm_input = block if after_fill else np.concatenate([lm_input, block])
            text_cache = text_cache[mix_text:]
        while True:  # decode until the next fill token
            if limited(len(lm_input)):
                return
            logp = yield from feed(lm_input)
            if len(out) == next_fill:
                top = fill
                next_fill += mix_speech + 1
            else:
                logp[masked] = -np.inf
                top = int(sampler(logp, out))
            if top == fill:
                next_fill = len(out) + mix_speech + 1
            out.append(top)
            if top >= speech_size:
                if top == fill:
                    break
                _LOGGER.warning(
                    "bistream: the LLM gave special id %d before the end of the text; speech ends", top
                )
                return
            yield top
            state["yielded"] += 1
            lm_input = embed_speech[top][None]  # [1, D]
    # The text has ended: the last input again (official), the rest of the text, task_id; then to eos.
    lm_input = np.concatenate([lm_input, text_cache, task[None]])
    while True:
        if limited(len(lm_input)):
            return
        logp = yield from feed(lm_input)
        top = int(sampler(logp, out))
        out.append(top)
        if top >= speech_size:
            if top != eos:
                _LOGGER.warning("bistream: the LLM gave special id %d instead of eos; speech ends", top)
            return
        yield top
        state["yielded"] += 1
        lm_input = embed_speech[top][None]  # [1, D]


class Stop(NamedTuple):
    """``advance``: the program has finished."""


def advance(program: Generator[Any, Any, None], reply: Any) -> tuple[list[int], Any]:
    """Send ``reply`` and run the program to its next ``Feed`` / ``NeedText`` / end:
    (speech tokens it yielded on the way, that action or ``Stop()``)."""
    tokens: list[int] = []
    try:
        action = program.send(reply)
        while isinstance(action, int):
            tokens.append(action)
            action = program.send(None)
    except StopIteration:
        return tokens, Stop()
    return tokens, action


def decode_alone(program: Generator[Any, Any, None], text: TextStream, decoder: Any) -> Iterator[int]:
    """Drive ``program`` on a per-request KV decoder (``decoder.step(inputs [1, T, D]) -> logits
    [1, T, V]``; ``LLMStage._decoder``): every backend, each feed in one run as the official code."""
    reply: Any = None
    started = time.perf_counter()
    count = 0
    fed = False
    try:
        while True:
            tokens, action = advance(program, reply)
            count += len(tokens)
            yield from tokens
            if isinstance(action, Stop):
                return
            if isinstance(action, NeedText):
                text.wait(action.wanted)
                reply = None
            else:
                rows = np.ascontiguousarray(action.rows, dtype=np.float32)  # [T, D]
                # After the prefill, feeds go in pieces of at most MAX_STEP_ROWS (TensorRT's decode profiles
                # take up to 8 new positions; causal attention makes the split exact up to rounding).
                step = len(rows) if not fed else MAX_STEP_ROWS
                for start in range(0, len(rows), step):
                    reply = decoder.step(rows[None, start : start + step])[0, -1]  # [V]
                fed = True
    finally:
        program.close()
        _LOGGER.debug("llm (bistream): %d tokens in %.3f s", count, time.perf_counter() - started)

"""Continuous (in-flight) batching of the speech LLM: one decode loop per loaded model, shared by
every request.

A request prefills its own prompt at batch 1 (in its own thread, ``OrtBatchLLM.prefill``), samples
its first token, then joins the ``DecodeScheduler``: its cache is copied into a free KV slot and
from the next step on it is one row of the batch. Each step the scheduler feeds every active row's
last token, runs one batched decode step (per-row lengths: ``graphs.LLM_BATCH``) and hands each row's
logits to that request's own sampler, with the request's own length limits, exactly as the
unbatched loop (``LLMStage._decode``) would; the tokens go to the request through a queue. A row
leaves at a stop token, at its ``max_len``, or when its request is cancelled (the consumer closes
the token iterator), and its slot is free for the next step. Requests never wait for each other
to finish: a new one joins at the next step.

Per-request state (sampler and its seeded RNG, RAS window, min/max length, decoded tokens) stays
per request. With ``deterministic`` (``EngineConfig.deterministic``) every step runs all slots with
the same shapes, so a row's logits are bit-identical whatever other rows share the step, and a
request yields the tokens it yields alone, with any seed (tests/test_batch_invariance.py). Without
it a step runs the active rows only: a row's logits may differ from its logits alone in the last
bits (int4 engines: up to ~1e-6), which changes a sampled token when a random draw falls at a
near-tie (measured: about one request in 1,000 under load; docs/determinism.md).

CosyVoice2 and Fun-CosyVoice3 ONNX Runtime engines only (their Qwen2 LLM has GroupQueryAttention);
CosyVoice 1 and TensorRT keep per-request decoding.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import numpy as np

from ..config import LLMConfig
from ..runtime.backends.base import Runner
from ..runtime.backends.onnxruntime.batch import OrtBatchLLM
from ..runtime.kv_slots import KVSlots, PrefillCache
from .bistream import BistreamPrompt, Feed, NeedText, Stop, TextStream, advance
from .llm import LLMStage
from .sampling import Sampler, log_softmax

__all__ = [
    "BatchedLLMStage", "DecodeScheduler", "DecodeStats", "DEFAULT_SLOTS", "DEFAULT_POSITIONS", "DETERMINISTIC_DEFAULT",
]

_LOGGER = logging.getLogger(__name__)
DEFAULT_SLOTS: Final = 8
DEFAULT_POSITIONS: Final = 2048  # cached positions per slot (prompt + speech tokens)
DETERMINISTIC_DEFAULT: Final = False  # EngineConfig.deterministic=None: see docs/determinism.md for the cost
_END: Final = object()
_IDLE_EXIT_S: Final = 30.0  # an idle loop ends its thread (the next request starts a new one)
DECODE_NICE: Final = -5  # decode threads' nice value, relative to the process's (where it may raise it)


class _Row:
    """One request's decode state (touched by its own thread until it joins, then by the scheduler)."""

    def __init__(self, stage: LLMStage, sampler: Sampler, min_len: int, max_len: int):
        self.sampler, self.min_len, self.max_len = sampler, min_len, max_len
        self.eos = stage.config.eos_token
        self.stop_tokens = frozenset(stage.config.stop_tokens)
        self.speech_embedding = stage.speech_embedding  # [V, D]
        self.decoded: list[int] = []
        self.step = 0
        self.done = False
        self.cancelled = threading.Event()
        self.tokens: queue.SimpleQueue = queue.SimpleQueue()  # int tokens, then _END or an exception
        self.next_input: np.ndarray | None = None  # [D]: embedding of the last token
        self.parked: NeedText | None = None  # a streamed request waits for text (``_ProgramRow``)

    def sample(self, logits: np.ndarray) -> int | None:
        """The next token from ``logits`` [V] (the unbatched loop's rules); None at a stop token.
        Sets ``done`` when no further step is wanted."""
        logp = log_softmax(logits)  # logp: [V]
        if self.step < self.min_len:
            logp[self.eos] = -np.inf
        token = int(self.sampler(logp, self.decoded))
        self.step += 1
        if token in self.stop_tokens:
            self.done = True
            return None
        self.decoded.append(token)
        self.next_input = self.speech_embedding[token]
        self.done = self.step >= self.max_len
        return token


class _ProgramRow(_Row):
    """A streamed-text request's row (``stages.bistream``): its ``bistream_program`` picks each token
    and the next inputs; a feed of several rows runs one row per step (the logits of all but the last
    are not used); when the program waits for text the row parks (``DecodeScheduler`` keeps its slot)."""

    def __init__(self, stage: LLMStage, program: Any, feed: Feed):
        super().__init__(stage, None, 0, 0)  # type: ignore[arg-type]  # the program samples
        self.program = program
        self.forced: collections.deque[np.ndarray] = collections.deque()
        self.set_feed(feed)

    def set_feed(self, feed: Feed) -> None:
        self.next_input = feed.rows[0]  # [D]
        self.forced = collections.deque(feed.rows[1:])  # each [D]
        self.parked = None

    def sample(self, logits: np.ndarray) -> int | None:
        if self.forced:  # a row of a multi-row feed: its logits are not used
            self.next_input = self.forced.popleft()
            return None
        tokens, action = advance(self.program, logits)
        if isinstance(action, Stop):
            self.done = True
        elif isinstance(action, NeedText):
            self.parked = action
        else:
            self.set_feed(action)
        for token in tokens[:-1]:  # (a program yields one token per logits; more would queue here)
            self.tokens.put(token)
        if tokens:
            self.decoded.append(tokens[-1])
        return tokens[-1] if tokens else None


class _Parked(NamedTuple):
    """A parked row's cache, handed to its request's thread (which waits for text, then re-joins)."""

    cache: PrefillCache


@dataclass
class DecodeStats:
    """Counters of one scheduler (read them for benchmarks; updated by the scheduler thread)."""

    steps: int = 0  # batched decode steps run
    row_steps: int = 0  # sum of the batch sizes of those steps (= tokens decoded in batches)
    joined: int = 0
    left: int = 0
    parked: int = 0  # rows that left to wait for text (streamed text), keeping their slot
    busy_s: float = 0.0  # seconds inside decode steps (graph + sampling)
    held_s: float = 0.0  # seconds the loop paused with rows waiting, while a first chunk rendered
    batch_sizes: dict[int, int] = field(default_factory=dict)


class DecodeScheduler:
    """The shared decode loop of one loaded model (a daemon thread, started by the first request).

    Args:
        model: the ``llm_batch`` session wrapper.
        slots: the KV slots (batch cap = ``slots.slots``).
        vocab: the speech vocabulary size of the logits.
    """

    def __init__(self, model: OrtBatchLLM, slots: KVSlots, vocab: int, deterministic: bool = False):
        _LIVE_SCHEDULERS.add(self)  # closed at interpreter exit (_close_live_schedulers)
        self.model, self.slots = model, slots
        self._stepper = model.decoder(slots, vocab, fixed_shapes=deterministic)
        self._rows: list[_Row] = []  # _rows[i] lives in slot i
        self._pending: list[tuple[_Row, PrefillCache]] = []
        self._holding: set[_Row] = (
            set()
        )  # parked rows (waiting for text, or queued to come back): a slot each
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._holds = 0  # first-chunk renders in progress that asked the loop to pause
        self.stats = DecodeStats()
        self.pause: str = "any"
        """When ``hold`` pauses the loop: "any" while any first chunk renders (every request's first
        audio comes sooner; measured at full size, c = 4: time to first audio p50 7.1 s against
        11.7 s with "all", at the same decode rate, docs/benchmarks.md), "all" while at least as many
        first chunks render as rows decode (one request alone: the same as "any"; several: the
        others keep decoding), "never"."""
        self.priority: int | None = DECODE_NICE
        """Nice value of the decode threads (the loop and ``pool_threads``) relative to the nice value of
        the thread that made this loop (a process started with ``nice -n 19`` decodes at 14, never above
        the priority it was given); None: that nice value itself."""
        self._base_nice = _own_nice()
        self.pool_threads: tuple[int, ...] = ()
        """Native ids of the batched session's intra-op threads (they run the steps with the loop)."""
        self._applied: int | None = None

    @property
    def deterministic(self) -> bool:
        """Batch-invariant steps: every step over all slots with the same shapes (the stepper's
        ``fixed_shapes``); set it before requests decode (a change applies from the next step)."""
        return bool(self._stepper.fixed_shapes)

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        self._stepper.fixed_shapes = bool(value)

    @property
    def active(self) -> int:
        """Rows in the batch now."""
        return len(self._rows)

    def join(self, row: _Row, cache: PrefillCache) -> None:
        """Queue a prefilled row; it joins the batch at the next step (when a slot is free)."""
        with self._changed:
            if self._closed:
                raise RuntimeError("the decode scheduler is closed")
            self._pending.append((row, cache))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trt-cosy-llm-batch", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def release_slot(self, row: _Row) -> None:
        """A parked row will not come back (its request ended): its slot is free for others."""
        with self._changed:
            if row in self._holding:
                self._holding.discard(row)
                self._changed.notify_all()

    @property
    def parked(self) -> int:
        """Rows parked now (each keeps a slot)."""
        return len(self._holding)

    def hold(self) -> None:
        """A first chunk renders until ``release`` (counted, thread-safe): the loop pauses before
        its next step as ``pause`` says, so the render gets the cores, as ``TokenFeed.hold`` does
        for a request that decodes alone."""
        with self._changed:
            self._holds += 1

    def release(self) -> None:
        """End one ``hold``."""
        with self._changed:
            self._holds = max(0, self._holds - 1)
            self._changed.notify_all()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """``hold`` for the block."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def wake(self) -> None:
        """Re-check cancellations now (a cancelled row frees its slot before the next step)."""
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        """Stop the loop (rows still running get ``RuntimeError``); for tests and shutdown."""
        with self._changed:
            self._closed = True
            thread = self._thread
            self._changed.notify_all()
        if thread is not None:
            thread.join(30.0)

    def _admit(self) -> bool:
        """Drop cancelled rows, admit pending ones while slots are free; False when closed or idle
        for ``_IDLE_EXIT_S`` (the thread then ends; ``join`` starts a new one)."""
        admitted = self._admit_rows()
        if admitted and self.priority != self._applied:
            self._apply_priority()
        return admitted

    def _admit_rows(self) -> bool:
        with self._changed:
            idle_since = time.monotonic()
            held_since: float | None = None  # rows waiting while held, since
            while True:
                self._drop([i for i, row in enumerate(self._rows) if row.cancelled.is_set()])
                self._holding -= {r for r, _ in self._pending if r.cancelled.is_set()}
                self._pending = [(r, c) for r, c in self._pending if not r.cancelled.is_set()]
                while self._pending and len(self._rows) < self.slots.slots:
                    # A parked row coming back has its slot; a new row takes one no parked row holds.
                    index = next((i for i, (r, _) in enumerate(self._pending) if r in self._holding), None)
                    if index is None:
                        if len(self._rows) + len(self._holding) >= self.slots.slots:
                            break
                        index = 0
                    row, cache = self._pending.pop(index)
                    self._holding.discard(row)
                    self.slots.add(cache)
                    self._rows.append(row)
                    self.stats.joined += 1
                if self._closed:
                    return False
                now = time.monotonic()
                if self._rows:
                    if not self._paused():
                        if held_since is not None:
                            self.stats.held_s += now - held_since
                        return True
                    idle_since = now  # held, not idle
                    held_since = now if held_since is None else held_since
                elif now - idle_since >= _IDLE_EXIT_S:
                    self._thread = None
                    return False
                self._changed.wait(_IDLE_EXIT_S)

    def _paused(self) -> bool:
        """Whether first-chunk renders hold the loop now (``pause``; with the lock held)."""
        if self.pause == "any":
            return self._holds > 0
        if self.pause == "all":
            return self._holds >= len(self._rows)
        return False

    def _apply_priority(self) -> None:
        """Give the decode threads ``priority`` (a lower nice value than the renders' 0 lets a step
        preempt a render at once instead of waiting for its time slice). Without the right to raise
        priority (``CAP_SYS_NICE`` or ``RLIMIT_NICE``) the threads keep theirs."""
        nice = self._base_nice if self.priority is None else self._base_nice + self.priority
        nice = min(max(nice, -20), 19)
        self._applied = self.priority
        for thread_id in (threading.get_native_id(), *self.pool_threads):
            try:
                os.setpriority(os.PRIO_PROCESS, thread_id, nice)
            except (PermissionError, ProcessLookupError, AttributeError) as exc:  # AttributeError: not POSIX
                _LOGGER.debug("decode thread %d keeps its priority (%s)", thread_id, exc)

    def _drop(self, indices: list[int], end: object = _END) -> None:
        """Remove rows (highest index first, so each move keeps the others' indices) and end them."""
        for index in sorted(indices, reverse=True):
            self._remove_row(index).tokens.put(end)
            self.stats.left += 1

    def _remove_row(self, index: int) -> _Row:
        """Take row ``index`` out of the batch and free its slot; the last row moves into the gap, as the
        KV slots move their last slot (``KVSlots.remove``). With the lock held."""
        row = self._rows[index]
        moved = self.slots.remove(index)
        if moved is not None:
            self._rows[index] = self._rows[moved]
        self._rows.pop()
        return row

    def _run(self) -> None:
        self._applied = None  # a new loop thread: give it the decode priority
        try:
            while self._admit():
                self._step()
        finally:
            with self._changed:
                # An idle exit left nothing behind and gave the loop up (``_thread`` None): a ``join``
                # since then belongs to the loop it started. Closed, or this loop died: fail what is left.
                if self._closed or self._thread is threading.current_thread():
                    self._thread = None
                    error = RuntimeError("the decode scheduler stopped")
                    self._drop(list(range(len(self._rows))), error)
                    for row, _ in self._pending:
                        row.tokens.put(error)
                    self._pending.clear()

    def _step(self) -> None:
        rows = list(self._rows)
        started = time.perf_counter()
        inputs = np.stack([row.next_input for row in rows])[:, None]  # [B, 1, D]
        try:
            logits = self._stepper.step(inputs)  # [B, V]
            finished, parked = [], []
            for index, row in enumerate(rows):
                token = row.sample(logits[index])
                if token is not None:
                    row.tokens.put(token)
                if row.done:
                    finished.append(index)
                elif row.parked is not None:
                    parked.append(index)
        except Exception as exc:  # the step failed: every row of it gets the error, the loop goes on
            _LOGGER.exception("batched decode step failed")
            with self._changed:
                self._drop(list(range(len(rows))), exc)
            return
        stats = self.stats
        stats.steps += 1
        stats.row_steps += len(rows)
        stats.busy_s += time.perf_counter() - started
        stats.batch_sizes[len(rows)] = stats.batch_sizes.get(len(rows), 0) + 1
        with self._changed:
            for index in sorted(
                finished + parked, reverse=True
            ):  # highest first: the others keep their index
                if index in parked:
                    self._park(index)
                else:
                    self._drop([index])

    def _park(self, index: int) -> None:
        """A row that waits for text leaves the batch with a copy of its cache and keeps a slot (lock held)."""
        cache = self.slots.export(index)
        row = self._remove_row(index)
        self._holding.add(row)
        self.stats.parked += 1
        row.tokens.put(_Parked(cache))


def _thread_ids() -> set[int]:
    """Native ids of this process's threads (Linux; empty elsewhere)."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()


_LIVE_SCHEDULERS: weakref.WeakSet[DecodeScheduler] = weakref.WeakSet()


@atexit.register
def _close_live_schedulers() -> None:
    """Stop every decode loop at interpreter exit, before daemon threads are frozen: a loop thread still
    inside ONNX Runtime then would be torn down mid-call and abort the process (SIGABRT, "terminate
    called ..."), e.g. when a program is interrupted while requests decode."""
    for scheduler in list(_LIVE_SCHEDULERS):
        scheduler.close()


class BatchedLLMStage(LLMStage):
    """``LLMStage`` whose decode steps run in the model's shared ``DecodeScheduler``.

    Args:
        runner: the per-request ``llm`` graph (teacher forcing, and requests whose prompt plus
            ``max_len`` exceed ``positions``).
        batch_runner: the ``llm_batch`` graph's ONNX Runtime runner.
        tables, config: as ``LLMStage``.
        slots: KV slots = batch size cap (default: ``DEFAULT_SLOTS``).
        positions: cached positions per slot (default: ``DEFAULT_POSITIONS``).
        deterministic: batch-invariant decode steps (``DecodeScheduler.deterministic``).
    """

    def __init__(
        self,
        runner: Runner,
        batch_runner: Runner,
        tables: Mapping[str, np.ndarray],
        config: LLMConfig,
        slots: int = DEFAULT_SLOTS,
        positions: int = DEFAULT_POSITIONS,
        deterministic: bool = False,
    ):
        super().__init__(runner, tables, config)
        qwen = config.qwen
        self._shape = (qwen.num_layers, qwen.num_kv_heads, qwen.head_dim)
        before = _thread_ids()
        self.batch_model, kv = self._batch_backend(batch_runner, slots, positions)
        self.scheduler = DecodeScheduler(self.batch_model, kv, config.speech_vocab_size, deterministic)
        self.scheduler.pool_threads = tuple(sorted(_thread_ids() - before))  # the new session's threads
        _LOGGER.debug(
            "batched LLM decoding: %d slots of %d positions (%.0f MiB reserved)", slots, positions, kv.nbytes / 2**20
        )

    def render_hold(self) -> contextlib.AbstractContextManager[None]:
        """Pause the shared decode loop for the block (a request renders its first chunk)."""
        return self.scheduler.held()

    def _batch_backend(self, batch_runner: Runner, slots: int, positions: int) -> tuple[Any, Any]:
        """The batched model and its KV slots (ONNX Runtime here; ``stages.trt_llm_batch`` for TensorRT)."""
        layers, kv_heads, head_dim = self._shape
        load = getattr(batch_runner, "load", None)  # a LazyOrtRunner: create the session now
        model = OrtBatchLLM(load() if load is not None else batch_runner, layers)
        return model, KVSlots(slots, layers, kv_heads, positions, head_dim)

    def generate_bistream(
        self, text: TextStream, prompt: BistreamPrompt, sampler: Sampler, max_new_tokens: int
    ) -> Iterator[int]:
        """``LLMStage.generate_bistream`` on the shared decode loop: the first feed is prefilled in this
        thread, then the row decodes in the batch; while it waits for text it is parked (its cache
        copied out, its slot kept for it) and this thread waits for the text, then it re-joins."""
        if not hasattr(self.scheduler.slots, "export"):  # slots that cannot park a row: decode alone
            return super().generate_bistream(text, prompt, sampler, max_new_tokens)
        capacity = self.scheduler.slots.capacity
        program = self._bistream_program(text, prompt, sampler, max_new_tokens, max_positions=capacity)
        return self._drive_bistream(program, text)

    def _drive_bistream(self, program: Any, text: TextStream) -> Iterator[int]:
        layers, kv_heads, head_dim = self._shape
        scheduler = self.scheduler
        reply: Any = None
        cache: PrefillCache | None = None
        row: _ProgramRow | None = None
        count = 0
        started = time.perf_counter()
        try:
            while True:
                tokens, action = advance(program, reply)  # in this thread: the row is not in the loop
                count += len(tokens)
                yield from tokens
                reply = None
                if isinstance(action, Stop):
                    return
                if isinstance(action, NeedText):
                    text.wait(action.wanted)
                    continue
                if cache is None:  # nothing fed yet: prefill at batch 1 here, as a plain request does
                    cache = PrefillCache(layers, kv_heads, action.rows.shape[0], head_dim)
                    reply = self.batch_model.prefill(action.rows[None], cache)  # [V]
                    continue
                if row is None:
                    row = _ProgramRow(self, program, action)
                else:
                    row.set_feed(action)
                scheduler.join(row, cache)
                cache = None
                while True:
                    item = row.tokens.get()
                    if item is _END:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    if isinstance(item, _Parked):  # waits for text; its slot stays reserved
                        cache = item.cache
                        text.wait(row.parked.wanted if row.parked is not None else 1)
                        break
                    count += 1
                    yield item
        finally:
            if row is not None:
                if not row.done:  # closed early: free the slot now
                    row.cancelled.set()
                    scheduler.wake()
                scheduler.release_slot(row)
            else:
                program.close()  # (a row's program may still run in the loop: it is left to the collector)
            _LOGGER.debug(
                "llm (batched, streamed text): %d tokens in %.3f s", count, time.perf_counter() - started
            )

    def _decode(self, lm_input: np.ndarray, sampler: Sampler, min_len: int, max_len: int) -> Iterator[int]:
        if max_len <= 0:
            return
        if lm_input.shape[1] + max_len > self.scheduler.slots.capacity:
            _LOGGER.debug("prompt of %d + %d tokens exceeds the KV slots: decoding alone", lm_input.shape[1], max_len)
            yield from super()._decode(lm_input, sampler, min_len, max_len)
            return
        layers, kv_heads, head_dim = self._shape
        row = _Row(self, sampler, min_len, max_len)
        started = time.perf_counter()
        try:
            cache = PrefillCache(layers, kv_heads, lm_input.shape[1], head_dim)
            token = row.sample(self.batch_model.prefill(lm_input, cache))  # step 0, in this thread
            if token is None:
                return
            yield token
            if row.done:
                return
            self.scheduler.join(row, cache)
            del cache
            while True:
                item = row.tokens.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not row.done:  # closed early: free the slot now
                row.cancelled.set()
                self.scheduler.wake()
            elapsed = time.perf_counter() - started
            _LOGGER.debug(
                "llm (batched): %d tokens in %.3f s (prefill %d positions)",
                len(row.decoded),
                elapsed,
                lm_input.shape[1],
            )


def _own_nice() -> int:
    """The calling thread's nice value (0 where the platform has no ``os.getpriority``)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return 0

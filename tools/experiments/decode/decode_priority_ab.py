"""Where the time goes when N streaming requests share one CPU, and which scheduling policy of the
shared decode loop and the renders pays (A/B in one process, variants alternating).

    python tools/experiments/decode/decode_priority_ab.py ENGINES [--threads 2] [--levels 1,4] [--runs 2] [--json out.json]

Part 1 (the floor): decode step times with nothing else running: the unbatched ``llm`` graph
(``OrtKVDecoder``) and ``llm_batch`` at batch 1, 2, 4, 8, 150 cached positions; the prefill of a
75-position prompt through both.

Part 2: rounds of N requests started together (the ``trt-cosy bench --concurrency`` request: "See
you soon.", synthetic 50-token prompt, streaming), once per variant:

* ``before``: renders run at once, the decode loop never pauses, decode threads at nice 0;
* ``turns``: renders take turns (first chunks first: ``runtime.render_turns``);
* ``turns+hold``: and the decode loop pauses while a first chunk renders (``DecodeScheduler.hold``);
* ``turns+hold+nice``: and the decode threads run at nice ``DECODE_NICE`` (needs CAP_SYS_NICE)
  (``DecodeScheduler.pause = "any"``: the default since 2026-12-01 22:20);
* ``turns+nice``: turns and nice, no pause;
* ``turns+share+nice``: the loop pauses only while as many first chunks render as rows decode
  (``DecodeScheduler.pause = "all"``).

A round ends (its requests are cancelled) once every request has its first audio and its LLM has
finished: what is compared is decode throughput and time to first audio, not the tail renders.
Per round: decode tok/s over wall seconds until the last token (``wall``) and the ``trt-cosy bench``
figure (its LLM seconds exclude the time a request's own first render held it), TTFA per request,
decode step median by batch size with and without a render running at the same time, seconds the
loop was held, CPU seconds per wall second of the process.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import numpy as np

from trt_cosy import CosyVoice, SynthesisConfig
from trt_cosy.bench.concurrency import ConcurrencyOptions, _synthetic_voice
from trt_cosy.pipeline import Request
from trt_cosy.runtime.kv_slots import KVSlots, PrefillCache
from trt_cosy.runtime.render_turns import RENDER_TURNS
from trt_cosy.stages import llm_batch
from trt_cosy.synthesis import EngineConfig

VARIANTS = ("before", "turns", "turns+hold", "turns+hold+nice", "turns+nice", "turns+share+nice")
_EVENTS: dict[str, list] = {"steps": [], "renders": []}


def _instrument() -> None:
    step = llm_batch.DecodeScheduler._step
    render = Request._render

    def timed_step(self):
        rows = len(self._rows)
        start = time.perf_counter()
        step(self)
        _EVENTS["steps"].append((start, time.perf_counter(), rows))

    def timed_render(self, tokens, plan, state):
        start = time.perf_counter()
        try:
            return render(self, tokens, plan, state)
        finally:
            _EVENTS["renders"].append((start, time.perf_counter(), plan.offset == 0))

    llm_batch.DecodeScheduler._step = timed_step
    Request._render = timed_render


def _set_variant(tts: CosyVoice, name: str) -> None:
    stage = tts._stages.llm
    Request.render_turns = RENDER_TURNS if "turns" in name else None
    stage.scheduler.pause = "any" if "hold" in name else "all" if "share" in name else "never"
    stage.scheduler.priority = llm_batch.DECODE_NICE if "nice" in name else None


def _median_ms(call, repeats: int = 15) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def floor(tts: CosyVoice, rng: np.random.Generator) -> dict[str, float]:
    stage = tts._stages.llm
    qwen = tts.model.config.llm.qwen
    dim = tts.model.config.llm.llm_input_size
    out: dict[str, float] = {}
    prompt = rng.standard_normal((1, 75, dim)).astype(np.float32) * 0.1  # [1, 75, D]
    step_in = rng.standard_normal((1, 1, dim)).astype(np.float32) * 0.1  # [1, 1, D]
    # unbatched llm graph: prefill 75 then steps at ~150 cached positions
    decoder = stage._decoder()
    out["llm_prefill75_ms"] = _median_ms(lambda: stage._decoder().step(prompt), 5)
    decoder.step(rng.standard_normal((1, 150, dim)).astype(np.float32) * 0.1)
    keys, values = decoder._keys, decoder._values

    def unbatched_step():
        decoder._keys, decoder._values = keys, values  # stay at 150 cached positions
        decoder.step(step_in)

    out["llm_step_ms"] = _median_ms(unbatched_step)
    model = stage.batch_model
    cache = PrefillCache(qwen.num_layers, qwen.num_kv_heads, 75, qwen.head_dim)
    out["llm_batch_prefill75_ms"] = _median_ms(lambda: model.prefill(prompt, cache), 5)
    for batch in (1, 2, 4, 8):
        slots = KVSlots(batch, qwen.num_layers, qwen.num_kv_heads, 512, qwen.head_dim)
        for _ in range(batch):
            part = PrefillCache(qwen.num_layers, qwen.num_kv_heads, 150, qwen.head_dim)
            for array in (*part.keys, *part.values):
                array[:] = rng.standard_normal(array.shape) * 0.1
            slots.add(part)
        stepper = model.decoder(slots, tts.model.config.llm.speech_vocab_size)
        inputs = np.repeat(step_in, batch, axis=0)  # [B, 1, D]

        def batched_step(stepper=stepper, inputs=inputs, slots=slots, batch=batch):
            stepper.step(inputs)
            slots.lengths[:batch] -= 1

        out[f"llm_batch_step_B{batch}_ms"] = _median_ms(batched_step)
    for key, value in out.items():
        print(f"  {key}: {value:.2f}", flush=True)
    return out


def one_round(tts: CosyVoice, voice, text: str, level: int, seed: int) -> dict:
    config = SynthesisConfig(stream=True, text_frontend=False)
    iterators = [tts.synthesize(text, voice, seed=seed + i, config=config) for i in range(level)]
    requests = [it.request for it in iterators]
    finished_at: list[float | None] = [None] * level
    barrier = threading.Barrier(level + 1)
    _EVENTS["steps"].clear()
    _EVENTS["renders"].clear()
    held0 = tts._stages.llm.scheduler.stats.held_s

    def consume(index: int) -> None:
        barrier.wait()
        for _ in iterators[index]:
            pass

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(level)]
    for thread in threads:
        thread.start()
    cpu0 = os.times()
    barrier.wait()
    start = time.perf_counter()
    while True:
        now = time.perf_counter()
        for i, request in enumerate(requests):
            if finished_at[i] is None and request.feed.finished_all:
                finished_at[i] = now
        if all(f is not None for f in finished_at) and all(r.first_audio_s is not None for r in requests):
            break
        if not any(t.is_alive() for t in threads):
            break
        time.sleep(0.005)
    for it in iterators:
        it.cancel()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    cpu1 = os.times()
    tokens = sum(len(r.feed._tokens[0]) for r in requests)
    llm_end = max(r.feed.llm_seconds(0) for r in requests)
    decode_end = max(f - start for f in finished_at if f is not None)
    steps = list(_EVENTS["steps"])
    renders = list(_EVENTS["renders"])

    def overlapped(s0: float, s1: float) -> bool:
        return any(r0 < s1 and r1 > s0 for r0, r1, _ in renders)

    by_batch: dict[str, dict[str, float]] = {}
    for batch in sorted({b for _, _, b in steps}):
        alone = [(e - s) * 1e3 for s, e, b in steps if b == batch and not overlapped(s, e)]
        shared = [(e - s) * 1e3 for s, e, b in steps if b == batch and overlapped(s, e)]
        by_batch[str(batch)] = {
            "n_alone": len(alone),
            "ms_alone": float(np.median(alone)) if alone else float("nan"),
            "n_with_render": len(shared),
            "ms_with_render": float(np.median(shared)) if shared else float("nan"),
        }
    gaps = [(b[0] - a[1]) * 1e3 for a, b in zip(steps, steps[1:], strict=False)]
    return {
        "gap_ms_median": float(np.median(gaps)) if gaps else float("nan"),
        "gap_s": float(sum(g for g in gaps if g < 50.0)) / 1e3,  # short gaps: loop overhead, not holds
        "tokens": tokens,
        "decode_tok_s_wall": tokens / decode_end,
        "decode_tok_s_bench": tokens / llm_end if llm_end > 0 else 0.0,
        "decode_end_s": decode_end,
        "ttfa_s": sorted(float(r.first_audio_s) for r in requests if r.first_audio_s is not None),
        "steps": len(steps),
        "step_s": sum(e - s for s, e, _ in steps),
        "render_s": sum(e - s for s, e, _ in renders),
        "first_render_s": sorted(e - s for s, e, first in renders if first),
        "held_s": tts._stages.llm.scheduler.stats.held_s - held0,
        "cpu_per_wall": ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / wall,
        "by_batch": by_batch,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engines", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--levels", default="1,4")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--no-floor", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    variants = args.variants.split(",")
    tts = CosyVoice.load(args.engines, config=EngineConfig(threads=args.threads, llm_slots=max(8, *levels)))
    print(f"decode pool threads {tts._stages.llm.scheduler.pool_threads}", flush=True)
    options = ConcurrencyOptions()
    voice = _synthetic_voice(tts, options)
    report: dict = {"engines": str(args.engines), "threads": args.threads, "load_before": os.getloadavg()}
    if not args.no_floor:
        report["floor"] = floor(tts, np.random.default_rng(0))
    _instrument()
    _set_variant(tts, "before")
    one_round(tts, voice, options.text, max(levels), 999)  # warm-up (arenas, lazy sessions)
    rounds: dict = {}
    for run in range(args.runs):
        for level in levels:
            for name in variants:
                _set_variant(tts, name)
                result = one_round(tts, voice, options.text, level, 100 * run)
                rounds.setdefault(f"c{level}", {}).setdefault(name, []).append(result)
                print(
                    f"run {run} c={level} {name:16s}: wall {result['decode_tok_s_wall']:6.1f} tok/s, "
                    f"bench {result['decode_tok_s_bench']:6.1f} tok/s, TTFA "
                    f"{' '.join(f'{t:.2f}' for t in result['ttfa_s'])} s, held {result['held_s']:.2f} s, "
                    f"steps {result['steps']} ({result['step_s']:.2f} s), renders {result['render_s']:.2f} s, "
                    f"gap {result['gap_ms_median']:.2f} ms ({result['gap_s']:.2f} s), cpu {result['cpu_per_wall']:.2f}, load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                print(f"    steps by batch: {json.dumps(result['by_batch'])}", flush=True)
                if args.json:  # kept up to date: a run cut short still leaves its rounds
                    args.json.write_text(json.dumps({**report, "rounds": rounds}, indent=1))
    report["rounds"] = rounds
    report["load_after"] = os.getloadavg()
    summary = {}
    for level, by_name in rounds.items():
        for name, results in by_name.items():
            ttfa = [t for r in results for t in r["ttfa_s"]]
            summary[f"{level} {name}"] = {
                "wall_tok_s": float(np.median([r["decode_tok_s_wall"] for r in results])),
                "bench_tok_s": float(np.median([r["decode_tok_s_bench"] for r in results])),
                "ttfa_p50": float(np.percentile(ttfa, 50)),
                "ttfa_p95": float(np.percentile(ttfa, 95)),
            }
    report["summary"] = summary
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

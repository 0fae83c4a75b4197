"""`trt-cosy bench`: time an engines directory, one request at a time or N at once (--concurrency)."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import InputError
from .options import echo_progress, engines_or_model_dir


@click.command()
@click.option("--engines", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Engines directory to measure (trt-cosy build --out).")
@click.option("--model-dir", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Official release directory instead of --engines: engines are built into the cache when needed.")
@click.option("--tokens", type=int, default=250, show_default=True, help="Speech tokens per run (25 per second of audio).")
@click.option("--text", default=None, help="Text to tokenise instead of 24 random text tokens.")
@click.option("--stream", is_flag=True,
              help="Also time the first audio of a streaming request (3, 5 and 10 s reference voices), part by "
                   "part, and the stalls a real-time listener hears in a streamed answer (--listen-seconds).")
@click.option("--listen-seconds", type=float, default=15.0, show_default=True,
              help="With --stream: the length of the streamed answer whose stalls are measured (0: none).")
@click.option("--runs", type=int, default=3, show_default=True, help="Timed runs (medians and spread).")
@click.option("--warmup", type=int, default=1, show_default=True, help="Untimed runs first.")
@click.option("--threads", type=int, default=None, help="Intra-op threads per session (default: physical cores).")
@click.option("--no-cold-start", is_flag=True, help="Do not time fresh processes from start to ready.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the full report as JSON.")
@click.option("--concurrency", default=None, metavar="N[,N...]",
              help="Instead: N streaming requests at once through one CosyVoice (e.g. 1,2,4,8): aggregate "
                   "decode tokens/s, audio seconds per wall second, time to first audio p50/p95.")
@click.option("--compare-unbatched", is_flag=True,
              help="With --concurrency: also run each round with every request decoding alone.")
def bench(engines: Path | None, model_dir: Path | None, tokens: int, text: str | None, stream: bool,
          listen_seconds: float, runs: int, warmup: int, threads: int | None, no_cold_start: bool, json_out: Path | None, concurrency: str | None,
          compare_unbatched: bool) -> None:
    """Time LLM prefill/decode, flow, HiFT, RTF, first audio, cold start and peak RSS of an engines directory."""
    import json

    from ..bench.speed import BenchOptions, format_bench, run_bench

    engines = engines_or_model_dir(engines, model_dir)
    if concurrency is not None:
        _bench_concurrency(engines, concurrency, text, runs, warmup, threads, compare_unbatched, json_out)
        return

    if listen_seconds < 0:
        raise InputError(f"--listen-seconds must be >= 0, got {listen_seconds}.")
    options = BenchOptions(tokens=tokens, text=text, stream=stream, runs=runs, warmup=warmup, threads=threads,
                           cold_start=not no_cold_start, listen_tokens=round(listen_seconds * 25))
    report = run_bench(engines, options, progress=echo_progress)
    click.echo(format_bench(report))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def _bench_concurrency(engines: Path, levels: str, text: str | None, runs: int, warmup: int,
                       threads: int | None, compare_unbatched: bool, json_out: Path | None) -> None:
    import json

    from ..bench.concurrency import ConcurrencyOptions, format_concurrency, run_concurrency_bench

    try:
        parsed = tuple(int(item) for item in levels.split(","))
    except ValueError:
        raise InputError(f"--concurrency takes positive integers separated by commas, got {levels!r}.") from None
    options = ConcurrencyOptions(levels=parsed, runs=runs, warmup=warmup, threads=threads,
                                 compare_unbatched=compare_unbatched,
                                 **({"text": text} if text is not None else {}))
    report = run_concurrency_bench(engines, options, progress=echo_progress)
    click.echo(format_concurrency(report))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


@click.command("tune-threads")
@click.option("--engines", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Engines directory to measure (trt-cosy build --out).")
@click.option("--seconds", type=click.FloatRange(min=1.0), default=600.0, show_default=True,
              help="About how long the timing may take: the first two splits always run, later ones are skipped "
                   "past this.")
@click.option("--tokens", type=click.IntRange(min=30), default=100, show_default=True,
              help="Speech tokens of each replica's non-streamed run (25 per second of audio).")
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed runs per replica (medians).")
@click.option("--splits", default=None, metavar="RxT[p],...",
              help="Only these splits: REPLICASxTHREADS, p for pinned, or 'default' (one engine, default threads, "
                   "unpinned), e.g. default,2x1p. Default: the machine's candidates (one-thread replicas, the "
                   "default pinned, replicas of each divisor of the cores within a NUMA node, fewer threads).")
def tune_threads(engines: Path, seconds: float, tokens: int, runs: int, splits: str | None) -> None:
    """Time splits of this machine's cores among engines (replicas x threads, pinned) and record the best for
    throughput, first audio and one engine alone; `serve --workers auto`, `--ray --replicas auto`,
    `triton-repo --instances auto` and `serve` (one engine) use it."""
    from ..bench.thread_split import SplitOptions, parse_splits
    from ..bench.thread_split import tune_threads as measure
    from ..runtime.cpu_budget import read_budget
    from ..runtime.thread_plan import write_plan

    budget = read_budget()
    chosen = parse_splits(splits, budget) if splits is not None else None
    plan = measure(engines, SplitOptions(tokens=tokens, runs=runs, seconds=seconds), chosen,
                   progress=echo_progress, budget=budget)
    path = write_plan(plan, engines)
    click.echo(f"{plan.cpu}, {plan.budget_description}:\n{plan.table()}")
    for choice in plan.choices.values():
        click.echo(choice.describe())
    click.echo(f"recorded in {path}")

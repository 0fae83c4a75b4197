"""The ``trt-cosy`` command line. Thin: parse options, call the library, report errors.

One module per group of commands: ``models`` (download, build, make-test-model, verify), ``say``, ``convert``,
``voices``,
``serve`` (serve, triton-repo), ``bench``; ``options`` holds what they share.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import click

from ..errors import TrtCosyError
from ..version import __version__
from . import bench, convert, models, say, serve, voices
from .options import add_verbose_option, log_level

__all__ = ["main"]


class _Group(click.Group):
    """Turns TrtCosyError into a one-line message and exit status 2 (no traceback); Ctrl-C and SIGTERM
    into a line and the shell's status for the signal (130, 143)."""

    def invoke(self, ctx: click.Context):
        from ..interrupts import exit_status, signal_name, sigterm_raises

        try:
            with sigterm_raises():  # SIGTERM unwinds like Ctrl-C: temporary files are removed
                return super().invoke(ctx)
        except TrtCosyError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except KeyboardInterrupt as exc:
            click.echo(f"interrupted ({signal_name(exc)})", err=True)
            if _command_threads_alive():
                # The main thread's cleanup (temporary files) has run. The engine's own threads (the LLM
                # workers, the shared decode loop) are stopped by the library at interpreter exit, but the
                # threads a command started itself (`bench --concurrency`'s requests) are not daemons:
                # interpreter exit would wait until their work ends. Leave at once.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(exit_status(exc))
            sys.exit(exit_status(exc))


def _command_threads_alive() -> bool:
    """A thread other than the main one that interpreter exit would wait for (not a daemon) is alive."""
    main_thread = threading.main_thread()
    return any(not thread.daemon and thread is not main_thread for thread in threading.enumerate())


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="trt-cosy")
@click.option("-v", "--verbose", count=True, help="-v for info, -vv for debug logging.")
def main(verbose: int) -> None:
    """Fast CosyVoice inference: build engines, verify parity, speak."""
    logging.basicConfig(level=log_level(verbose), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


for _command in (models.download, models.build, models.make_test_model, models.verify, say.say,
                 convert.convert, voices.voices, serve.serve, serve.triton_repo, bench.bench, bench.tune_threads):
    main.add_command(_command)
    add_verbose_option(_command)  # after the command's own options, as -v / -vv anywhere on the line

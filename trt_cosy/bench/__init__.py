"""Benchmark helpers: the reduced-precision quality guard (``quality``)."""

"""The TensorRT backend (CUDA GPU): ``runner`` (``TrtRunner``, one plan), ``lazy`` (plans deserialised
on first use), ``plans`` and ``bindings`` (plan records and I/O checked at load), ``shared`` (the
guarded ``tensorrt`` import, one logger and runtime), ``cuda`` (cuda-python helpers), ``kv`` and
``batch`` (LLM decoding with the cache on the device), ``euler`` (the device Euler loop) and
``device_blocks`` (the incremental flow cache on the device). ``tensorrt`` and ``cuda.bindings`` are
imported lazily: every module here imports on a CPU-only machine."""

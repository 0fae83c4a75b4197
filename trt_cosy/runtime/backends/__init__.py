"""The backends: one subpackage each (``onnxruntime``, ``openvino``, ``tensorrt``), the pattern of
Polygraphy's ``backend/<name>/``, over the shared ``base`` (the ``Runner`` interface, feed checks and
casts, the lazily created runner).

A backend knows graphs, files and its library, never a model family: ``runtime.engines`` picks the
backend from the manifest and hands each runner its graph. Nothing here is imported by this package
itself, so importing ``trt_cosy`` never loads a backend library; each backend imports its library on
first use (``tensorrt`` and ``cuda.bindings`` only when a plan is loaded).
"""

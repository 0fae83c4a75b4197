"""The ONNX Runtime backend (CPU): ``runner`` (one ``OrtRunner`` per graph, its lazy form and KV
decoder) and ``batch`` (the batched decode graph over host KV slots)."""

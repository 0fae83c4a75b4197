"""Plugging trt-cosy into serving systems: a Triton Inference Server model repository
(``triton_repo``, ``triton_model``) and a Ray Serve deployment of the HTTP app (``ray_app``).

Each module imports its serving system lazily; ``import trt_cosy.serving`` needs neither.
"""

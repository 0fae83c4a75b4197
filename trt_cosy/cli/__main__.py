"""``python -m trt_cosy.cli``: the ``trt-cosy`` command."""

from . import main

main()

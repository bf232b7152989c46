"""``python -m benchmarks.gpu_e2e``: see the docstring of ``cli`` (``--help``)."""

import sys

from .cli import main

sys.exit(main())

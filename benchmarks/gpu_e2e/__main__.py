"""``python -m benchmarks.gpu_e2e``: see the package docstring (``--help``)."""

import sys

from .cli import main

sys.exit(main())

"""``python -m hif8qat.report``: see :mod:`hif8qat.report.cli`."""

import sys

from .cli import main

sys.exit(main())

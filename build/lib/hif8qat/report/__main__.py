"""``python -m hif8qat.report``: see :mod:`hif8qat.report.cli`."""

import sys

from hif8qat.report.cli import main

sys.exit(main())

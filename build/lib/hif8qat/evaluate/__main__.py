"""``python -m hif8qat.evaluate``."""

from hif8qat.evaluate.cli import main

raise SystemExit(main())

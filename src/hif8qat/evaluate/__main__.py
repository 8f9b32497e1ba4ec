"""``python -m hif8qat.evaluate``."""

from .cli import main

raise SystemExit(main())

"""``python -m scripts.model_families``."""

from .report import main

raise SystemExit(main())

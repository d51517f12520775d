"""``python -m scripts.experiments.fidelity``."""

from . import main

raise SystemExit(main())

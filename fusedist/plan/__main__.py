"""``python -m fusedist.plan``."""

from .cli import main

raise SystemExit(main())

"""``python -m lightning_ac.selfcheck``: every feature's self-check on the installed releases, one line each."""

from lightning_ac.selfcheck.cli import main

raise SystemExit(main())

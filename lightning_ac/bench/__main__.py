"""``python -m lightning_ac.bench``: run the mode benchmark (see :mod:`lightning_ac.bench.cli`)."""

from lightning_ac.bench.cli import main

if __name__ == "__main__":
    main()

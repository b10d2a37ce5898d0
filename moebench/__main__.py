"""`python -m moebench ...` (also what `torchrun -m moebench ...` runs on every rank)."""

from moebench.cli.app import main

if __name__ == "__main__":
    main()

"""`python -m moebench ...` (also what `torchrun -m moebench ...` runs on every rank)."""

from moebench.entry import main

if __name__ == "__main__":
    main()

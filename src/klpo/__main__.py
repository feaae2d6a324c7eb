"""``python -m klpo ...``: the command line, also as ``torchrun -m klpo train ...``."""

from klpo.cli import main

if __name__ == "__main__":
    main()

"""``python -m klpo.cli ...``: the command line, as ``python -m klpo ...``."""

from klpo.cli import main

if __name__ == "__main__":
    main()

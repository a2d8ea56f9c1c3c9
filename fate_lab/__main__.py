"""Command line: ``python -m fate_lab {train,trace,...}``."""
from fate_lab.cli import main

if __name__ == "__main__":
    main()

"""``python -m gdngen``: the ``gdngen`` command line (`gdngen.tools.cli`)."""

from gdngen.tools.cli import main

if __name__ == "__main__":
    main()

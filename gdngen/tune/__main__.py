"""``python -m gdngen.tune --worker``: a trial subprocess (`gdngen.tune.worker`)."""

import sys

from gdngen.tune.worker import _worker_main

if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        sys.exit(_worker_main())
    sys.exit("usage: python -m gdngen.tune --worker  (internal; use `gdngen tune`)")

"""``python -m gdngen.tune --worker``: a trial subprocess (`gdngen.tune.worker`)."""

import sys

from gdngen import jaxcompat

if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        # as `gdngen tune` does (for a worker a library caller started), before jax is imported
        jaxcompat.host_settings()
        from gdngen.tune.worker import _worker_main

        sys.exit(_worker_main())
    sys.exit("usage: python -m gdngen.tune --worker  (internal; use `gdngen tune`)")

"""``python -m server [flags]`` is ``ferry serve [flags]``."""

import sys

from server.cli import serve

if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))

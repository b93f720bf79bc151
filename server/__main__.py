"""``python -m server [flags]`` is ``ferry serve [flags]``."""

import sys

from server.cli import exit_now, serve

if __name__ == "__main__":
    exit_now(serve(sys.argv[1:]))

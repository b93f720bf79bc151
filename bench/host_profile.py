"""Host-side (Python) profile of a ferry command: ``python -m bench.host_profile MODULE ARGS``.

Runs ``MODULE.main(ARGS)`` under cProfile and prints the 30 functions with the most own time,
to see whether a step is bound by Python on the host rather than by the device.
"""

import cProfile
import importlib
import pstats
import sys


def main() -> None:
    mod = importlib.import_module(sys.argv[1])
    prof = cProfile.Profile()
    prof.enable()
    try:
        mod.main(sys.argv[2:])
    finally:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()

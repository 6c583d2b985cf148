"""`met serve` whose engine step raises once a prompt containing CRASH_ENGINE was added
(reliability case 24: the engine loop killed from inside)."""

import sys

from engine_faults import inject, serve


def crash() -> None:
    raise RuntimeError("injected engine failure")


inject("CRASH_ENGINE", crash)

if __name__ == "__main__":
    sys.exit(serve())

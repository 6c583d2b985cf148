"""`met serve` whose engine step hangs for STALL_SECONDS once a prompt containing STALL_ENGINE was
added (reliability case 24: a stalled scheduler)."""

import sys
import time

from engine_faults import inject, serve

STALL_SECONDS = 4.0

inject("STALL_ENGINE", lambda: time.sleep(STALL_SECONDS))

if __name__ == "__main__":
    sys.exit(serve())

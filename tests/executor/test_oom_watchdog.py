"""The OOM watchdog exits after three low readings in a row, and only then."""

import threading

from metrale.executor.oom_watchdog import OomWatchdog


def run(readings_mib, threshold_mib=100):
    values = iter(readings_mib)
    exited = threading.Event()
    codes = []

    def read():
        try:
            return next(values) << 20
        except StopIteration:
            exited.set()
            return 10**12

    def exit(code):
        codes.append(code)
        exited.set()

    dog = OomWatchdog(read, threshold_mib, lambda: {"weights_bytes": 1}, interval_s=0.001, exit=exit)
    dog.start()
    exited.wait(5)
    dog.stop()
    return codes


def test_three_low_readings_in_a_row_exit_with_status_1():
    assert run([500, 50, 40, 30]) == [1]


def test_a_recovery_resets_the_count():
    assert run([50, 40, 500, 30, 20, 500, 10]) == []

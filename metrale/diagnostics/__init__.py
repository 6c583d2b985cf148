"""Diagnostics: tools that say where met's numbers part from a reference (docs/diagnostics.md).

`met circuit diff` (circuit.py) runs met's forward and transformers' on one checkpoint and
compares them tap by tap (taps.py records, report.py compares). This package sits beside
`bench`: it may import startup and everything below, and nothing below imports it. Its modules
import torch only inside functions where `met --help` reads them.
"""

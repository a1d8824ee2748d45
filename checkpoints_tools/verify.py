"""Logit parity between a HF model and a megarl checkpoint (PASS/FAIL). See docs/conversion.md."""

import sys

from megarl.convert.cli import verify_main

if __name__ == "__main__":  # required: checkpoint saving and multi-rank runs spawn processes
    sys.exit(verify_main())

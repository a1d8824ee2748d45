"""HF checkpoint -> megarl (Megatron distributed) checkpoint. See docs/conversion.md."""

import sys

from megarl.convert.cli import hf_to_megatron_main

if __name__ == "__main__":  # required: checkpoint saving and multi-rank runs spawn processes
    sys.exit(hf_to_megatron_main())

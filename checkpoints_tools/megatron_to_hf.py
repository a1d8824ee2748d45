"""megarl (Megatron distributed) checkpoint -> HF directory. See docs/conversion.md."""

import sys

from megarl.convert.cli import megatron_to_hf_main

if __name__ == "__main__":  # required: checkpoint saving and multi-rank runs spawn processes
    sys.exit(megatron_to_hf_main())

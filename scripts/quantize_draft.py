#!/usr/bin/env python
"""Write an int8 (compressed-tensors W8A8) copy of a draft model: see vllm_gsd/quantize_draft.py.

    .venv/bin/python scripts/quantize_draft.py SRC_DIR DST_DIR
"""

import sys

from vllm_gsd.quantize_draft import main

if __name__ == "__main__":
    sys.exit(main())

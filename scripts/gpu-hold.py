#!/usr/bin/env python3
"""A process siesta does not run, holding GPU memory (torch on the GPU machine).

    python3 scripts/gpu-hold.py GIB SECONDS

Takes GIB GiB of GPU 0, prints "held" once it has them, and keeps them for
SECONDS (or until killed). Used by scripts/vllm-check crowded and
scripts/gpu-check.d/foreign.sh.
"""
import sys
import time

import torch

x = torch.empty(int(sys.argv[1]) << 30, dtype=torch.uint8, device="cuda:0")
print("held", flush=True)
time.sleep(float(sys.argv[2]))

#!/usr/bin/env python
"""Entry point of the TorchAcc-style recipes; all logic lives in ``torchacc/launch.py``.

    python launch_single_task.py --nproc_per_node=1 --amp_level=O1 --batch_size=128  # baseline
    python launch_single_task.py --nproc_per_node=8 --amp_level=O1 --compiler-opt --batch_size=128

``python launch_single_task.py --help`` lists every flag.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Loads torchacc/launch.py without importing the torchacc package (the compiler core is imported
# by the workers only with --compiler-opt).
from gallery.common.launchlib import torchacc_launch  # noqa: E402

if __name__ == "__main__":
    sys.exit(torchacc_launch().main())

"""Test-wide settings: Triton kernels run under the interpreter on CPU, invariant checks are on."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SPECDEC_CHECK_INVARIANTS", "1")

import torch  # noqa: E402

# tiny models gain nothing from threads, and oversubscribed OpenMP threads crawl on a shared 2-core box
torch.set_num_threads(1)

from __future__ import annotations

import os

# Model compute runs in one worker thread; one torch thread keeps it fast and predictable here.
os.environ.setdefault("OMP_NUM_THREADS", "1")

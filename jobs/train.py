"""Train on a Ray cluster as a Ray job; the same arguments as `elastic-train train`.

    ray job submit --address http://HEAD:8265 --working-dir . -- \
        python jobs/train.py --config jobs/configs/gpu.yaml run.name=my-run optim.lr=1e-3

Works without `pip install` on the cluster: the working dir (this repository) goes on sys.path.
Exits with the command line's status: 0 finished, 1 run failed, 2 bad input (`error: ...`),
128 + the signal when stopped (143: `ray job stop`'s SIGTERM, 130: Ctrl-C).
"""

import sys
from pathlib import Path

# --working-dir puts the repository first on sys.path already; this also covers a plain
# `python jobs/train.py` from anywhere.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic_train.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

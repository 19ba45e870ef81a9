"""Train from your own Python script: load a config, override what you need, call `train`.

    python examples/driver.py                                   # a local Ray cluster
    RAY_ADDRESS=HEAD_IP:6379 python examples/driver.py          # join a running cluster
    python examples/driver.py --config jobs/configs/gpu.yaml run.name=gpt-2 optim.lr=3e-4

With RAY_ADDRESS (or run.address) set, `train` joins that cluster; this script's process is then the
driver, so run it on a node of the cluster (or submit it with `ray job submit`).
"""

import argparse
import json
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # works without pip install

from elastic_train import ConfigError, load_config, train  # noqa: E402
from elastic_train.api import TrainingFailed, TrainingStopped  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "jobs" / "configs" / "smoke.yaml"))
    parser.add_argument("overrides", nargs="*", help="dotted.key=value")
    args = parser.parse_intermixed_args(argv)  # overrides on both sides of --config
    try:
        cfg = load_config(args.config, args.overrides)
        result = train(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as exc:  # bad input: one line, as cli.py
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainingStopped as exc:
        print(f"stopped: {exc}", file=sys.stderr)
        return 128 + getattr(signal, exc.signal_name)
    except TrainingFailed as exc:  # summary.json in the run folder has the details
        print(f"error: run failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.summary, indent=2))
    print(f"run folder: {result.run_dir}\nlast checkpoint: {result.checkpoint_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

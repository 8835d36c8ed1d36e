"""Same program as `uv run grail-train`:

uv run python scripts/offline_trainer/run_offline_grpo.py [overrides]
"""

from grail.train.cli import main

if __name__ == "__main__":
    main()

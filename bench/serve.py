"""Entry point: `python -m bench.serve [--url URL | --systems ...] [--sweep 1,2,4] --slo ttft:MS,tpot:MS`.

Same arguments as `ferry bench serve` (see bench/loadgen/cli.py for the mental model and defaults).
"""

from __future__ import annotations

import sys

from bench.loadgen.cli import main

if __name__ == "__main__":
    sys.exit(main())

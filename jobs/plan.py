"""Plan a config on a cluster before allocating it: memory per device by term, the step, the run's cost.

    python -m jobs.plan CONFIG [section.field=value ...] --cluster NODESxGPUSxTYPE [--mfu 0.4] [--tokens N]
                               [--cpu-flops F] [--json]

Types: H100, H200, H800, H20, B200, A100-80G, A100-40G, L40S, L4, A10G, T4, V100, P100, P4, K80, and cpu
(this machine, its peak measured unless --cpu-flops).
Exit 0 when the config fits, 1 when it does not (the reason and the cheapest change that fits are
printed), 2 on a bad config or argument.
"""

from __future__ import annotations

import argparse
import json
import sys

from pipeline.config import ConfigError, load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jobs.plan", description=__doc__.splitlines()[0])
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. train.zero_stage=3")
    p.add_argument("--cluster", required=True, help="NODESxGPUSxTYPE, e.g. 8x8xH100 or 1x2xcpu")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
    p.add_argument("--tokens", type=float, help="a token budget to cost as well as train.steps")
    p.add_argument("--cpu-flops", type=float, help="the cpu type's peak FLOP/s (default: measured here)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    from pipeline.plan.hardware import parse_cluster
    from pipeline.plan.report import as_json, plan, render

    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        cluster = parse_cluster(args.cluster, args.cpu_flops)
        result = plan(cfg, cluster, args.mfu, None if args.tokens is None else int(args.tokens))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(as_json(result), indent=1) if args.json else render(result))
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())

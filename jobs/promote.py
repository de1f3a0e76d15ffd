"""Move an alias (``champion``) to a registered model version when it passes the promotion gates.

    python -m jobs.promote NAME [--from challenger] [--to champion] [--version N]
                           [--force --reason "..."] [--config configs/demo.yaml] [--tracking-uri URI]
    python -m jobs.promote NAME --rollback [--to champion] [--reason "..."]

Gates come from the config's ``promote`` section (``pipeline.serving.promotion``). A failed gate prints the
comparison table and exits 1 unless ``--force --reason`` is given, which is recorded on the version.
Every promotion tags the version with who, when and the previous holder; promoting the version that
already holds the alias changes nothing. ``--rollback`` moves the alias back to the version it replaced
(the holder's ``promotion.<alias>.previous_version`` tag; no gates). After the alias moves, a Ray Serve
deployment that follows it (``jobs.deploy``) is rolled over to the new holder, after it has started if it
was starting (``pipeline.serving.deploy.follow``); the last line says which.
Exit status: 0 promoted or already there, 1 refused or the deployment could not follow, 2 usage.
"""

from __future__ import annotations

import argparse
import datetime
import getpass
import sys

from pipeline import tracking
from pipeline.serving import deploy, promotion
from pipeline.cluster import ClusterError
from pipeline.config import ConfigError, load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jobs.promote", description=__doc__.splitlines()[0])
    p.add_argument("name", help="registered model name, e.g. conduit-demo")
    p.add_argument("--from", dest="from_alias", default="challenger", help="alias of the candidate version")
    p.add_argument("--to", dest="to_alias", default="champion", help="alias to move")
    p.add_argument("--version", type=int, help="promote this version number instead of --from's")
    p.add_argument("--force", action="store_true", help="promote even when a gate fails (needs --reason)")
    p.add_argument("--reason", help="why the gates are overridden (or why the rollback); recorded as a tag")
    p.add_argument("--rollback", action="store_true",
                   help="move --to back to the version its holder replaced (no gates)")
    p.add_argument("--config", help="YAML config whose promote section holds the gates (default: built-in)")
    p.add_argument("--tracking-uri", help="MLflow tracking/registry URI (default: the config's)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rollback:
        return rollback(args)
    if args.force and not (args.reason and args.reason.strip()):
        print("error: --force needs --reason \"...\" (it is recorded on the version)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config)
        uri = args.tracking_uri or cfg.tracking_uri()
        if args.version is not None:
            candidate = tracking.get_version(uri, args.name, args.version)
        else:
            candidate = tracking.version_by_alias(uri, args.name, args.from_alias)
            if candidate is None:
                raise LookupError(f"model {args.name!r} has no alias {args.from_alias!r} (at {uri})")
        current = tracking.version_by_alias(uri, args.name, args.to_alias)
        cand_metrics = promotion.metrics_from_tags(candidate.tags)
        champ_metrics = None if current is None else promotion.metrics_from_tags(current.tags)
        results = promotion.check_gates(cfg.promote, cand_metrics, champ_metrics)
    except (ConfigError, LookupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ref = f"{args.name} v{candidate.version}"
    if current is not None and current.version == candidate.version:
        print(f"{ref} already holds @{args.to_alias}; nothing changed")
        return 0
    print(promotion.comparison_table(candidate.version, None if current is None else current.version,
                                     results, cand_metrics, champ_metrics))
    failed = [r.rule for r in results if not r.passed]
    if failed and not args.force:
        print(f"refused: {ref} fails {len(failed)} gate(s): {'; '.join(failed)}. "
              "Use --force --reason \"...\" to promote anyway.", file=sys.stderr)
        return 1
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    tracking.set_version_tags(uri, args.name, candidate.version, promotion.promotion_tags(
        args.to_alias, who=getpass.getuser(), when=when, previous=None if current is None else current.version,
        forced=args.force, reason=args.reason, results=results))
    if current is not None:
        tracking.set_version_tags(uri, args.name, current.version,
                                  promotion.replaced_tags(args.to_alias, by_version=candidate.version, when=when))
    tracking.set_alias(uri, args.name, args.to_alias, candidate.version)
    forced = " (forced: gates failed)" if failed else ""
    print(f"promoted {ref} to @{args.to_alias}{forced}; previous: "
          f"{'none' if current is None else 'v' + str(current.version)}")
    return 0 if current is None else follow(uri, args.name, args.to_alias, current.version, candidate.version)


def rollback(args: argparse.Namespace) -> int:
    """Move ``--to`` back to the version its holder replaced; the deployment follows."""
    try:
        uri = args.tracking_uri or load_config(args.config).tracking_uri()
        current = tracking.version_by_alias(uri, args.name, args.to_alias)
        if current is None:
            raise LookupError(f"model {args.name!r} has no alias {args.to_alias!r} to roll back (at {uri})")
        previous = current.tags.get(f"promotion.{args.to_alias}.previous_version", "none")
        if not previous.isdigit():
            raise LookupError(f"{args.name} v{current.version} holds @{args.to_alias} but replaced no version "
                              f"(promotion.{args.to_alias}.previous_version={previous!r}): nothing to roll back to")
        target = tracking.get_version(uri, args.name, int(previous))
    except (ConfigError, LookupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    tracking.set_version_tags(uri, args.name, target.version, promotion.rollback_tags(
        args.to_alias, who=getpass.getuser(), when=when, from_version=current.version, reason=args.reason))
    tracking.set_version_tags(uri, args.name, current.version,
                              promotion.replaced_tags(args.to_alias, by_version=target.version, when=when))
    tracking.set_alias(uri, args.name, args.to_alias, target.version)
    print(f"rolled @{args.to_alias} back from {args.name} v{current.version} to v{target.version}")
    return follow(uri, args.name, args.to_alias, current.version, target.version)


def follow(uri: str, name: str, alias: str, previous: int, new: int) -> int:
    """Bring the deployment that follows ``alias`` to ``new`` (waiting for one that is starting); 0 when
    done or when there is none, 1 (with what to run) when it could not follow."""
    try:
        f = deploy.follow(uri, name, alias, new, notify=lambda line: print(line, flush=True))
    except (ClusterError, deploy.DeployError) as e:
        print(f"error: @{alias} now points at v{new}, but the deployment that served v{previous} did not "
              f"follow: {e}. Redeploy with: python -m jobs.deploy {name}@{alias} --address ADDRESS", file=sys.stderr)
        return 1
    if f is None:
        return 0
    d = f.deployment
    if f.rolled:
        print(f"deployment {d.app} rolled over to v{d.version} ({d.status}) at {d.endpoint}"
              + ("" if f.waited_s is None else f", after waiting {f.waited_s:.0f} s for it to start"))
    elif f.waited_s is not None:
        print(f"deployment {d.app} serves v{d.version} ({d.status}) at {d.endpoint}: it was starting when "
              f"@{alias} moved, and started on v{d.version}")
    else:
        print(f"deployment {d.app} already serves v{d.version} ({d.status}) at {d.endpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

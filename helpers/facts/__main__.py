"""``python -m helpers.facts [ID ...]``: check the guide's library facts, one line each; exit 1 if one fails.

``--list`` prints the registry without checking; ``--json ID ...`` (used by ``helpers.facts.check``) checks in
this process and prints one JSON verdict a line.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from . import _run_one, check, line, load, one_rank_group


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helpers.facts", description=__doc__.splitlines()[0])
    ap.add_argument("ids", nargs="*", help="fact ids (default: all)")
    ap.add_argument("--list", action="store_true", help="list the facts without checking them")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    facts = load()
    unknown = [i for i in a.ids if i not in facts]
    if unknown:
        print(f"facts: no fact {', '.join(unknown)}; see python -m helpers.facts --list", file=sys.stderr)
        return 2
    ids = a.ids or list(facts)
    if a.list:
        for i in ids:
            f = facts[i]
            kind = "GPU only" if f.gpu_only else ("built" if f.runs else "read")
            print(f"{i:48s} {f.library:12s} {kind:8s} {f.says}")
        return 0
    if a.json:
        if any(facts[i].runs for i in ids):
            one_rank_group()
        # the reading checks first: a building one can leave a library patched (ZeRO-3 swaps torch's linear)
        for i in sorted(ids, key=lambda i: facts[i].runs):
            print(json.dumps(asdict(_run_one(facts[i]))), flush=True)
        return 0
    verdicts = check(ids, cache=False)
    for i, v in verdicts.items():
        print(line(facts[i], v))
    bad = [i for i, v in verdicts.items() if v.holds is False]
    n_gpu = sum(v.holds is None for v in verdicts.values())
    print(f"{len(verdicts) - len(bad) - n_gpu} hold, {len(bad)} fail, {n_gpu} GPU-only (not run here)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

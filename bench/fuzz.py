#!/usr/bin/env python3
"""Fuzzing shoald's API, the long version: runs tests/daemon/test_fuzz.py (schemathesis over TLS)
with more examples per operation and writes what ran to bench/results/fuzz.json.

The test module is run as it is (a real shoald subprocess, TLS, a fuzzing tenant with quotas);
this script only sets SHOAL_FUZZ_EXAMPLES and reads pytest's JUnit report:

  operations   the API's operations (method + path) in shoald's OpenAPI spec
  cases        (operation, mode) pairs: every operation with schema-valid input, and those whose
               schema can be violated with schema-violating input too; admin routes are fuzzed
               again with the admin key (admin_cases)
  examples     hypothesis' max_examples per case (an upper bound: small input spaces run fewer)
  outcomes     passed / failed / skipped per case; a failure is any 5xx or an error without a message

  python bench/fuzz.py --examples 400
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))
RESULTS = HERE / "results"


def operations() -> list[str]:
    from shoal.server.app import create_app

    spec = create_app(None).openapi()
    return sorted(f"{m.upper()} {p}" for p, ops in spec["paths"].items() for m in ops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=400, help="max examples per operation and mode")
    ap.add_argument("--out", default=str(RESULTS / "fuzz.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        junit = Path(d) / "junit.xml"
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={junit}", "tests/daemon/test_fuzz.py"], cwd=REPO,
                              env={**os.environ, "SHOAL_FUZZ_EXAMPLES": str(args.examples)},
                              capture_output=True, text=True, check=False)
        wall = time.monotonic() - t0
        cases = []
        for tc in ET.parse(junit).getroot().iter("testcase"):
            name = tc.get("name", "")
            outcome = "failed" if tc.find("failure") is not None or tc.find("error") is not None else \
                "skipped" if tc.find("skipped") is not None else "passed"
            case = {"name": name, "outcome": outcome, "seconds": round(float(tc.get("time", 0)), 2)}
            bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
            if bad is not None:  # what failed: the request, the answer, a curl line to replay it
                case["failure"] = (bad.get("message", "") + "\n" + (bad.text or ""))[-3000:]
            cases.append(case)
    fuzz_cases = [c for c in cases if c["name"].startswith("test_fuzzed")]  # tenant and admin routes
    ops = operations()
    count = {k: sum(c["outcome"] == k for c in fuzz_cases) for k in ("passed", "failed", "skipped")}
    res = {"date": time.strftime("%Y-%m-%d"), "script": "bench/fuzz.py", "test": "tests/daemon/test_fuzz.py",
           "examples_per_case": args.examples, "operations": len(ops), "operation_names": ops,
           "cases": len(fuzz_cases),
           "positive_cases": sum(c["name"].endswith("positive]") for c in fuzz_cases),
           "negative_cases": sum(c["name"].endswith("negative]") for c in fuzz_cases),
           "admin_cases": sum(c["name"].startswith("test_fuzzed_admin") for c in fuzz_cases),
           **{f"cases_{k}": v for k, v in count.items()},
           "other_tests": [c for c in cases if not c["name"].startswith("test_fuzzed")],
           "pytest_exit_code": proc.returncode, "wall_s": round(wall, 1),
           "summary_line": (proc.stdout.strip().splitlines() or [""])[-1], "per_case": fuzz_cases}
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("per_case", "operation_names")}, indent=2))
    print(f"wrote {args.out}")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()

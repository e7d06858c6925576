"""The dependency audit `make test` runs first: pip-audit over the pinned requirements.

Known vulnerabilities in a pinned version fail the run (exit 1), listed with their ids and fixed
versions. Where the vulnerability service cannot be reached (a machine without network), it prints one
notice and passes, as does a package the service does not know. CHATLOOM_SKIP_AUDIT=1 skips it.
Requirement files given as arguments are audited instead of the project's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ("requirements.txt", "requirements-dev.txt")


def main(argv: list[str] | None = None) -> int:
    files = (argv if argv is not None else sys.argv[1:]) or [str(ROOT / name) for name in REQUIREMENTS]
    if os.environ.get("CHATLOOM_SKIP_AUDIT") == "1":
        print("dependency audit: skipped (CHATLOOM_SKIP_AUDIT=1)", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "audit.json"
        command = [sys.executable, "-m", "pip_audit", "--disable-pip", "--no-deps", "--progress-spinner", "off",
                   "-f", "json", "-o", str(report), "--timeout", "20"]
        for name in files:
            command += ["-r", name]
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"dependency audit: skipped, pip-audit could not run ({exc})", file=sys.stderr)
            return 0
        if not report.is_file() or not report.read_text().strip():
            reason = (run.stderr.strip().splitlines() or ["no report"])[-1]
            print(f"dependency audit: skipped, the vulnerability service could not be reached ({reason})",
                  file=sys.stderr)
            return 0
        found = json.loads(report.read_text())
    dependencies = found.get("dependencies", [])
    vulnerable = [d for d in dependencies if d.get("vulns")]
    unknown = [d["name"] for d in dependencies if d.get("skip_reason")]
    if dependencies and len(unknown) == len(dependencies):
        print(f"dependency audit: skipped, the vulnerability service answered for none of the "
              f"{len(dependencies)} pinned packages (is it reachable from here?)", file=sys.stderr)
        return 0
    if unknown:
        print(f"dependency audit: {len(unknown)} packages could not be looked up: {', '.join(unknown)}",
              file=sys.stderr)
    for dep in vulnerable:
        for vuln in dep["vulns"]:
            fixed = ", ".join(vuln.get("fix_versions") or []) or "no fixed version yet"
            print(f"dependency audit: {dep['name']} {dep['version']}: {vuln['id']} (fixed in: {fixed})",
                  file=sys.stderr)
    audited = len(dependencies) - len(unknown)
    print(f"dependency audit: {audited} pinned packages checked, {len(vulnerable)} with known vulnerabilities",
          file=sys.stderr)
    return 1 if vulnerable else 0


if __name__ == "__main__":
    sys.exit(main())

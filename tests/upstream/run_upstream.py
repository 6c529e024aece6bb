#!/usr/bin/env python
"""Run torch's own test suites stock and with dynamo_ext enabled, and compare.

Each suite runs twice, one after the other, with pytest in a subprocess whose
working directory is the torch ``test/`` directory given by ``--tests-dir``:

* stock:   plain pytest; dynamo_ext is never imported;
* enabled: the same command plus ``-p dynamo_ext_plugin``, which calls
  ``dynamo_ext.enable()`` at session start (and in processes the tests spawn).

Outcomes are read from pytest's JUnit XML (from the ``-v`` log when a run hit
its timeout and wrote none). For every suite the script prints a markdown table
of passed / failed / skipped / xfailed / errors for the two runs and lists
every test whose outcome differs.

Example::

    python tests/upstream/run_upstream.py --tests-dir ~/pytorch/test \\
        dynamo/test_subclasses.py distributed/tensor/test_dtensor_compile.py \\
        --select 'functorch/test_aotdispatch.py=subclass or Subclass'

``PYTORCH_TEST_WITH_DYNAMO`` and ``PYTORCH_TEST_WITH_INDUCTOR`` are removed
from the environment of both runs, and each run gets a fresh inductor cache
directory so that neither reuses the other's compiled artifacts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))

OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error", "crashed")
# Worst first: a test reported twice (a call failure and a teardown error, say)
# keeps the worst outcome. "crashed": the pytest process died while running it.
_RANK = {o: i for i, o in enumerate(("crashed", "error", "failed", "xpassed", "xfailed", "skipped", "passed"))}

MODES = ("stock", "enabled")


@dataclasses.dataclass
class RunResult:
    mode: str
    returncode: int | None  # None: killed at the timeout
    wall_s: float
    outcomes: dict[str, str]  # test id -> outcome
    messages: dict[str, str]  # test id -> first line of the failure / skip message
    source: str  # "junitxml" or "log"
    log_path: str
    crashed: list[str] = dataclasses.field(default_factory=list)  # pytest node ids

    def counts(self) -> dict[str, int]:
        c = dict.fromkeys(OUTCOMES, 0)
        for o in self.outcomes.values():
            c[o] += 1
        return c


def _worse(a: str | None, b: str) -> str:
    if a is None:
        return b
    return a if _RANK[a] <= _RANK[b] else b


def _first_line(text: str | None) -> str:
    if not text:
        return ""
    text = text.strip()
    return text.splitlines()[0][:300] if text else ""


def parse_junit(path: str) -> tuple[dict[str, str], dict[str, str]]:
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        classname = case.get("classname", "")
        name = case.get("name", "")
        tid = f"{classname}::{name}" if classname else name
        outcome = "passed"
        msg = ""
        for child in case:
            if child.tag == "failure":
                o, m = "failed", child.get("message") or child.text
            elif child.tag == "error":
                o, m = "error", child.get("message") or child.text
            elif child.tag == "skipped":
                if child.get("type") == "pytest.xfail":
                    o = "xfailed"
                else:
                    o = "skipped"
                m = child.get("message") or child.text
            else:
                continue
            if _RANK[o] < _RANK[outcome]:
                outcome, msg = o, _first_line(m)
        outcomes[tid] = _worse(outcomes.get(tid), outcome)
        if msg and tid not in messages:
            messages[tid] = msg
    return outcomes, messages


_VLINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR)\b")
_VMAP = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "XFAIL": "xfailed",
         "XPASS": "xpassed", "ERROR": "error"}


_STARTED = re.compile(r"^(\S+\.py::\S+) ")


def parse_verbose_log(path: str) -> tuple[dict[str, str], str | None]:
    """Outcomes from pytest -v progress lines (used when a run was killed or
    crashed), and the node id of the test that was running when it stopped."""
    outcomes: dict[str, str] = {}
    last_started: str | None = None
    with open(path, errors="replace") as f:
        for line in f:
            m = _VLINE.match(line)
            if m:
                tid = m.group(1)
                outcomes[tid] = _worse(outcomes.get(tid), _VMAP[m.group(2)])
                last_started = None
                continue
            m = _STARTED.match(line)
            if m and m.group(1) not in outcomes:
                last_started = m.group(1)
    return outcomes, last_started


def _junit_id_from_nodeid(nodeid: str) -> str:
    # "dynamo/test_x.py::Cls::test" -> "dynamo.test_x.Cls::test", the JUnit form.
    parts = nodeid.split("::")
    mod = parts[0][:-3] if parts[0].endswith(".py") else parts[0]
    mod = mod.replace("/", ".")
    if len(parts) == 2:
        return f"{mod}::{parts[1]}"
    return f"{mod}.{'.'.join(parts[1:-1])}::{parts[-1]}"


def _run_pytest(
    suite: str,
    mode: str,
    attempt: int,
    *,
    tests_dir: str,
    out_dir: str,
    timeout: float,
    kexpr: str | None,
    extra_args: list[str],
    dynamo_ext_root: str,
) -> RunResult:
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", suite) + "." + mode + (f".resume{attempt}" if attempt else "")
    xml_path = os.path.join(out_dir, tag + ".xml")
    log_path = os.path.join(out_dir, tag + ".log")
    cache_dir = os.path.join(out_dir, tag + ".inductor_cache")
    for p in (xml_path, log_path):
        if os.path.exists(p):
            os.remove(p)
    shutil.rmtree(cache_dir, ignore_errors=True)

    cmd = [sys.executable, "-m", "pytest", suite, "-p", "no:cacheprovider", "-v", "-rA",
           f"--junitxml={xml_path}"]
    if kexpr:
        cmd += ["-k", kexpr]
    if mode == "enabled":
        cmd += ["-p", "dynamo_ext_plugin"]
    cmd += extra_args

    env = dict(os.environ)
    for var in ("PYTORCH_TEST_WITH_DYNAMO", "PYTORCH_TEST_WITH_INDUCTOR", "DYNAMO_EXT_UPSTREAM_ENABLE"):
        env.pop(var, None)
    path = [dynamo_ext_root, HERE]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir

    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    wall = time.monotonic() - t0
    shutil.rmtree(cache_dir, ignore_errors=True)

    crashed: list[str] = []
    if rc is not None and os.path.exists(xml_path):
        outcomes, messages = parse_junit(xml_path)
        source = "junitxml"
    else:
        log_outcomes, running = parse_verbose_log(log_path)
        outcomes = {_junit_id_from_nodeid(k): v for k, v in log_outcomes.items()}
        messages = {}
        source = "log"
        if rc is not None and running is not None:  # the process died in this test
            crashed.append(running)
            tid = _junit_id_from_nodeid(running)
            outcomes[tid] = "crashed"
            messages[tid] = f"pytest process died (exit {rc}) while running this test; see {log_path}"
    return RunResult(mode, rc, wall, outcomes, messages, source, log_path, crashed)


def run_suite(
    suite: str,
    mode: str,
    *,
    max_resumes: int = 5,
    extra_args: list[str],
    **kw,
) -> RunResult:
    """One mode of one suite. When the pytest process dies in a test (a hard
    abort, say), that test is recorded as crashed and the session is started
    again with it deselected, so the tests after it still run; the outcomes
    are merged."""
    result = _run_pytest(suite, mode, 0, extra_args=extra_args, **kw)
    latest = result
    deselect: list[str] = []
    attempt = 0
    while latest.crashed and attempt < max_resumes:
        attempt += 1
        deselect += latest.crashed
        print(f"[run_upstream]   {mode} run died in {latest.crashed[0]}; resuming without it",
              file=sys.stderr, flush=True)
        more = latest = _run_pytest(suite, mode, attempt,
                                    extra_args=extra_args + [f"--deselect={d}" for d in deselect], **kw)
        merged = dict(result.outcomes)
        merged.update({t: o for t, o in more.outcomes.items()})
        messages = dict(result.messages)
        messages.update(more.messages)
        result = RunResult(mode, more.returncode, result.wall_s + more.wall_s, merged, messages,
                           more.source, more.log_path, result.crashed + more.crashed)
    return result


def _fmt_wall(s: float) -> str:
    m, sec = divmod(int(round(s)), 60)
    return f"{m}m{sec:02d}s"


def report(suite: str, kexpr: str | None, runs: dict[str, RunResult]) -> tuple[str, int]:
    lines = [f"### `{suite}`" + (f" (`-k '{kexpr}'`)" if kexpr else ""), ""]
    lines.append("| run | passed | failed | skipped | xfailed | xpassed | errors | crashed | total | wall | exit |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for mode in MODES:
        r = runs[mode]
        c = r.counts()
        exit_s = "timeout" if r.returncode is None else str(r.returncode)
        if r.crashed:
            exit_s += f" (after {len(r.crashed)} resumed session(s))"
        if r.source != "junitxml":
            exit_s += f" (outcomes from {r.source})"
        lines.append(
            f"| {mode} | {c['passed']} | {c['failed']} | {c['skipped']} | {c['xfailed']} | "
            f"{c['xpassed']} | {c['error']} | {c['crashed']} | {len(r.outcomes)} | {_fmt_wall(r.wall_s)} | {exit_s} |"
        )
    stock, enabled = runs["stock"], runs["enabled"]
    ids = sorted(set(stock.outcomes) | set(enabled.outcomes))
    diffs = [t for t in ids if stock.outcomes.get(t) != enabled.outcomes.get(t)]
    lines.append("")
    if diffs:
        lines.append(f"Tests whose outcome differs ({len(diffs)}):")
        lines.append("")
        lines.append("| test | stock | enabled | enabled message |")
        lines.append("|---|---|---|---|")
        for t in diffs:
            msg = enabled.messages.get(t, "").replace("|", "\\|")
            lines.append(f"| `{t}` | {stock.outcomes.get(t, 'absent')} | "
                         f"{enabled.outcomes.get(t, 'absent')} | {msg} |")
    else:
        lines.append("No test's outcome differs between the stock and the enabled run.")
    not_passing = sorted(t for t, o in stock.outcomes.items() if o in ("failed", "error", "crashed"))
    if not_passing:
        lines.append("")
        lines.append(f"Failing or erroring in the stock run too ({len(not_passing)}):")
        lines.append("")
        for t in not_passing:
            lines.append(f"- `{t}`: {stock.outcomes[t]}: {stock.messages.get(t, '')}")
    lines.append("")
    return "\n".join(lines), len(diffs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests-dir", required=True, help="a torch source test/ directory")
    ap.add_argument("suites", nargs="*", help="suite paths relative to --tests-dir")
    ap.add_argument("--select", action="append", default=[], metavar="SUITE=KEXPR",
                    help="run SUITE with -k KEXPR (SUITE need not be repeated as a positional)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per-run timeout in seconds (default 1800)")
    ap.add_argument("--out-dir", help="where logs and JUnit XML go (default: a new temporary directory)")
    ap.add_argument("--report", help="also write the markdown report to this file")
    ap.add_argument("--dynamo-ext-root", default=REPO_ROOT,
                    help="directory holding the dynamo_ext package to test (default: this checkout)")
    ap.add_argument("--max-resumes", type=int, default=5,
                    help="how many times a run that died in a test is resumed without it (default 5)")
    ap.add_argument("--pytest-arg", action="append", default=[], dest="pytest_args",
                    help="extra argument passed to both pytest runs (repeatable)")
    args = ap.parse_args(argv)

    tests_dir = os.path.abspath(os.path.expanduser(args.tests_dir))
    selections: dict[str, str | None] = {s: None for s in args.suites}
    for sel in args.select:
        suite, sep, expr = sel.partition("=")
        if not sep or not expr:
            ap.error(f"--select wants SUITE=KEXPR, got {sel!r}")
        selections[suite] = expr
    if not selections:
        ap.error("no suite given")
    for suite in selections:
        if not os.path.exists(os.path.join(tests_dir, suite)):
            ap.error(f"{suite} not found under {tests_dir}")
    out_dir = os.path.abspath(args.out_dir) if args.out_dir else tempfile.mkdtemp(prefix="upstream_runs_")
    os.makedirs(out_dir, exist_ok=True)
    dynamo_ext_root = os.path.abspath(args.dynamo_ext_root)

    sections = []
    total_diffs = 0
    t_all = time.monotonic()
    for suite, kexpr in selections.items():
        runs = {}
        for mode in MODES:
            print(f"[run_upstream] {suite} ({mode}) ...", file=sys.stderr, flush=True)
            runs[mode] = run_suite(suite, mode, tests_dir=tests_dir, out_dir=out_dir, timeout=args.timeout,
                                   kexpr=kexpr, extra_args=args.pytest_args, dynamo_ext_root=dynamo_ext_root,
                                   max_resumes=args.max_resumes)
            r = runs[mode]
            print(f"[run_upstream]   {r.counts()} in {_fmt_wall(r.wall_s)}, exit "
                  f"{'timeout' if r.returncode is None else r.returncode}; log {r.log_path}",
                  file=sys.stderr, flush=True)
        text, n = report(suite, kexpr, runs)
        total_diffs += n
        sections.append(text)
        print(text, flush=True)
    footer = (f"Total wall time {_fmt_wall(time.monotonic() - t_all)}; "
              f"{total_diffs} test(s) differ. Logs and JUnit XML: {out_dir}\n")
    print(footer)
    if args.report:
        with open(args.report, "w") as f:
            f.write("\n".join(sections) + "\n" + footer)
    return 1 if total_diffs else 0


if __name__ == "__main__":
    sys.exit(main())

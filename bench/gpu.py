"""Sections 1-3 of the suite on a CUDA device (one H200, torch 2.13 CUDA, inductor), sized to
finish within 8 minutes: the unused path, the replay cost of 1/4/16 constant and tensor
writes, and the workarounds on the block model and the DTensor tensor-parallel model
(fake process group), all with device='cuda'. Per-call timings synchronize the device at
the end of each timed window (calls enqueue work; the window measures throughput).

    python bench/gpu.py [--out DIR] [--budget-s 360]
    python bench/gpu.py --dry-run            # the same code path on CPU, tiny counts, ~1 min

Results: markdown, CSV and PNG per section plus ``gpu_report_<suffix>.md`` (all sections in
one file) in ``--out`` (default: $OUT if set, else bench/results/gpu). With ``--bundle``
(the default when writing to $OUT) the individual files are packed into
``gpu_results_<suffix>.tar.gz`` instead, so the directory holds three files: the report,
the archive and the log. Without CUDA (and without --dry-run) it exits with status 2 and
says so. No new section starts once --budget-s seconds have passed since start.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/gpu.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from bench import settings as presets
from bench.report import Writer, plots_available

SECTIONS = ("unused", "replay", "workarounds")


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for st in self.streams:
            st.write(text)
            st.flush()
        return len(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python bench/gpu.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=None, help="results directory (default $OUT, else bench/results/gpu)")
    p.add_argument("--dry-run", action="store_true", help="run the code path on CPU with tiny counts")
    p.add_argument("--backend", default=None, help="default: inductor (aot_eager with --dry-run)")
    p.add_argument(
        "--budget-s", type=float, default=None, help="start no new section after this long (default 360; 120 dry-run)"
    )
    p.add_argument(
        "--bundle",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pack the individual files into one archive (default: on when writing to $OUT)",
    )
    p.add_argument("--sections", default=",".join(SECTIONS))
    args = p.parse_args(argv)

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(
            f"bench/gpu.py needs a CUDA device: torch {torch.__version__} reports torch.cuda.is_available() = False "
            f"(CUDA build: {torch.version.cuda or 'none'}). Nothing was run. On this machine, "
            "`python bench/gpu.py --dry-run` runs the same code path on the CPU; "
            "`python -m bench` runs the CPU suite.",
            file=sys.stderr,
        )
        return 2

    if args.dry_run:
        s = presets.gpu_dry_run(args.backend or "aot_eager")
        s.sync = torch.cpu.synchronize  # the same calls as torch.cuda.synchronize on the GPU
    else:
        s = presets.gpu()
        if args.backend:
            s.backend = args.backend
        s.sync = torch.cuda.synchronize
    if args.budget_s is not None:
        s.budget_s = args.budget_s
    env_out = os.environ.get("OUT")
    out = args.out or (Path(env_out) if env_out else Path("bench/results/gpu"))
    bundle = args.bundle if args.bundle is not None else (args.out is None and bool(env_out))
    out.mkdir(parents=True, exist_ok=True)
    keys = [k.strip() for k in args.sections.split(",") if k.strip()]

    with open(out / f"gpu_log_{s.suffix}.txt", "w") as log:
        stream = _Tee(sys.stdout, log)
        return _run(s, keys, out, bundle, lambda text: stream.write(text + "\n"))


def _run(s, keys, out: Path, bundle: bool, echo) -> int:
    import torch

    from bench.runner import run_sections, setup

    t0 = time.perf_counter()
    s.started = t0
    setup(s)
    if s.device == "cuda":
        echo(f"device: {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}, torch {torch.__version__}")
    files_dir = Path(tempfile.mkdtemp(prefix="bench_gpu_")) if bundle else out
    s.out = files_dir
    writer = Writer(files_dir, s, plots_available())
    done = run_sections(s, keys, writer, echo=echo)
    total = time.perf_counter() - t0

    report = [f"# GPU run ({s.mode}), {total:.0f} s", ""]
    report += [writer.section_markdown(sec) for sec in done]
    skipped = [k for k in keys if k not in {sec.key for sec in done}]
    if skipped:
        report += ["", f"Not run (time budget): {', '.join(skipped)}"]
    (out / f"gpu_report_{s.suffix}.md").write_text("\n\n".join(report) + "\n")
    if bundle:
        with tarfile.open(out / f"gpu_results_{s.suffix}.tar.gz", "w:gz") as tar:
            for f in sorted(files_dir.iterdir()):
                tar.add(f, arcname=f"gpu_results_{s.suffix}/{f.name}")
        shutil.rmtree(files_dir, ignore_errors=True)
    problems = [f"{sec.title}: {x}" for sec in done for x in sec.problems]
    echo(f"\n{len(done)} section(s) in {total:.0f} s; results in {out}/")
    for x in problems:
        echo(f"check failed: {x}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""Running sections: the setup every run shares, and the loop that runs and reports them.
(``python -m bench``'s entry point is ``__main__``; ``bench_*`` scripts and ``gpu.py`` use this.)"""

from __future__ import annotations

import time
import traceback

from .report import SectionResult, Writer

SECTIONS = ("unused", "replay", "workarounds", "scaling", "profile", "counters")


def _section_module(key: str):
    if key == "unused":
        from . import unused as m
    elif key == "replay":
        from . import bench_writes as m
    elif key == "workarounds":
        from . import workarounds as m
    elif key == "scaling":
        from . import scaling as m
    elif key == "profile":
        from . import profile_calls as m
    elif key == "counters":
        from . import counters as m
    else:
        raise KeyError(key)
    return m


def setup(s) -> None:
    import warnings

    import torch

    # Expected with caches off, and for the benchmark's own subclasses: not news in a report.
    warnings.filterwarnings("ignore", message=".*dynamo_pgo force disabled.*")
    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")

    if s.device == "cpu":
        torch.set_num_threads(1)
    # Every compile cold: no inductor FX-graph or AOTAutograd cache entry reused across
    # variants (dynamo_ext bypasses AOTAutogradCache for subclass inputs; stock would not).
    torch.compiler.config.force_disable_caches = True
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096


def run_sections(s, keys, writer: Writer, echo=print) -> list[SectionResult]:
    import torch

    import dynamo_ext

    done = []
    for key in keys:
        if s.time_left() <= 0:
            echo(f"\n[{key}] skipped: the time budget is spent")
            break
        t0 = time.perf_counter()
        try:
            sec = _section_module(key).run(s)
        except Exception as e:  # report and go on: the other sections still run
            sec = SectionResult(key, f"{key} (crashed)")
            sec.problems.append(f"{type(e).__name__}: {e}")
            sec.texts.append((f"{key}_{s.suffix}_traceback.txt", traceback.format_exc()))
        finally:
            dynamo_ext.disable()
            torch._dynamo.reset()
        sec.seconds = time.perf_counter() - t0
        echo("\n" + writer.write_section(sec))
        done.append(sec)
    return done

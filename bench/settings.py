"""Rep counts and sizes of one suite run: ``quick`` (CI smoke), ``full``, and the GPU presets."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path


def _no_sync() -> None:
    pass


@dataclasses.dataclass
class Settings:
    mode: str = "full"  # "quick" | "full" | "gpu" | "gpu-dry-run"
    backend: str = "aot_eager"
    device: str = "cpu"
    out: Path = Path("bench/results")
    # Per call: interleaved rounds, and how long one variant runs in one round.
    rounds: int = 31
    round_s: float = 0.03
    # Cold compiles per variant: the unused path (ratio targets), the other compile figures.
    compile_reps: int = 41
    compile_reps_small: int = 9
    compile_warmup: int = 1  # throwaway compiles before timing cold compiles
    compile_budget_s: float | None = None  # no new round of cold compiles after this long
    # Section 2: writes per call.
    write_counts: tuple[int, ...] = (1, 4, 16)
    # Section 3: the block model and the TP model.
    model_blocks: int = 4
    model_rounds: int = 21
    tp_layers: int = 4
    tp_rounds: int = 15
    tp_steps: int = 5
    tp_train: bool = True
    # Section 4.
    scale_inputs: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    scale_attrs: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    scale_compile_reps: int = 3
    scale_rounds: int = 15
    profile_worst: bool = True
    # Per-call profile.
    profile_calls: int = 10_000
    # Section 5: training steps of the float8-style model.
    counter_steps: int = 100
    # The GPU script stops starting new work after this many seconds (None: no limit).
    budget_s: float | None = None
    started: float = dataclasses.field(default_factory=time.perf_counter)
    sync: Callable[[], object] = _no_sync

    @property
    def quick(self) -> bool:
        return self.mode == "quick"

    @property
    def smoke(self) -> bool:
        """Tiny rep counts: timings only show that the code runs, never evaluated."""
        return self.mode in ("quick", "gpu-dry-run")

    @property
    def suffix(self) -> str:
        """Result file names end in this: the backend, and the device and mode where not the default."""
        parts = [self.backend]
        if self.device != "cpu":
            parts.append(self.device)
        if self.mode not in ("full",):
            parts.append(self.mode.replace("-", "_"))
        return "_".join(parts)

    def time_left(self) -> float:
        if self.budget_s is None:
            return float("inf")
        return self.budget_s - (time.perf_counter() - self.started)


def quick(backend: str = "aot_eager") -> Settings:
    return Settings(
        mode="quick",
        backend=backend,
        rounds=3,
        round_s=0.002,
        compile_reps=1,
        compile_reps_small=1,
        model_blocks=1,
        model_rounds=3,
        tp_layers=1,
        tp_rounds=2,
        tp_steps=1,
        write_counts=(1, 16),
        scale_inputs=(1, 8),
        scale_attrs=(1, 4),
        scale_compile_reps=1,
        scale_rounds=3,
        profile_worst=False,
        profile_calls=1000,
        counter_steps=12,
    )


def full(backend: str = "aot_eager") -> Settings:
    s = Settings(mode="full", backend=backend)
    if backend == "inductor":
        # A cold inductor compile takes seconds (C++ codegen and build, caches off):
        # fewer cold compiles, still interleaved.
        s.compile_reps = 15
        s.compile_reps_small = 5
        s.scale_compile_reps = 2
    return s


def gpu() -> Settings:
    """Sized so bench/gpu.py finishes within 8 minutes on one H200 (inductor)."""
    return Settings(
        mode="gpu",
        backend="inductor",
        device="cuda",
        rounds=21,
        round_s=0.02,
        compile_reps=5,
        compile_reps_small=1,
        compile_budget_s=90.0,
        model_blocks=4,
        model_rounds=15,
        tp_layers=4,
        tp_rounds=9,
        tp_steps=5,
        budget_s=360.0,
    )


def gpu_dry_run(backend: str = "aot_eager") -> Settings:
    """The GPU script's code path on CPU, tiny counts."""
    s = quick(backend)
    s.mode = "gpu-dry-run"
    s.budget_s = 120.0
    return s

"""DTensor embedding and a tensor-parallel model with real gloo process groups: 2
processes on loopback, so the all-reduces are real and the numbers must match a
single-device reference."""

from __future__ import annotations

import json
import os

import torch
import torch.multiprocessing as mp

import _dtensor_gloo_worker


def test_two_process_gloo(tmp_path):
    init_file = tmp_path / "init"
    mp.spawn(
        _dtensor_gloo_worker.run,
        args=(2, str(init_file), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(r["eager_full"]), torch.tensor(r["reference"]))
        for backend in ("eager", "aot_eager"):
            assert r[f"{backend}_mask"] == r["eager_mask"], (rank, backend)  # a real mask, eager's
            assert r[f"{backend}_refcount"] == 1 and r[f"{backend}_refcount_after"] == 0
            torch.testing.assert_close(torch.tensor(r[f"{backend}_full"]), torch.tensor(r["reference"]))
        for backend in ("eager", "aot_eager"):
            for key in ("cross", "cross_grad", "cross_state", "break", "break_grad"):
                ref, got = key.replace("cross", "cross_ref").replace("break", "break_ref"), key
                got = got.replace("cross", f"cross_{backend}").replace("break", f"break_{backend}")
                assert r[got] == r[ref], (rank, backend, key)
        torch.testing.assert_close(torch.tensor(r["cross_ref"]), torch.tensor(r["reference"]))
        assert r["tp_compiled"] == r["tp_eager"], rank
        assert r["tp_eager"][-1] < r["tp_eager"][0]  # it trains

"""One rank of the 2-process gloo DTensor test (started by test_dtensor_gloo.py)."""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))


def run(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    import dynamo_ext
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from test_dtensor import loss_curve

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        dynamo_ext.enable()
        torch.manual_seed(0)
        w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        ids = distribute_tensor(torch.tensor([[1, 5, 7, 2], [0, 3, 6, 4]]), mesh, [Replicate()])

        def emb(i, w):
            return torch.nn.functional.embedding(i, w)

        result = {}
        eager = emb(ids, w)
        result["eager_mask"] = eager.placements[0].mask_buffer.data.tolist()
        result["eager_full"] = eager.full_tensor().tolist()
        result["reference"] = torch.nn.functional.embedding(ids.full_tensor(), w.full_tensor()).tolist()
        for backend in ("eager", "aot_eager"):
            _clear_sharding_prop_cache()
            torch._dynamo.reset()
            out = torch.compile(emb, backend=backend, fullgraph=True)(ids, w)
            buf = out.placements[0].mask_buffer
            result[f"{backend}_mask"] = buf.data.tolist() if type(buf.data) is torch.Tensor else repr(buf.data)
            result[f"{backend}_refcount"] = buf.refcount
            result[f"{backend}_full"] = out.full_tensor().tolist()
            result[f"{backend}_refcount_after"] = buf.refcount

        # a partial embedding reduced in another compiled region, and across a graph break,
        # with the weight requiring grad: outputs, grads and the caller's DTensor state
        wg = w.detach().requires_grad_()

        def reduce(t):
            return t.full_tensor()

        def with_break(i, w):
            e = emb(i, w)
            torch._dynamo.graph_break()
            return e.full_tensor()

        for backend in (None, "eager", "aot_eager"):
            _clear_sharding_prop_cache()
            torch._dynamo.reset()
            e_fn = emb if backend is None else torch.compile(emb, backend=backend, fullgraph=True)
            r_fn = reduce if backend is None else torch.compile(reduce, backend=backend, fullgraph=True)
            b_fn = with_break if backend is None else torch.compile(with_break, backend=backend)
            e = e_fn(ids, wg)
            out = r_fn(e)
            out.sum().backward()
            key = backend or "ref"
            result[f"cross_{key}"] = out.tolist()
            result[f"cross_{key}_grad"] = wg.grad.full_tensor().tolist()
            result[f"cross_{key}_state"] = [e.placements[0].mask_buffer.refcount, e._local_tensor.tolist()]
            wg.grad = None
            out = b_fn(ids, wg)
            out.sum().backward()
            result[f"break_{key}"] = out.tolist()
            result[f"break_{key}_grad"] = wg.grad.full_tensor().tolist()
            wg.grad = None

        for mode, backend in (("eager", None), ("compiled", "aot_eager")):
            torch._dynamo.reset()
            result[f"tp_{mode}"] = loss_curve(mesh, backend)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
    finally:
        dist.destroy_process_group()

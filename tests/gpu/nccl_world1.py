"""One rank of NCCL at world size 1 (tests/gpu/test_nccl.py): python -m tests.gpu.nccl_world1 OUT.json DIR.

The process group through ``gpipe.distributed.init_from_env`` (at WORLD_SIZE=1 it leaves the process
undistributed and says so: then the group is started here with the backends it would use,
``cpu:gloo,cuda:nccl`` bound to ``cuda:LOCAL_RANK``); then a Pipeline step checked by
``gpipe.nonfinite.all_finite`` with its health recorded, an object collective, and a DCP save and
load. Writes what it saw to OUT.json; any failure exits non-zero."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

from gpipe import Pipeline, load_checkpoint, save_checkpoint
from gpipe.distributed import init_from_env
from gpipe.health import Recorder
from gpipe.nonfinite import all_finite
from tests.gpu.common import data, mlp
from tests.helpers import even


def main(out: Path, folder: Path) -> None:
    seen: dict[str, object] = {}
    began = time.monotonic()
    seen["init_from_env"] = init_from_env(timeout=60.0)
    if not dist.is_initialized():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    seen["backend"] = str(dist.get_backend())
    seen["world"] = dist.get_world_size()
    seen["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))

    model = mlp()
    pipe = Pipeline(model, even(len(model), 2), devices=["cuda:0", "cuda:0"], chunks=4, loss_fn=F.mse_loss)
    x, y = data("cuda:0")
    with Recorder(pipe) as health:
        loss = pipe.step(x, y)
    seen["loss"] = float(loss)
    seen["all_finite"] = all_finite(pipe, loss)
    seen["grad_norm"] = health.result().grad_norm
    assert seen["all_finite"], "a finite step said to be non-finite"

    objects: list[object] = [{"step": 3, "note": "from rank 0"}]
    dist.broadcast_object_list(objects, src=0)
    seen["broadcast"] = objects[0]

    before = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    save_checkpoint(pipe, folder, 3)
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)
    seen["loaded_step"] = load_checkpoint(pipe, folder)
    after = pipe.state_dict()
    seen["restored"] = all(torch.equal(before[k], after[k]) for k in before)
    assert seen["loaded_step"] == 3 and seen["restored"], seen
    dist.barrier()
    dist.destroy_process_group()
    seen["seconds"] = time.monotonic() - began
    out.write_text(json.dumps(seen, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

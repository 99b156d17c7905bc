"""Stream syncs, kernel launches and step time per step of a few schemes on ResNet-18, P = 1.

Produced docs/results/gpu-syncs-h200.json (one H200, NCCL):

    PYTHONPATH=src python docs/results/gpu_syncs.py dense,topka,per_tensor,ssfusion_oi

On a machine without CUDA it runs on the CPU with gloo (a small CNN where torchvision is
missing) and counts no syncs: it is a GPU measurement, kept so the figures can be re-run.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from gradsync.engine import Config, GradSync

try:
    import torchvision
except ImportError:
    torchvision = None

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync_dev() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def model_of() -> torch.nn.Module:
    if torchvision is not None:
        return torchvision.models.resnet18(num_classes=10)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 62 * 62, 10))


def measure(scheme: str) -> dict:
    torch.manual_seed(0)
    model = model_of().to(DEV)
    x = torch.randn(32, 3, 64, 64, device=DEV)
    y = torch.randint(0, 10, (32,), device=DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sync = GradSync(model, Config(scheme=scheme, density=0.01, momentum=0.9, warmup_steps=3))

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        sync.synchronize()
        opt.step()

    try:
        for _ in range(8):  # the warm-up and a few steps after it
            step()
        sync_dev()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(3):
                step()
            sync_dev()
        counts = {e.key: e.count for e in prof.key_averages()}
        launches = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
        times = []
        for _ in range(20):
            sync_dev()
            t0 = time.perf_counter()
            step()
            sync_dev()
            times.append(time.perf_counter() - t0)
    finally:
        sync.close()
    times.sort()
    return {"syncs_per_step": counts.get("cudaStreamSynchronize", 0) / 3,
            "launches_per_step": sum(counts.get(k, 0) for k in launches) / 3,
            "step_ms_median": 1e3 * times[10], "step_ms_min": 1e3 * times[0]}


def main() -> None:
    if DEV == "cuda":
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0,
                                world_size=1, device_id=torch.device("cuda:0"))
    else:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0,
                                world_size=1)
    try:
        res = {}
        for scheme in sys.argv[1].split(","):
            res[scheme] = measure(scheme)
            print(scheme, res[scheme], flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "syncs.json"), "w") as f:
            json.dump(res, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The peer of bench/optimizer_bench.cc: torch.optim.AdamW on the CPU doing the offload optimizer's
whole job (bf16 gradient upcast, step, bf16 parameter downcast) on the same number of parameters.

Usage: python3 bench/torch_adamw_cpu.py [--params 256000000] [--steps 5] [--impl fused|foreach]
Prints one JSON line: {"bench": "torch_adamw_cpu", ...}.
"""
import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=256_000_000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--impl", default="fused", choices=["fused", "foreach"])
    a = ap.parse_args()
    p = torch.nn.Parameter(torch.full((a.params,), 0.5, dtype=torch.float32))
    grad_bf16 = torch.full((a.params,), 0.0078, dtype=torch.bfloat16)
    out_bf16 = torch.empty(a.params, dtype=torch.bfloat16)
    kw = {"fused": True} if a.impl == "fused" else {"foreach": True}
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, **kw)

    def step() -> None:
        p.grad = grad_bf16.float()  # upcast, as an offload optimizer must
        opt.step()
        out_bf16.copy_(p.detach())  # downcast for the GPU copy of the weights

    step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    med = sorted(times)[len(times) // 2]
    print(json.dumps({"bench": "torch_adamw_cpu", "impl": a.impl, "params": a.params, "threads": torch.get_num_threads(),
                      "step_s_median": med, "gparam_per_s": a.params / med / 1e9, "torch": torch.__version__}),
          flush=True)


if __name__ == "__main__":
    main()

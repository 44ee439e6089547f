"""A training process for the multi-process tests: trains the small GPT through trainstream.wrap()
next to a stock torch.optim.AdamW copy and prints one JSON line per event.

    python worker.py --socket S --job J [--steps N] [--seed K] [--hang-after N]

With --hang-after N it prints {"ready": ...} after N steps and sleeps (to be killed)."""
import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trainstream  # noqa: E402
from gpt import batches, make_gpt, max_diff, param_groups, train  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--socket", required=True)
ap.add_argument("--job", required=True)
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--hang-after", type=int, default=-1)
a = ap.parse_args()
torch.set_num_threads(1)

HP = dict(lr=2e-3, betas=(0.9, 0.95))
ref = make_gpt(a.seed, d=48)
mine = copy.deepcopy(ref)
opt_ref = torch.optim.AdamW(param_groups(ref), foreach=False, **HP)
mine, opt = trainstream.wrap(mine, torch.optim.AdamW(param_groups(mine), **HP), device="cpu", socket=a.socket,
                             job=a.job, max_grad_norm=1.0)
data = batches(a.steps, seed=a.seed + 1)
if a.hang_after >= 0:
    train(mine, opt, data, a.hang_after)
    print(json.dumps({"ready": a.hang_after, "pid": os.getpid()}), flush=True)
    time.sleep(600)
t0 = time.time()
la = train(ref, opt_ref, data, a.steps, max_grad_norm=1.0, stock=True)
lb = train(mine, opt, data, a.steps, max_grad_norm=1.0)
trainstream.unwrap(mine)
print(json.dumps({"job": a.job, "max_diff": max_diff(ref, mine), "losses": lb, "ref_losses": la,
                  "seconds": time.time() - t0}), flush=True)

"""A trainer for test_resume.py: trains the test GPT for --steps steps on fixed data through tsd,
in a job kept after a crash (--keep-for), or resuming one (--resume), and can SIGKILL itself at
step --kill-at: before the step starts ("between"), in the middle of backward ("backward"), or
after backward but before optimizer.step() ("before-step"). Each finished step appends
{"step", "loss"} to --log (flushed and synced, so a killed run keeps what it finished); at the
end the parameters go to --params and a JSON summary to stdout."""
import argparse
import json
import os
import signal

import torch

import trainstream
from gpt import batches, loss_of, make_gpt, param_groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--keep-for", default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--clip-speculation", action="store_true", help="wrap(clip_speculation=True)")
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--kill-where", default="between", choices=["between", "backward", "before-step"])
    ap.add_argument("--log", required=True)
    ap.add_argument("--params", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)  # the same arithmetic in every run

    model = make_gpt(seed=0 if not a.resume else 99)  # a resumed run's weights must come from tsd
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=a.socket, job=a.job, keep_for=a.keep_for,
                                  resume=a.resume, max_grad_norm=a.clip, offload=True, activation_offload=False,
                                  clip_speculation=True if a.clip_speculation else "auto")
    session = trainstream.unwrap_session(model)
    resumed = session.resumed
    start = resumed.steps if resumed is not None else 0
    data = batches(a.steps, seed=7)
    with open(a.log, "a") as log:
        for i in range(start, a.steps):
            killing = i == a.kill_at
            if killing and a.kill_where == "between":
                os.kill(os.getpid(), signal.SIGKILL)
            if killing and a.kill_where == "backward":
                # After the gradient of the first block's weights: the last layers' buckets were
                # delivered (and may be updated), the first layers' not.
                target = model.blocks[0].fc.weight
                target.register_post_accumulate_grad_hook(lambda p: os.kill(os.getpid(), signal.SIGKILL))
            loss = loss_of(model, data[i])
            loss.backward()
            if killing and a.kill_where == "before-step":
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            opt.zero_grad()
            log.write(json.dumps({"step": i, "loss": loss.item()}) + "\n")
            log.flush()
            os.fsync(log.fileno())
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, a.params)
    summary = {"start": start, "resumed": resumed is not None,
               "ahead": resumed.ahead if resumed else [], "rolled_back": resumed.rolled_back if resumed else [],
               "describe": resumed.describe() if resumed else ""}
    trainstream.unwrap(model)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

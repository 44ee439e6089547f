"""wrap()'s options under data parallel (docs/distributed.md): the gradients' reductions streamed
during backward, overlap_forward, the GPU share, activation and weight paging, accumulation. Each
test starts its ranks as processes (tests/python/dist_worker.py, modes in dist_options.py) over
gloo on the CPU and checks against DDP + AdamW and against the same run without the option."""
from __future__ import annotations

import pytest
import torch

from dist_worker import STEPS
from test_distributed import _check_parity, _daemon, _run

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


def _on_one_tsd(tmp_path, world: int, mode: str, timeout: float = 240) -> tuple[list, str]:
    """Runs `world` ranks of `mode` on one tsd of their own (stopped after); returns their
    results by rank and the folder they wrote to."""
    d = _daemon(tmp_path / "tsd")
    try:
        out = tmp_path / "out"
        out.mkdir()
        return _run(world, [d.socket] * world, mode, str(out), timeout=timeout), str(out)
    finally:
        d.stop()


def test_streamed_reductions_match_reducing_at_step_and_ddp(tmp_path):
    """On the CPU the reductions run over gloo during backward, as each bucket's last gradient
    of the step comes. With parameters that get gradients on one rank only or on none, a partial
    last accumulation and clipping, the result equals reducing everything at step() and
    overlapping the updates with the next forward (overlap_forward) bit for bit, and DDP
    (find_unused_parameters) + AdamW within 1e-6."""
    results, _ = _on_one_tsd(tmp_path, 3, "stream")
    for r, res in enumerate(results):
        assert res is not None and "exception" not in res, (r, res)
        assert res["moved"] > 1e-3
        assert res["max_diff"] <= 1e-6, f"rank {r}: parameters differ from DDP + AdamW by {res['max_diff']}"
        assert res["bit_equal"], f"rank {r}: streaming the reductions changed the result"
        assert res["overlap_bit_equal"], f"rank {r}: overlap_forward changed the result"
        # overlap_forward: step() left the used buckets' updates to the next forward (the 6 of
        # trunk and extra on rank 0; the trunk's 4 elsewhere), and a state dict read current values.
        assert res["owed"] == [6 if r == 0 else 4] * STEPS, res["owed"]
        assert res["state_dict_current"]
        assert res["never_moved"], "a parameter no rank used was updated"
        # Reductions started during backward from the second step on (the first follows the bucket
        # order, which starts with `never`'s buckets): every bucket this rank finished (rank 0 uses
        # `extra` too; the others' chains stop at its buckets, put last).
        assert res["launched"][0] == 0 and res["launched"][1:-1] == [6 if r == 0 else 4] * (STEPS - 2), res["launched"]
        assert res["launched"][-1] == 0  # the partial last step: nothing is final before step()
        assert res["launched_later"] == [0] * len(res["launched_later"])
        assert "bucket by bucket as backward finishes them" in res["events"][0], res["events"]
    # Every rank follows the same order, learned from the first backward: the trunk's buckets
    # first, then extra's (finished by rank 0 only), then never's.
    assert all(o == results[0]["orders"][0] for res in results for o in res["orders"])
    assert sorted(results[0]["orders"][0][-4:-2]) == [2, 3] and sorted(results[0]["orders"][0][-2:]) == [0, 1]


def test_gpu_share_under_data_parallel_matches_ddp(tmp_path):
    """optimizer_gpu_fraction with data parallel: every rank updates the share (torch's AdamW, its
    gradients averaged over the group) and tsd the rest, clipped by the global norm; equal to DDP
    + AdamW within 1e-6 with a branch one rank uses, a module none uses and a partial accumulation.
    With "auto", ranks with different VRAM budgets agree on the smallest share."""
    results, _ = _on_one_tsd(tmp_path, 3, "share")
    for r, res in enumerate(results):
        assert res is not None and "exception" not in res, (r, res)
        for fraction in ("0.5", "0.9", "auto"):
            got = res[f"share_{fraction}"]
            assert got["share"] > 0 and got["tsd"] > 0, got
            assert got["max_diff"] <= 1e-6, f"rank {r}, fraction {fraction}: {got['max_diff']} from DDP + AdamW"
            assert got["never_moved"]
    # "auto": every rank took the smallest share any rank chose (rank 0 alone would take all but one).
    autos = [res["share_auto"] for res in results]
    assert len({a["share"] for a in autos}) == 1 and autos[0]["share"] < autos[0]["share"] + autos[0]["tsd"] - 1
    assert "the smallest share of the group's ranks" in autos[0]["events"][0], autos[0]["events"]


def test_paging_under_data_parallel(tmp_path):
    """Every rank pages its blocks' saved activations into host memory tsd lends it and/or pages
    two blocks' weights out between uses (their shared tsd slot is their only copy), also with
    overlap_forward: bit-identical to the run without paging and within 1e-6 of DDP + AdamW
    (clipping, accumulation); unwrap() brings the paged weights back."""
    results, _ = _on_one_tsd(tmp_path, 2, "paging")
    for r, res in enumerate(results):
        assert res is not None and "exception" not in res, (r, res)
        assert res["act"]["paged_tensors"] > 0 and res["weights"]["weight_pages"] == 2, res
        assert res["both-overlap"]["paged_tensors"] > 0 and res["both-overlap"]["weight_pages"] == 2, res
        for name in ("act", "weights", "both-overlap"):
            assert res[name]["bit_equal"], f"rank {r}: {name} changed the result"
        for name in ("none", "act", "weights", "both-overlap"):
            assert res[name]["max_diff"] <= 1e-6, f"rank {r}, {name}: {res[name]['max_diff']} from DDP + AdamW"
            assert res[name]["unwrapped_equal"], (r, name)
    # The node's first rank reports each step's wait and the pages it moved (tsctl top).
    act = results[0]["act"]["activity"]
    assert act["client_reports"] == STEPS and act["d2h_bytes_per_step"] > 0, act
    assert results[0]["weights"]["activity"]["h2d_bytes_per_step"] > 0, results[0]["weights"]["activity"]


def test_a_gradient_past_accumulation_steps_is_refused(tmp_path):
    for res in _on_one_tsd(tmp_path, 2, "misaccumulate", timeout=120)[0]:
        assert res is not None and "exception" not in res, res
        assert res["error"] is not None and "accumulation_steps=N" in res["error"], res


def test_a_group_of_one_rank_takes_the_group_path(tmp_path):
    """distributed=True in a process group of one rank: the group's path (a job of one session,
    its reductions over the group), with one trainer's results (DDP + AdamW within 1e-6)."""
    results, out = _on_one_tsd(tmp_path, 1, "parity")
    _check_parity(results, 1, nodes=1, out_dir=out)
    assert "rank 0 of 1" in results[0]["events"] and "through gloo" in results[0]["events"], results[0]["events"]


def test_overlap_with_a_weight_used_outside_forward_takes_the_owed_update_first(tmp_path):
    results, _ = _on_one_tsd(tmp_path, 2, "stale")
    for r, res in enumerate(results):
        assert res is not None and "exception" not in res, (r, res)
        assert res["events"] and "used outside the forward recorded" in res["events"][0], res
        assert res["same"], "the ranks' parameters differ"

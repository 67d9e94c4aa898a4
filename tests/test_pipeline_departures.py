"""A pipeline stage that dies mid-step ends the job within the time-out, naming the stage.

As tests/test_departures.py: jobs of their own (from the 1-rank session), under a launcher that leaves
the other ranks running (`mpiexec -disable-auto-cleanup`), so the survivors must find out themselves.
One rank leaves inside `mm.pipeline_value_and_grad`'s schedule (os._exit, or SIGKILL) at its stage's
third run; the survivors waiting for it in a transfer between stages, or in a collective of their stage,
must raise well within the time-out (20 s here) with a message naming the dead rank's stage and rank.
"""
from __future__ import annotations

import pytest
from mpi4py import MPI

from test_departures import _job, _one_paragraph, _reports

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                reason="spawns its own jobs; runs in the 1-rank session")

STEP = """
    import numpy as np
    mesh = mm.Mesh("{shape}", layout="stage:stages" + (";d_ff:cols" if "cols" in "{shape}" else ""))
    S = mesh.shape["stages"].size
    runs = [0, False]  # the second step's stage runs (not the dry one before it), armed

    def stage(p, h):
        runs[0] += runs[1] and not getattr(h.mesh, "dry", False)
        if mesh.rank == {dead} and runs[0] == 3:  # mid-step: its third stage run
            {how}
        a = mm.einsum([h, p["w1"]], output_shape=mm.Shape([h.shape["b"], p["w1"].shape["d_ff"]]))
        return mm.einsum([a, p["w2"]], output_shape=h.shape)  # (d_ff over cols: an allreduce in the stage)
    p = {{"w1": mesh.from_numpy(np.ones((S, 4, 2)), "stage:" + str(S) + ";d:4;d_ff:2"),
          "w2": mesh.from_numpy(np.ones((S, 2, 4)), "stage:" + str(S) + ";d_ff:2;d:4")}}
    x = mesh.from_numpy(np.ones((8, 4)), "b:8;d:4")
    loss = lambda h, t: mm.reduce_sum(h * t)
    mm.pipeline_value_and_grad(stage, loss, p, x, x, "stages", 4)  # a first step: every rank takes part
    print(f"rank {{mesh.rank}} warm", flush=True)
    runs[1] = True
    waiting("step", lambda: mm.pipeline_value_and_grad(stage, loss, p, x, x, "stages", 4))
"""

# (rank: what its report must say, if it reports), per case; the dead rank is stage 1 in each
NAMED = {"stages:3": {0: ["stage 1 (rank 1) left the job", "this rank (rank 0) is stage 0 of 3"],
                      2: ["stage 1 (rank 1) left the job", "this rank (rank 2) is stage 2 of 3"]},
         "stages:2": {0: ["stage 1 (rank 1) left the job", "this rank (rank 0) is stage 0 of 2"]},
         # rank 3 is stage 1, cols 1: rank 1 (stage 0, cols 1) waits for it in a transfer, rank 2 (stage 1,
         # cols 0) in its stage's allreduce over cols, whose stage mesh numbers rank 3 as its rank 1; rank 0
         # waits for rank 2, which the first survivor's abort may end first
         "stages:2;cols:2": {1: ["stage 1 (rank 3) left the job", "this rank (rank 1) is stage 0 of 2"],
                             2: ["In stage 1 of the pipeline over 'stages'", "ranks [2, 3] of the mesh",
                                 "rank 1 left"],
                             0: ["stage 1 (rank 2) left the job", "this rank (rank 0) is stage 0 of 2"]}}


@pytest.mark.parametrize("ranks,shape,dead,how", [
    (3, "stages:3", 1, "os._exit(3)"),
    (2, "stages:2", 1, "os.kill(os.getpid(), 9)"),
    (4, "stages:2;cols:2", 3, "os._exit(3)"),
])
def test_a_stage_killed_mid_step_is_named_by_the_survivors(tmp_path, ranks, shape, dead, how):
    proc, seconds = _job(tmp_path, ranks, STEP.format(shape=shape, dead=dead, how=how), wrap=True,
                         MPIMESH_COLLECTIVE_TIMEOUT="20")
    assert proc.returncode != 0
    assert proc.stdout.count(" warm") == ranks, proc.stdout + proc.stderr
    reports = _reports(proc)  # (the first survivor to raise aborts the job: the others may not get to print)
    assert reports, proc.stdout + proc.stderr
    for r, (after, message) in reports.items():
        assert after < 10.0, (r, after, message)  # half the time-out
        for text in NAMED[shape][r]:
            assert text in message, (r, text, message)
    _one_paragraph(proc)
    assert seconds < 40

"""apps/transformer.py: training gives the same loss curve under every layout and mesh (compared
with a 1-rank run made inside the test), resuming from a checkpoint changes nothing, and the
command line refuses, on every rank and before training, a checkpoint directory it must not use.
(Killing a rank mid-save and resuming on other ranks: tests/test_crash_safe.py.)"""
from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from meshes import mesh_shapes
from mpimesh import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as T  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")
CFG = T.Config(d_model=16, heads=8, d_kv=4, d_ff=32, layers=1, vocab=256, length=8, batch=8)
STEPS = 20


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    with open(CORPUS, "rb") as f:  # real text (an old copy of the app's source), fixed for the tests
        return np.frombuffer(f.read(), np.uint8)


def run(mesh: mm.Mesh, data: np.ndarray, cfg: CFG.__class__ = CFG, steps: int = STEPS, start: int = 0,
        state: tuple = None) -> tuple:
    """Train `steps` steps from `state` (default: a fresh init); returns (losses, params, opt_state)."""
    opt = T.make_optimizer(cfg)
    if state is None:
        params = T.init_params(mesh, cfg, seed=3)
        opt_state = opt.init(params)
    else:
        params, opt_state = state
    train_step = T.make_train_step(cfg, opt)
    losses = []
    for step in range(start, start + steps):
        batch = T.make_batch(mesh, data, cfg, T.train_offsets(data, cfg, 5, step))
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))
    return np.array(losses), params, opt_state


def layouts() -> list[tuple[str, str]]:
    n = MPI.COMM_WORLD.Get_size()
    one, _, three = mesh_shapes(n)
    return [
        (one, ""),                                              # replicated
        (one, "batch:all"),                                     # pure data-parallel
        (one, "heads:all;d_ff:all;vocab:all"),                  # pure model-parallel
        (T.default_mesh(n), T.PAPER_LAYOUT),                    # the paper's 2-D data + model layout
        (three, "batch:rows;heads:cols;d_ff:cols;vocab:cols;d_model:planes"),  # 3-D, d_model split too
    ]


_REFERENCE: dict = {}


def reference(optimizer: str, corpus: np.ndarray) -> tuple:
    """The 1-rank (COMM_SELF) loss curve for `optimizer`, computed once per test session."""
    if optimizer not in _REFERENCE:
        cfg = CFG.__class__(**{**CFG.__dict__, "optimizer": optimizer})
        _REFERENCE[optimizer] = cfg, run(mm.Mesh("all:1", comm=MPI.COMM_SELF), corpus, cfg)[0]
    return _REFERENCE[optimizer]


@pytest.mark.parametrize("optimizer", ["adafactor", "adam"])
def test_reference_learns(corpus, optimizer):
    cfg, losses = reference(optimizer, corpus)
    assert np.isfinite(losses).all()
    assert losses[0] == pytest.approx(np.log(256), rel=0.15)  # about uniform at the start
    assert losses[-5:].mean() < losses[:5].mean() - 0.5, losses


# Every layout with Adafactor (the app's default); Adam under the paper's layout.
CASES = [(i, "adafactor") for i in range(5)] + [(3, "adam")]


@pytest.mark.parametrize("config,optimizer", CASES)
def test_same_loss_curve_under_every_layout(corpus, config, optimizer):
    cfg, ref = reference(optimizer, corpus)
    shape, rules = layouts()[config]
    losses, params, _ = run(mm.Mesh(shape, layout=rules), corpus, cfg)
    np.testing.assert_allclose(losses, ref, rtol=1e-4, err_msg=f"{shape} {rules} {cfg.optimizer}")
    if rules == T.PAPER_LAYOUT and mm.Shape(shape)["cols"].size > 1:  # the model really is split
        assert params["layer0/att/q/kernel"].layout == {"heads": "cols"}
        assert params["layer0/ffn/wi/kernel"].layout == {"d_ff": "cols"}


def _loss_and_grads(mesh: mm.Mesh, cfg, data: np.ndarray) -> tuple:
    params = T.init_params(mesh, cfg, seed=3)
    batch = T.make_batch(mesh, data, cfg, T.train_offsets(data, cfg, 5, 0))
    names = sorted(params)
    with mm.trace():
        loss = T.loss_fn(params, batch, cfg)
        grads = mm.gradients([loss], [params[n] for n in names])
    return float(loss), {n: g.to_numpy() for n, g in zip(names, grads)}


def test_vocab_257_split_equals_one_rank(corpus):
    """GPT-2-like vocabulary that no rank count divides, split over every rank (uneven blocks of the
    embedding and logits): the loss, every gradient and a short loss curve equal one rank's."""
    cfg = CFG.__class__(**{**CFG.__dict__, "vocab": 257})
    n = MPI.COMM_WORLD.Get_size()
    one = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    mesh = mm.Mesh(f"all:{n}", layout="vocab:all")
    ref_loss, ref_grads = _loss_and_grads(one, cfg, corpus)
    loss, grads = _loss_and_grads(mesh, cfg, corpus)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, g in grads.items():
        scale = np.abs(ref_grads[name]).max()
        np.testing.assert_allclose(g, ref_grads[name], rtol=1e-5, atol=1e-6 * scale, err_msg=name)
    if n > 1:
        assert T.init_params(mesh, cfg)["embed/weights"].local.shape[0] in (257 // n, 257 // n + 1)
    np.testing.assert_allclose(run(mesh, corpus, cfg, steps=4)[0], run(one, corpus, cfg, steps=4)[0], rtol=1e-5)


def _shared_dir(tmp_path) -> str:
    path = MPI.COMM_WORLD.bcast(str(tmp_path / "ckpt"), root=0)  # one directory for every rank
    return path


def test_resume_equals_uninterrupted(corpus, tmp_path):
    n = 3
    mesh = mm.Mesh(T.default_mesh(MPI.COMM_WORLD.Get_size()), layout=T.PAPER_LAYOUT)
    straight, _, _ = run(mesh, corpus, steps=2 * n)
    first, params, opt_state = run(mesh, corpus, steps=n)
    path = T.save_checkpoint(_shared_dir(tmp_path), n, params, opt_state)
    template = T.init_params(mesh, CFG, seed=99)  # different values: everything must come from the file
    params2, state2, step = T.load_checkpoint(path, mesh, template, T.make_optimizer(CFG).init(template))
    assert step == n
    second, _, _ = run(mesh, corpus, steps=n, start=step, state=(params2, state2))
    np.testing.assert_array_equal(np.concatenate([first, second]), straight)
    # Resuming onto another mesh shape and layout (resharding on load) gives the same curve too.
    other = mm.Mesh(mesh_shapes()[0], layout="batch:all")
    template = T.init_params(other, CFG, seed=99)
    params3, state3, _ = T.load_checkpoint(path, other, template, T.make_optimizer(CFG).init(template))
    third, _, _ = run(other, corpus, steps=n, start=n, state=(params3, state3))
    np.testing.assert_allclose(third, straight[n:], rtol=1e-5)


def test_checkpoint_for_another_model_is_refused(corpus, tmp_path):
    mesh = mm.Mesh(mesh_shapes()[0], layout="batch:all")
    params = T.init_params(mesh, CFG, seed=0)
    opt = T.make_optimizer(CFG)
    path = T.save_checkpoint(_shared_dir(tmp_path), 0, params, opt.init(params))
    bigger = CFG.__class__(**{**CFG.__dict__, "layers": 2})
    template = T.init_params(mesh, bigger, seed=0)
    with pytest.raises(mm.CheckpointError, match=r"lacks \['params/layer1/"):
        T.load_checkpoint(path, mesh, template, opt.init(template))


TINY = ["--d_model", "16", "--heads", "8", "--d_kv", "4", "--d_ff", "32", "--layers", "1", "--length", "8",
        "--batch", "8", "--data", CORPUS, "--heldout", "0.3", "--log-every", "2", "--eval-every", "2",
        "--eval-batches", "1", "--save-every", "2", "--samples", "0"]


def test_command_line_trains_saves_resumes_and_samples(tmp_path, capsys):
    path = _shared_dir(tmp_path)
    tiny = TINY + ["--checkpoint", path, "--samples", "1", "--sample-bytes", "3"]
    T.main(tiny + ["--steps", "4"])
    T.main(tiny + ["--steps", "6", "--resume", "--profile"])
    out = capsys.readouterr().out
    if MPI.COMM_WORLD.Get_rank() == 0:  # only rank 0 prints
        for text in ("unigram baseline", "step     4/4", "held-out loss", "resumed from", "at step 4",
                     "step     6/6", "flops", "final held-out loss", "--- sample 1"):
            assert text in out, f"{text!r} missing from:\n{out}"
        saves = re.findall(r"checkpoint: step (\d+) saved to (\S+), ([\d.]+) MiB in ([\d.]+) s", out)
        assert [int(step) for step, *_ in saves] == [2, 4, 6], out  # one line per save
        for step, where, mib, _ in saves:
            on_disk = sum(e.stat().st_size for e in os.scandir(where)) if os.path.isdir(where) else None
            assert where == os.path.join(path, f"step-{int(step):08d}") and float(mib) > 0
            assert on_disk is None or abs(on_disk / 2**20 - float(mib)) < 0.01  # the two older ones are pruned
    else:
        assert out == ""


def saved_steps(path: str) -> list[int]:
    return checkpoint.steps(path, mm.Mesh(f"all:{MPI.COMM_WORLD.Get_size()}"))


def test_checkpoint_without_resume_is_refused_at_start(tmp_path, capsys):
    """A directory holding a checkpoint: refused before training, naming its step, unless
    --overwrite, which deletes it (the new run's saves alone remain)."""
    path = _shared_dir(tmp_path)
    T.main(TINY + ["--checkpoint", path, "--steps", "6", "--save-every", "3"])
    assert saved_steps(path) == [3, 6]
    capsys.readouterr()
    with pytest.raises(mm.CheckpointError, match="already holds a checkpoint at step 6: pass --resume .* --overwrite"):
        T.main(TINY + ["--checkpoint", path, "--steps", "4"])
    assert "loss" not in capsys.readouterr().out  # refused before training
    assert saved_steps(path) == [3, 6]
    T.main(TINY + ["--checkpoint", path, "--steps", "4", "--overwrite"])
    assert saved_steps(path) == [2, 4]


@pytest.mark.parametrize("what", ["folder", "file"])
def test_directory_of_other_things_is_refused_at_start(tmp_path, capsys, what):
    path = _shared_dir(tmp_path)
    MPI.COMM_WORLD.barrier()
    if MPI.COMM_WORLD.Get_rank() == 0:
        if what == "folder":
            os.mkdir(path)
            open(os.path.join(path, "notes.txt"), "w").close()
        else:
            open(path, "w").close()
    MPI.COMM_WORLD.barrier()
    with pytest.raises(mm.CheckpointError, match="notes.txt" if what == "folder" else "is a file"):
        T.main(TINY + ["--checkpoint", path, "--steps", "2"])
    assert capsys.readouterr().out == ""  # refused before anything, training included


def test_resume_at_or_past_steps(tmp_path, capsys):
    """--steps is the total: a checkpoint at it leaves nothing to do; one past it is refused."""
    path = _shared_dir(tmp_path)
    T.main(TINY + ["--checkpoint", path, "--steps", "4"])
    capsys.readouterr()
    T.main(TINY + ["--checkpoint", path, "--steps", "4", "--resume"])
    out = capsys.readouterr().out
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert out.startswith("nothing to do: the checkpoint ") and "at step 4" in out and "loss" not in out, out
    with pytest.raises(mm.CheckpointError, match="at step 4, past --steps 3 .* pass --steps above 4"):
        T.main(TINY + ["--checkpoint", path, "--steps", "3", "--resume"])
    assert "loss" not in capsys.readouterr().out
    assert saved_steps(path) == [2, 4]


def _losses(path: str) -> dict:
    with open(path) as f:
        return {d["step"]: d["loss"] for d in map(json.loads, f)}


def test_resume_takes_a_step_or_a_path(tmp_path, capsys):
    """--resume 2 (a step of DIR) and --resume DIR/step-00000002 (a path, no --checkpoint) both go on
    from step 2 with the uninterrupted run's losses; a step DIR lacks is refused, listing its steps."""
    path, logs = _shared_dir(tmp_path), MPI.COMM_WORLD.bcast(str(tmp_path), root=0)
    T.main(TINY + ["--checkpoint", path, "--steps", "4", "--log-json", os.path.join(logs, "a.jsonl")])
    T.main(TINY + ["--checkpoint", path, "--steps", "4", "--resume", "2", "--log-json", os.path.join(logs, "b.jsonl")])
    T.main(TINY + ["--steps", "4", "--resume", os.path.join(path, "step-00000002"),
                   "--log-json", os.path.join(logs, "c.jsonl")])
    out = capsys.readouterr().out
    if MPI.COMM_WORLD.Get_rank() == 0:
        straight = _losses(os.path.join(logs, "a.jsonl"))
        for name in ("b.jsonl", "c.jsonl"):
            resumed = _losses(os.path.join(logs, name))
            assert list(resumed) == [3, 4]
            np.testing.assert_allclose([resumed[3], resumed[4]], [straight[3], straight[4]], rtol=1e-6)
        assert out.count(f"resumed from {os.path.join(path, 'step-00000002')} at step 2") == 2, out
    with pytest.raises(mm.CheckpointError, match=r"--resume 3: .* holds no complete checkpoint of step 3; it holds "
                                                 r"steps \[2, 4\]"):
        T.main(TINY + ["--checkpoint", path, "--steps", "4", "--resume", "3"])


def test_damaged_newest_checkpoint_names_the_newest_intact_one(tmp_path):
    """A byte of the newest checkpoint changed after it was saved: --resume is refused, naming the
    damage and the newest intact checkpoint, and the --resume STEP that takes it (which works)."""
    path = _shared_dir(tmp_path)
    T.main(TINY + ["--checkpoint", path, "--steps", "4"])
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(os.path.join(path, "step-00000004", "part-00000.bin"), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    MPI.COMM_WORLD.barrier()
    with pytest.raises(mm.CheckpointError, match=r"checksum mismatch in .*step-00000004.* the newest intact checkpoint "
                                                 r"is .*step-00000002: resume from it with --resume 2"):
        T.main(TINY + ["--checkpoint", path, "--steps", "6", "--resume"])
    T.main(TINY + ["--checkpoint", path, "--steps", "6", "--resume", "2"])
    assert saved_steps(path)[-1] == 6


@pytest.mark.parametrize("flag,message", [
    ("--d_model=128", "tensor 'params/embed/weights': checkpoint has d_model:16, expected d_model:128"),
    ("--length=4", "tensor 'params/pos/weights': checkpoint has length:8, expected length:4")])
def test_resume_with_other_sizes_names_the_dim(tmp_path, flag, message):
    """d_model 128 also changes Adafactor's slots (factored from 128): still the sizes are named."""
    path = _shared_dir(tmp_path)
    T.main(TINY + ["--checkpoint", path, "--steps", "2"])
    with pytest.raises(mm.CheckpointError, match=message):
        T.main(TINY + ["--checkpoint", path, "--steps", "4", "--resume", flag])


MOE_CFG = CFG.__class__(**{**CFG.__dict__, "layers": 2, "moe_every": 2, "experts": 8})


def test_moe_transformer_same_loss_curve_with_experts_split(corpus):
    """A tiny transformer whose second FFN is a GShard MoE: the 3-step loss curve on this session's
    ranks (experts split over the batch's mesh dim) equals the 1-rank curve."""
    ref, _, _ = run(mm.Mesh("all:1", layout=T.moe_layout("batch:all", 2), comm=MPI.COMM_SELF), corpus, MOE_CFG,
                    steps=3)
    assert np.isfinite(ref).all()
    n = MPI.COMM_WORLD.Get_size()
    for shape, rules in ((mesh_shapes(n)[0], "batch:all"), (T.default_mesh(n), T.PAPER_LAYOUT)):
        rules = T.moe_layout(rules, MOE_CFG.moe_every)
        assert "experts:" in rules
        mesh = mm.Mesh(shape, layout=rules)
        with mm.profile() as prof:
            losses, params, _ = run(mesh, corpus, MOE_CFG, steps=3)
        np.testing.assert_allclose(losses, ref, rtol=1e-4, err_msg=f"{shape} {rules}")
        m = mesh.layout.mesh_dim("experts")
        if mesh.shape[m].size > 1:  # experts really split: their weights and the dispatch alltoalls
            assert params["layer1/moe/wi"].layout.get("experts") == m
            assert prof.counters[f"alltoall/{m}"]["calls"] >= 3 * 4  # 2 forward + 2 backward per step


def test_jax_backend_equals_eager_steps(corpus):
    """--backend jax: the step recorded on 1 rank and replayed by JAX on a 2x2 jax mesh (host
    devices, the paper's layout as shardings) gives the eager mpimesh losses and parameters."""
    if MPI.COMM_WORLD.Get_size() != 1:
        pytest.skip("one JAX process here (several: tests/test_jax_processes.py): the 1-rank session")
    jax = pytest.importorskip("jax", reason="jax is not installed (python3 install.py tpu)")
    TJ = T._jax_helper()
    try:
        jm, across = TJ.jax_mesh("rows:2;cols:2")
    except mm.MeshError as e:  # jax imported earlier with fewer host devices
        pytest.skip(str(e))
    assert across == {"rows": False, "cols": False}  # one process
    rec = mm.Mesh("rows:1;cols:1", layout=T.PAPER_LAYOUT, comm=MPI.COMM_SELF)
    eager, eager_params, _ = run(rec, corpus, steps=3)
    opt = T.make_optimizer(CFG)
    params = T.init_params(rec, CFG, seed=3)
    first = T.make_batch(rec, corpus, CFG, T.train_offsets(corpus, CFG, 5, 0))
    js = TJ.JaxTrainStep(T.make_train_step(CFG, opt), params, opt.init(params), first, 0, jm, T.PAPER_LAYOUT)
    rows = [lambda a, b, s=s: T.batch_windows(corpus, CFG, T.train_offsets(corpus, CFG, 5, s)[a:b]) for s in range(3)]
    losses = [js.step(rows[s], 0) for s in range(3)]
    np.testing.assert_allclose(losses, eager, rtol=1e-4)
    wi = js.replay.in_shardings[js.first + list(params).index("layer0/ffn/wi/kernel")]
    assert wi.spec == jax.sharding.PartitionSpec(None, "cols")  # d_ff over cols, as --layout says
    got, state = js.state()
    assert int(state["step"].to_numpy()) == 3
    for name in ("embed/weights", "layer0/ffn/wi/kernel"):
        np.testing.assert_allclose(got[name].to_numpy(), eager_params[name].to_numpy(), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("optimizer", ["adam", "adafactor"])
def test_a_learning_rate_of_0_changes_nothing(optimizer):
    """--lr 0 is a learning rate, not "the default" (Adam trained at 3e-3 with it)."""
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    opt = T.make_optimizer(T.Config(optimizer=optimizer, lr=0.0))
    params = {"w": mesh.from_numpy(np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4), "a:3;b:4")}
    state = opt.init(params)
    for k in range(3):
        new, state = opt.update(params, {"w": mesh.full("a:3;b:4", 0.5 + k, "float32")}, state)
        assert new["w"].to_numpy().tobytes() == params["w"].to_numpy().tobytes(), k


def test_log_json_carries_each_steps_figures(tmp_path, capsys):
    """--log-json: one line per step with that step's tokens/s and time, its share in collectives,
    the optimizer's learning rate (Adam's warmup, evaluated by the optimizer's own schedule) and
    rank 0's peak memory; the held-out loss on the evaluated steps alone (every --eval-every and the
    last), equal to the printed ones; the progress lines show an ETA."""
    log = os.path.join(MPI.COMM_WORLD.bcast(str(tmp_path), root=0), "run.jsonl")
    T.main(TINY + ["--steps", "5", "--eval-every", "2", "--log-every", "1", "--optimizer", "adam", "--warmup", "4",
                   "--log-json", log])
    out = capsys.readouterr().out
    if MPI.COMM_WORLD.Get_rank() != 0:
        assert out == ""  # rank 0 alone prints and writes the log
        return
    with open(log) as f:
        lines = [json.loads(line) for line in f]
    assert [d["step"] for d in lines] == [1, 2, 3, 4, 5]
    opt = T.make_optimizer(T.Config(optimizer="adam", warmup=4))
    one = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    tokens = CFG.batch * CFG.length
    for d in lines:
        assert np.isfinite(d["loss"]) and d["step_ms"] > 0
        assert d["tokens_per_s"] == pytest.approx(tokens / (d["step_ms"] / 1e3), rel=1e-9)
        assert 0 <= d["comm_share"] <= 1 and (MPI.COMM_WORLD.Get_size() == 1 or d["comm_share"] > 0), d
        schedule = float(opt.lr(one.full((), float(d["step"]), "float64")).to_numpy())
        assert d["lr"] == pytest.approx(schedule, rel=1e-12) and d["lr"] == pytest.approx(3e-3 * min(d["step"] / 4, 1))
        assert set(d["peak_bytes"]) == {"host"} and 2**20 < d["peak_bytes"]["host"] < 2**40, d
    held = {d["step"]: d["heldout_loss"] for d in lines if "heldout_loss" in d}
    assert sorted(held) == [2, 4, 5]
    printed = [float(v) for v in re.findall(r"^  held-out loss ([\d.]+)", out, re.M)]
    printed.append(float(re.search(r"^final held-out loss ([\d.]+)", out, re.M).group(1)))
    assert [round(held[k], 3) for k in (2, 4, 5)] == printed
    bars = re.findall(r"^step +(\d)/5 \[[#.]{20}\] ETA (\d+):(\d\d)  loss ", out, re.M)
    assert [int(b[0]) for b in bars] == [1, 2, 3, 4, 5] and bars[-1][1:] == ("0", "00"), out

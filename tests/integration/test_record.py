"""``tracecmp record -- python train.py``: a training script that knows nothing of tracecmp,
captured without an edit, running as it does without tracecmp."""

from __future__ import annotations

import os
import runpy
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tracecmp

ROOT = Path(__file__).resolve().parents[2]

TRAIN = textwrap.dedent(
    '''
    """A plain training loop: no tracecmp anywhere."""
    import os, signal, sys
    import torch
    import torch.nn.functional as F
    from torch import nn
    from safetensors.torch import save_file

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(8, 16), nn.GELU())
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.encoder(x))

    print("argv", sys.argv)
    print("name", __name__, "file", __file__, "path0", sys.path[0])
    steps, status = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    for step in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item()!r}")
        print(f"err {step}", file=sys.stderr)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state.update({f"opt.{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items() if torch.is_tensor(v)})
    save_file(state, os.environ["RESULT"])
    # After the last recorded step nothing of tracecmp is left in the way.
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.nn.modules import module
    print("clean", not _get_current_dispatch_mode_stack(), not module._global_forward_pre_hooks,
          not module._global_forward_hooks, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
          nn.Module.__call__ is nn.Module._wrapped_call_impl)
    if status == 99:
        raise RuntimeError("the program failed")
    sys.exit(status)
    '''
)


def _run(argv: list[str], cwd: Path, result: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    # "python" and "torchrun" in a recorded command are this interpreter's, as in its activated environment.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RESULT": str(result), "PATH": path}
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def _own_lines_removed(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("tracecmp:"))


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


def _record(script: Path, *options: str, args: tuple[str, ...] = ("4", "0"), python: bool = True):
    trace = script.parent / "trace"
    argv = [
        sys.executable,
        "-m",
        "tracecmp",
        "record",
        "-o",
        str(trace),
        *options,
        "--",
        *(["python"] if python else []),
        script.name,
        *args,
    ]
    return _run(argv, script.parent, script.parent / "recorded.safetensors"), trace


def _plain(script: Path, args: tuple[str, ...] = ("4", "0")) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, script.name, *args], script.parent, script.parent / "plain.safetensors")


def _bitwise_equal(a: Path, b: Path) -> None:
    first, second = load_file(str(a)), load_file(str(b))
    assert first.keys() == second.keys() and len(first) > 6
    for key in first:
        assert first[key].dtype == second[key].dtype and first[key].shape == second[key].shape
        assert first[key].view(-1).view(torch.uint8).equal(second[key].view(-1).view(torch.uint8)), key


def test_a_plain_loop_is_recorded_for_steps_0_and_1_and_runs_as_without_tracecmp(script: Path) -> None:
    recorded, trace_path = _record(script)
    plain = _plain(script)
    assert recorded.returncode == plain.returncode == 0, recorded.stderr
    assert recorded.stdout == plain.stdout  # argv, __name__, __file__, sys.path[0], losses, "clean True ..."
    assert "clean True True True True True" in recorded.stdout
    assert _own_lines_removed(recorded.stderr) == plain.stderr
    assert "tracecmp: recording steps 0-1 of train.py into" in recorded.stderr
    _bitwise_equal(script.parent / "recorded.safetensors", script.parent / "plain.safetensors")

    trace = tracecmp.load(trace_path)
    assert trace.complete
    ops = trace.to_frame()
    assert sorted(ops["step"].unique()) == [0, 1]
    for step in (0, 1):
        assert set(ops[ops["step"] == step]["phase"]) == {"forward", "backward", "optimizer"}
    modules = set(ops["module"])
    assert {"encoder.0", "encoder.1", "head"} <= modules  # as Net().named_modules() spells them
    names = set(ops[ops["kind"] == "source"]["name"])
    assert {"encoder.0.weight", "head.bias", "x"} <= names
    assert "Net" in trace.rank(0).manifest["info"]["models"]


def test_every_step_recorded_still_changes_nothing(script: Path) -> None:
    recorded, trace_path = _record(script, "--steps", "all", "--data", "tensors", args=("3", "0"))
    plain = _plain(script, ("3", "0"))
    assert recorded.returncode == 0
    # Every step recorded: capture is still installed when the program checks ("clean False ...").
    assert recorded.stdout.split("clean")[0] == plain.stdout.split("clean")[0]
    _bitwise_equal(script.parent / "recorded.safetensors", script.parent / "plain.safetensors")
    assert tracecmp.load(trace_path).rank(0).manifest["steps"] == [0, 1, 2]


def test_the_exit_status_and_the_traceback_are_the_programs(script: Path) -> None:
    recorded, trace_path = _record(script, args=("3", "7"))
    assert recorded.returncode == _plain(script, ("3", "7")).returncode == 7
    assert tracecmp.load(trace_path).complete  # steps 0 and 1 finished before the program's end

    recorded, trace_path = _record(script, "--force", "--steps", "all", args=("2", "99"))
    plain = _plain(script, ("2", "99"))
    assert recorded.returncode == plain.returncode == 1
    assert _own_lines_removed(recorded.stderr) == plain.stderr  # no tracecmp frame in the traceback
    trace = tracecmp.load(trace_path)
    assert not trace.complete
    stopped = trace.rank(0).stopped
    assert stopped["kind"] == "error" and "RuntimeError: the program failed" in stopped["reason"]


def test_module_form_and_exit_after(tmp_path: Path, script: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(TRAIN)
    trace = tmp_path / "trace"
    argv = [
        sys.executable,
        "-m",
        "tracecmp",
        "record",
        "-o",
        str(trace),
        "--steps",
        "0",
        "--exit-after",
        "--",
        "-m",
        "pkg.train",
        "5",
        "3",
    ]
    recorded = _run(argv, tmp_path, tmp_path / "r.safetensors")
    plain = _run([sys.executable, "-m", "pkg.train", "5", "3"], tmp_path, tmp_path / "p.safetensors")
    assert recorded.returncode == 0, recorded.stderr  # ended after step 0 by --exit-after
    assert plain.returncode == 3
    assert recorded.stdout.splitlines()[:2] == plain.stdout.splitlines()[:2]  # argv and __main__ as python -m gives
    assert "step 1" not in recorded.stdout and "ending the program after step 0" in recorded.stderr
    assert tracecmp.load(trace).rank(0).manifest["steps"] == [0]


def test_an_existing_trace_is_refused_before_the_program_runs(script: Path) -> None:
    with tracecmp.TraceCompare(script.parent / "trace"):
        torch.ones(2).mul(2)
    again, trace = _record(script)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.strip().count("\n") == 0 and "--force" in again.stderr and str(trace) in again.stderr


def test_a_program_without_a_model_says_so_and_leaves_no_trace(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "tracecmp",
        "record",
        "-o",
        "t",
        "--",
        "-c",
        "import torch, sys; print((torch.ones(2) * 3).sum().item()); sys.exit(4)",
    ]
    result = _run(argv, tmp_path, tmp_path / "unused")
    assert result.returncode == 4 and result.stdout == "6.0\n"
    assert "never ran the forward of a torch.nn.Module" in result.stderr
    with pytest.raises(tracecmp.TracecmpError):
        tracecmp.load(tmp_path / "t")  # nothing that could pass for a good trace


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DDP = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    for step in range(3):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sys.stdout.write(f"rank {rank} step {step} loss {loss.item()!r}\\n")  # one write: lines of two ranks never mix
        sys.stdout.flush()
    dist.destroy_process_group()
    # torch's gloo backend aborts at interpreter exit now and then ("terminate called without an
    # active exception": 2 to 5 of 20 runs of this script under plain torchrun, torch 2.13 CPU): both
    # runs skip the exit's teardown, so that the return codes compare what recording changed.
    os._exit(0)
    """
)


def test_torchrun_with_two_ranks_writes_a_folder_per_rank(tmp_path: Path) -> None:
    (tmp_path / "ddp.py").write_text(DDP)
    launch = [
        "torchrun",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "ddp.py",
    ]
    recorded = _run(
        [sys.executable, "-m", "tracecmp", "record", "-o", "trace", "--", *launch], tmp_path, tmp_path / "x"
    )
    launch[launch.index("--master-port") + 1] = str(_free_port())
    plain = _run(launch, tmp_path, tmp_path / "x")
    assert recorded.returncode == plain.returncode == 0, recorded.stderr[-3000:]
    assert sorted(recorded.stdout.splitlines()) == sorted(plain.stdout.splitlines())  # same losses on each rank
    trace = tracecmp.load(tmp_path / "trace")
    assert trace.ranks == [0, 1] and trace.complete
    for rank in (0, 1):
        manifest = trace.rank(rank).manifest
        assert manifest["world_size"] == 2 and manifest["steps"] == [0, 1]
        ops = trace.to_frame(rank)
        assert set(ops["phase"]) == {"forward", "backward", "optimizer"}
        assert {"module.0", "module.2"} <= set(ops["module"])  # as the DDP wrapper's named_modules() spells them


def test_ab_records_both_commands_the_same_way_and_compares(script: Path) -> None:
    (script.parent / "train_tanh.py").write_text(TRAIN.replace("nn.GELU()", 'nn.GELU(approximate="tanh")'))
    argv = [
        sys.executable,
        "-m",
        "tracecmp",
        "ab",
        "-o",
        "ab",
        "--bench",
        "python train.py 4 0",
        "--target",
        "python train_tanh.py 4 0",
    ]
    result = _run(argv, script.parent, script.parent / "r.safetensors")
    assert result.returncode == 1, result.stderr[-3000:]  # compare's "divergence found"
    assert "first divergence at aten.gelu.default in encoder.1 (forward, step 0)" in result.stdout
    for name in ("bench", "target"):
        assert tracecmp.load(script.parent / "ab" / "traces" / name).rank(0).manifest["steps"] == [0, 1]
    assert (script.parent / "ab" / "report.html").exists()


def test_record_and_inspect_say_alike_what_a_trace_cut_in_step_0_keeps(tmp_path: Path) -> None:
    code = "import torch, sys; torch.nn.Linear(2, 2)(torch.ones(2)).sum().backward(); sys.exit(3)"
    result = _run([sys.executable, "-m", "tracecmp", "record", "-o", "t", "--", "-c", code], tmp_path, tmp_path / "x")
    assert result.returncode == 3, result.stderr
    kept = "it keeps no whole step, step 0 in part"  # the step never ended: nothing of it is whole
    assert f"(the program exited with status 3); {kept}" in result.stderr
    from tracecmp.cli.inspect import summarize

    assert f"complete  NO: the program exited with status 3, in step 0; {kept}" in summarize(tmp_path / "t")


LOADER = textwrap.dedent(
    '''
    """Training on a DataLoader whose workers call a transform module before the model runs."""
    import sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    class Shift(nn.Module):  # a transform, as every torchvision transform is a Module
        def forward(self, x):
            return x.flip(0) * 2.0 + 1.0

    class Data(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            self.transform = Shift()

        def __len__(self):
            return 16

        def __getitem__(self, i):
            return self.transform(self.x[i]), self.y[i]

    if __name__ == "__main__":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        start = sys.argv[1]  # a start method, or "inline": no workers
        workers = dict(num_workers=2, multiprocessing_context=start, timeout=60) if start != "inline" else {}
        loader = DataLoader(Data(), batch_size=8, **workers)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"loss {loss.item()!r}")
    '''
)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_dataloader_workers_record_nothing_and_the_main_process_its_steps(
    tmp_path: Path, start: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The workers call the transform module first: only the process running the model records."""
    script = tmp_path / "train.py"
    script.write_text(LOADER)
    # The untraced reference, here and without workers (the same kernels on the same batches):
    # a second interpreter, with workers of its own to start, would cost seconds.
    monkeypatch.setattr(sys, "argv", [script.name, "inline"])
    with torch.random.fork_rng(devices=[]):
        runpy.run_path(str(script), run_name="__main__")
    plain = capsys.readouterr().out
    trace_path = tmp_path / "trace"
    argv = [sys.executable, "-m", "tracecmp", "record", "-o", str(trace_path), "--", script.name, start]
    recorded = _run(argv, tmp_path, tmp_path / "unused", timeout=120)
    assert recorded.returncode == 0, recorded.stderr[-3000:]
    assert recorded.stdout == plain and plain.count("loss") == 2  # the workers' batches, unchanged
    # tracecmp's own lines only: no worker warned of a trace in the way, none said it recorded nothing.
    assert _own_lines_removed(recorded.stderr) == ""
    assert recorded.stderr.count("tracecmp: ") == 2 and "trace written to" in recorded.stderr

    trace = tracecmp.load(trace_path)
    assert trace.complete and trace.ranks == [0]
    assert sorted(p.name for p in trace_path.iterdir()) == ["manifest.json", "rank0"]
    assert trace.rank(0).manifest["info"]["models"] == ["Sequential"]  # never the workers' Shift
    ops = trace.to_frame()
    assert sorted(ops["step"].unique()) == [0, 1]
    for step in (0, 1):
        assert set(ops[ops["step"] == step]["phase"]) == {"forward", "backward", "optimizer"}
    assert {"0", "2"} <= set(ops["module"])
    assert "aten.flip.default" not in set(ops["op"])  # the transform ran in the workers only

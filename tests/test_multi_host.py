"""Several processes joined into one runtime (``dflash_jax.runtime.distributed``): two CPU processes of one
device each run ``python -m dflash_jax.generate --tp 2`` over both, as two hosts would, and give
what one process gives at --tp 1; the flags that join them are checked before anything starts."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import make_copy_draft, make_copy_target, save_draft, save_target, subprocess_xla_flags

from dflash_jax.runtime import distributed

from dflash_jax.entrypoints import arguments, generate

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "t5 t9 t13 t17 t21 t25 t29 t33"  # longer than the copy period: the draft is often right
TIMEOUT = 900  # seconds a process may take before the test kills them all (generous: CI machines are loaded)


@pytest.fixture(scope="module")
def copy_model(tmp_path_factory):
    """A copy target (vocabulary 128, 2 KV heads: splits over 2) with its draft and a word-level
    tokenizer whose tokens are "t1" .. "t127" ("<eos>" is 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    target = make_copy_target()
    save_target(target, target_dir)
    save_draft(make_copy_draft(target, block_size=8), draft_dir)
    tokenizer = Tokenizer(models.WordLevel({"<eos>": 0, **{f"t{i}": i for i in range(1, 128)}}, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(target_dir / "tokenizer.json"))
    (target_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return target_dir, draft_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generate(per_process: list[list]) -> list[subprocess.CompletedProcess]:
    """``python -m dflash_jax.generate`` once per entry of ``per_process`` (its arguments), all at
    once, each on one CPU device; every one still running after ``TIMEOUT`` is killed."""
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": subprocess_xla_flags(1), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"]}
    processes = [subprocess.Popen([sys.executable, "-m", "dflash_jax.generate", *map(str, args)], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for args in per_process]
    try:
        deadline = time.monotonic() + TIMEOUT
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(processes, outputs)]


def _joined(args: list, num_processes: int = 2) -> list[list]:
    """``args`` for each of ``num_processes`` processes, joined at a free local port."""
    port = _free_port()
    return [[*args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", num_processes, "--process-id", i]
            for i in range(num_processes)]


def _own_lines(stderr: str) -> list[str]:
    """stderr without gloo's line announcing its connections (CPU collectives print it)."""
    return [line for line in stderr.splitlines() if not line.startswith("[Gloo] ")]


def test_two_processes_generate_what_one_does(copy_model, tmp_path):
    """--tp 2 over two processes of one device each: the same text and acceptance lengths as one
    process at --tp 1; only process 0 prints and writes --stats-json; both exit 0."""
    target_dir, draft_dir = copy_model
    args = ["--target", target_dir, "--draft", draft_dir, "--prompt", PROMPT, "--max-new-tokens", 20,
            "--dtype", "float32", "--impl", "reference"]
    [single] = _generate([[*args, "--stats-json", tmp_path / "single.json"]])
    assert single.returncode == 0, single.stderr
    joined = _joined([*args, "--tp", 2])
    runs = _generate([run_args + ["--stats-json", tmp_path / f"process{i}.json"] for i, run_args in enumerate(joined)])
    assert [run.returncode for run in runs] == [0, 0], [run.stderr for run in runs]

    first, second = runs
    assert first.stdout == single.stdout and first.stdout.startswith(PROMPT)
    assert "on 2 x cpu over 2 processes" in first.stderr
    assert second.stdout == "" and _own_lines(second.stderr) == []
    assert not (tmp_path / "process1.json").exists()
    ours, theirs = (json.loads((tmp_path / name).read_text())["dflash"] for name in ("process0.json", "single.json"))
    for key in ("steps", "new_tokens", "histogram", "position_acceptance", "tau", "finish_reasons"):
        assert ours[key] == theirs[key], key
    assert ours["tau"] > 1.5  # the draft's tokens were accepted: the split draft and target agree


def test_one_process_failing_stops_the_others(copy_model):
    """A process whose input is refused (here its draft folder is missing) stops every process at
    once, each with one error line, instead of leaving the others waiting in a collective."""
    target_dir, draft_dir = copy_model
    joined = _joined(["--target", target_dir, "--prompt", PROMPT, "--dtype", "float32", "--tp", 2])
    joined[0] += ["--draft", draft_dir]
    joined[1] += ["--draft", draft_dir.parent / "no-such-draft"]
    first, second = _generate(joined)
    assert (first.returncode, second.returncode) == (2, 2)
    assert _own_lines(first.stderr)[-1] == "error: process 1 of 2 stopped with an error (its output says why)"
    assert _own_lines(second.stderr) == [f"error: {draft_dir.parent / 'no-such-draft' / 'config.json'} not found: "
                                         "expected an HF model folder with config.json"]
    assert first.stdout == second.stdout == ""


def test_tp_must_span_every_device_of_every_process(copy_model):
    target_dir, _ = copy_model
    runs = _generate(_joined(["--target", target_dir, "--no-draft", "--tp", 1]))
    for run in runs:
        assert run.returncode == 2
        assert _own_lines(run.stderr) == ["error: --tp 1: 2 processes split the model over all their devices, "
                                          "2 in all: pass --tp 2"]


@pytest.mark.parametrize("flags, environment, message", [
    (["--coordinator", "10.0.0.1:1234"], {},
     "--coordinator given without --num-processes (or $JAX_NUM_PROCESSES) and --process-id (or $JAX_PROCESS_ID): "
     "several processes need all three"),
    ([], {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_PROCESS_ID": "1"},
     "$JAX_COORDINATOR_ADDRESS, $JAX_PROCESS_ID given without --num-processes (or $JAX_NUM_PROCESSES)"),
    (["--num-processes", "2", "--process-id", "2"], {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"},
     "--process-id 2 is out of range for 2 processes (0 .. 1)"),
    (["--process-id", "0"], {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "0"},
     "$JAX_NUM_PROCESSES must be an integer >= 1, got '0'"),
    (["--coordinator", "h:1", "--num-processes", "two", "--process-id", "0"], {},
     "--num-processes must be an integer >= 1, got 'two'"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "-1"], {},
     "--process-id must be an integer >= 0, got '-1'"),
    (["--coordinator", "10.0.0.1", "--num-processes", "2", "--process-id", "0"], {},
     "--coordinator must be HOST:PORT with a port in [1, 65535] (10.0.0.1:1234), got '10.0.0.1'"),
    (["--coordinator", ":1234", "--num-processes", "2", "--process-id", "0"], {}, "got ':1234'"),
    (["--coordinator", "host:65536", "--num-processes", "2", "--process-id", "0"], {}, "got 'host:65536'"),
    (["--coordinator", "host:0", "--num-processes", "2", "--process-id", "0"], {}, "got 'host:0'"),
    (["--coordinator", "host:http", "--num-processes", "2", "--process-id", "0"], {}, "got 'host:http'"),
])
def test_bad_process_flags_are_one_error_line_before_anything_starts(monkeypatch, capsys, flags, environment,
                                                                      message):
    for variable in distributed.ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **_: pytest.fail("joined"))
    assert generate.main(["--no-draft", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_process_flags_fall_back_to_the_environment(monkeypatch):
    """Each flag's environment variable stands in for it; a flag wins over its variable; neither
    set means one process (nothing to join)."""
    parser = arguments.generate_parser()
    for variable in distributed.ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    assert distributed.processes(parser.parse_args([])) is None
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "[fd00::1]:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert distributed.processes(parser.parse_args([])) == distributed.Processes("[fd00::1]:1234", 4, 3)
    assert (distributed.processes(parser.parse_args(["--process-id", "1", "--coordinator", "h:9"]))
            == distributed.Processes("h:9", 4, 1))

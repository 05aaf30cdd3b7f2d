"""docs/launch.md's commands are the ones the code accepts.

Every bash block of docs/launch.md that runs ``rstarjax.main`` carries a marker
``<!-- check: devices=N processes=P -->``; each command line in it (also the one inside a
``gcloud ... --command="..."``) is expanded with the block's own shell variables (a tiny HF model
dir and problem file stand in for ``$MODEL`` and ``$DATA``, the only paths a user must give;
``$PROCESS_ID`` takes every value 0..P-1) and checked by ``rstarjax.check_config`` on N devices in
P processes: the config file must exist, every key and value must validate, the mesh must fit the
devices and the batch the mesh and the processes. The checker itself is tested to refuse what a
launch would refuse.
"""
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
LAUNCH_MD = os.path.join(ROOT, "docs", "launch.md")

MARKED_BLOCK = re.compile(r"<!-- check: devices=(\d+) processes=(\d+) -->\s*```bash\n(.*?)```", re.S)
ANY_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}


@pytest.fixture(scope="module")
def user_paths(tmp_path_factory):
    """What a user brings: a HF model dir (config.json, safetensors, tokenizer: the checks at
    start read their headers) and a problems file."""
    from test_stages import _tiny_hf_model

    d = tmp_path_factory.mktemp("user")
    _tiny_hf_model(str(d / "model"))
    (d / "problems.jsonl").write_text('{"problem": "What is 1 + 1?", "answer": "2"}\n')
    return {"MODEL": str(d / "model"), "DATA": str(d / "problems.jsonl")}


def _logical_lines(block: str) -> list[str]:
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _assignments(line: str) -> dict[str, str] | None:
    """``A=1 B=2`` (or ``export A=1``) as a dict; None for any other line."""
    tokens = shlex.split(line, comments=True)
    if tokens[:1] == ["export"]:
        tokens = tokens[1:]
    if not tokens or not all(ASSIGNMENT.match(t) for t in tokens):
        return None
    return dict(t.split("=", 1) for t in tokens)


def _expand(line: str, env: dict[str, str]) -> str:
    def sub(m):
        if m.group(1) not in env:
            raise AssertionError(f"docs/launch.md uses ${m.group(1)}, which its block does not set: {line}")
        return env[m.group(1)]

    return VARIABLE.sub(sub, line)


def _main_args(tokens: list[str]) -> list[str] | None:
    """The arguments after ``-m rstarjax.main`` (or ``rstarjax.check_config``), looking inside
    ``--command="..."`` strings too; None when the tokens run neither."""
    for i, tok in enumerate(tokens):
        if tok in ("rstarjax.main", "rstarjax.check_config") and i and tokens[i - 1] == "-m":
            args = []
            for a in tokens[i + 1:]:
                if a in SHELL_OPERATORS:
                    break
                args.append(a)
            return args
        if "rstarjax." in tok and " " in tok:
            inner = _main_args(shlex.split(tok.split("=", 1)[1] if tok.startswith("--") else tok))
            if inner is not None:
                return inner
    return None


def documented_launches(text: str, user_paths: dict[str, str]):
    """(devices, processes, argv) for each rstarjax.main command line of the marked blocks and
    each value of $PROCESS_ID."""
    out = []
    for devices, processes, block in MARKED_BLOCK.findall(text):
        env = {}
        for line in _logical_lines(block):
            assigned = _assignments(line)
            if assigned is not None:
                env.update(assigned)
                continue
            if "rstarjax.main" not in line:
                continue
            for pid in range(int(processes)) if "PROCESS_ID" in env else [None]:
                values = {**env, **user_paths, **({"PROCESS_ID": str(pid)} if pid is not None else {})}
                args = _main_args(shlex.split(_expand(line, values), comments=True))
                assert args, f"no rstarjax.main arguments found in: {line}"
                out.append((int(devices), int(processes), args))
    return out


def test_every_launch_command_in_the_docs_validates(user_paths, monkeypatch):
    from rstarjax.check_config import check

    monkeypatch.chdir(ROOT)  # the commands run from the repository root (configs/...)
    text = open(LAUNCH_MD).read()
    unmarked = [b for b in ANY_BLOCK.findall(text) if "rstarjax.main" in b]
    assert len(unmarked) == len(MARKED_BLOCK.findall(text)), "a block of docs/launch.md runs rstarjax.main " \
        "without a <!-- check: devices=N processes=P --> marker"
    launches = documented_launches(text, user_paths)
    # the TPU pod, the GPU host, 4 process ids x the GPU hosts, SLURM, MI300X
    assert len(launches) >= 8
    assert any("--config.distributed.auto=True" in a for _, _, a in launches)
    assert any(p > 1 and "--config.distributed.auto=True" not in a for _, p, a in launches)
    for devices, processes, argv in launches:
        run = check(argv, devices, processes)
        # (an evaluation reads its problems from eval.paths)
        data = run.eval.paths if run.mode == "eval" else run.data.train_path
        assert run.model.hf_path == user_paths["MODEL"] and data == user_paths["DATA"]
    ids = [check(a, d, p).distributed.process_id for d, p, a in launches if "--config.distributed.process_id" in " ".join(a)]
    # the four GPU hosts, the training and the rollout host, two training and two rollout hosts
    assert sorted(ids) == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]


def test_the_documented_check_output_is_what_the_checker_prints(user_paths, monkeypatch, capsys):
    from rstarjax import check_config

    monkeypatch.chdir(ROOT)
    [block] = [b for b in ANY_BLOCK.findall(open(LAUNCH_MD).read()) if "rstarjax.check_config" in b]
    lines = block.replace("\\\n", " ").splitlines()
    command = next(line for line in lines if "rstarjax.check_config" in line)
    expected = " ".join(line.strip().lstrip("#").strip() for line in lines if line.strip().startswith("#"))
    argv = _main_args(shlex.split(_expand(command, user_paths)))
    assert check_config.main(argv) == 0
    assert " ".join(capsys.readouterr().out.split()) == " ".join(expected.split())


def test_the_readme_links_the_launch_guide():
    assert "docs/launch.md" in open(os.path.join(ROOT, "README.md")).read()


# ------------------------------------------------------------------ the checker refuses bad launches
TPU = ["--config=configs/stage1.py", "--config.distributed.auto=True", "--config.trainer.micro_batch_size=32"]


def _argv(user_paths, *extra, base=TPU):
    return [*base, f"--config.model.hf_path={user_paths['MODEL']}", f"--config.data.train_path={user_paths['DATA']}",
            *extra]


@pytest.mark.parametrize("argv_extra, devices, processes, message", [
    ((), 30, 6, "must be a multiple of data\\*fsdp=30"),  # the same line on 30 devices: 32 rows do not split
    (("--config.mesh.fsdp=32",), 30, 6, "does not fit the 30 devices"),
    (("--config.trainer.micro_batch_size=16",), 32, 8, "must be a multiple of data\\*fsdp=32"),
    (("--config.rl.prompts_per_step=500",), 32, 8, "multiple of the 8 processes"),
    (("--config.mesh.tensor=3",), 32, 8, "does not fit the 32 devices"),
    (("--config.distributed.process_id=1",), 32, 8, "auto=True finds the processes"),
    (("--config.rl.max_turn=5",), 32, 8, "does not parse"),
])
def test_the_checker_refuses_what_a_launch_refuses(user_paths, monkeypatch, argv_extra, devices, processes, message):
    from rstarjax.check_config import check
    from rstarjax.validation import ConfigError

    monkeypatch.chdir(ROOT)
    check(_argv(user_paths), 32, 8)  # the documented TPU line passes ...
    with pytest.raises(ConfigError, match=message):  # ... and each change breaks it
        check(_argv(user_paths, *argv_extra), devices, processes)


def test_the_checker_describes_the_trainers_mesh_of_a_disaggregated_run(user_paths, monkeypatch):
    """Disaggregated, the trainer's mesh spans the devices the rollouts leave it (as a launch
    builds it): 4 devices with 2 for rollouts give fsdp=2 and 1 row of each 2-row micro-batch per
    device (the checker printed fsdp=4 and "0 per device")."""
    from rstarjax.check_config import check, describe

    monkeypatch.chdir(ROOT)
    argv = _argv(user_paths, "--config.serving.placement=disaggregated", "--config.serving.rollout_devices=2",
                 "--config.trainer.micro_batch_size=2", "--config.rl.prompts_per_step=2",
                 "--config.rl.group_size=2", "--config.rl.oversample=4", base=["--config=configs/stage1.py"])
    line = describe(check(argv, 4, 1), 4, 1)
    assert "mesh data=1 fsdp=2 tensor=1 on the trainer's 2 devices" in line and "(1 per device)" in line, line


def test_the_checker_refuses_a_missing_config_file_and_bad_process_ids(user_paths, monkeypatch):
    from rstarjax.check_config import check
    from rstarjax.validation import ConfigError

    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match="cannot load the config file.*stage9"):
        check(_argv(user_paths, base=["--config=configs/stage9.py"]), 8, 1)
    hosts = ["--config=configs/stage1.py", "--config.distributed.num_processes=4",
             "--config.distributed.coordinator_address=10.0.0.1:8476", "--config.trainer.micro_batch_size=32"]
    for pid in range(4):
        assert check(_argv(user_paths, f"--config.distributed.process_id={pid}", base=hosts), 32).distributed.process_id == pid
    with pytest.raises(ConfigError, match=r"process_id=4 must be in \[0, num_processes=4\)"):
        check(_argv(user_paths, "--config.distributed.process_id=4", base=hosts), 32)
    with pytest.raises(ConfigError, match="give process 0's HOST:PORT"):
        check(_argv(user_paths, "--config.distributed.coordinator_address=10.0.0.1", base=hosts), 32)
    with pytest.raises(ConfigError, match="num_processes=4 but the cluster has 8 processes"):
        check(_argv(user_paths, base=hosts), 32, 8)
    with pytest.raises(ConfigError, match="does not exist"):
        check(["--config=configs/stage1.py", "--config.model.hf_path=/no/such/model",
               f"--config.data.train_path={user_paths['DATA']}"], 8, 1)


def test_the_checker_keeps_what_the_command_line_sets_under_a_profile_as_main_does(user_paths, monkeypatch):
    """--config.profile=rstar2_official sets the official sizes unless the command line gives its
    own, as main parses it (``explicit``): the checker put the profile's 128 prompts back and
    refused a line main accepts; an override before a --config that does not load is one line,
    not a traceback."""
    from rstarjax.check_config import check
    from rstarjax.validation import ConfigError

    monkeypatch.chdir(ROOT)
    argv = _argv(user_paths, "--config.profile=rstar2_official", "--config.rl.prompts_per_step=3",
                 "--config.trainer.micro_batch_size=0", "--config.distributed.auto=True",
                 base=["--config=configs/stage1.py"])
    run = check(argv, 6, 3)
    assert run.rl.prompts_per_step == 3
    with pytest.raises(ConfigError, match="cannot load the config file.*nope"):
        check(["--config.rl.group_size=4", "--config=configs/nope.py"], 1)


def test_main_refuses_a_stray_argument_in_one_line():
    r = subprocess.run([sys.executable, "-m", "rstarjax.main", "--config=configs/demo.py", "stray"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "unexpected arguments: ['stray']", r.stderr[-2000:]

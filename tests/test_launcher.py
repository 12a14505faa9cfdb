import getpass
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from stoker.config import RetryConfig
from stoker.launch.local import LocalLauncher, terminate_tree
from stoker.launch.retry import Outcome, classify_exit, describe_exit, run_with_retries


@pytest.mark.parametrize(("code", "outcome"), [
    (0, Outcome.COMPLETED), (75, Outcome.PREEMPTED), (137, Outcome.INFRASTRUCTURE),
    (-9, Outcome.INFRASTRUCTURE), (1, Outcome.USER_ERROR), (2, Outcome.USER_ERROR),
    (143, Outcome.USER_ERROR), (74, Outcome.STORAGE),
])
def test_exit_code_contract(code, outcome):
    assert classify_exit(code) is outcome


def test_a_full_disk_is_its_own_outcome_and_is_not_retried():
    """New-user trial: a checkpoint on a full disk read `UserError('exit 2: user_error')`, as
    if the training code had a bug. The ranks exit 74 (EX_IOERR): `storage_error`, a Failed
    state named StorageError, never retried (the next attempt would meet the same disk), even
    with a budget for user errors."""
    from tasks.stopping import attempt_state

    state = attempt_state(74, None)
    assert (state.type.value, state.name, state.message) == (
        "FAILED", "StorageError", "exit 74: storage_error")
    codes = iter([74, 0])
    attempts = run_with_retries(lambda n: next(codes), RetryConfig(
        max_user_errors=3, max_infra_failures=3, backoff_s=0), sleep=lambda s: None)
    assert [a.outcome for a in attempts] == [Outcome.STORAGE]


@pytest.mark.parametrize(("code", "text"), [
    (137, "137 (SIGKILL)"), (-9, "137 (SIGKILL)"), (-15, "143 (SIGTERM)"), (75, "75"),
    (0, "0"), (2, "2"), (200, "200"),
])
def test_an_exit_code_is_described_the_shell_way_with_its_signal(code, text):
    assert describe_exit(code) == text


def test_a_ranks_own_137_is_not_described_as_a_kill(tmp_path):
    """New-user trial: a data stall (the rank chose 137) read `exit 137 (SIGKILL)` on the
    attempt line, as if the OOM killer had struck. The launcher's line names the rank; the
    attempt line then says nothing was killed. A record's field is untrusted: only a rank
    number counts."""
    from stoker.launch.supervisor import LineLog
    from stoker.runtime.launch import rank_ended_line

    assert describe_exit(137, 1) == "137 from rank 1 itself, not a kill"
    assert describe_exit(-9, 1) == "137 (SIGKILL)"  # a real kill stays one
    for junk in (None, "1", True, -1, 1.0):
        assert describe_exit(137, junk) == "137 (SIGKILL)", junk
    assert describe_exit(75, 0) == "75"
    from tasks.stopping import attempt_state  # the attempt-N task run's state says it too

    state = attempt_state(137, None, 1)
    assert state.name == "InfrastructureFailure"
    assert state.message == "exit 137 from rank 1 itself, not a kill: infrastructure_failure"
    log = LineLog(tmp_path / "train.log", lambda line: None)
    log("[rank1] 2026-12-01 11:17:14,374 ERROR stoker.runtime: no batch from the DataLoader "
        "workers in 5 s (train.data_timeout_s) at step 12: ending this attempt")
    assert log.ended_by_rank is None
    log("[node 0] " + rank_ended_line(1))  # in a container, after the node's prefix
    log(rank_ended_line(0))  # the first one counts
    log.close()
    assert log.ended_by_rank == 1


def scripted(codes):
    calls = []

    def launch(number):
        calls.append(number)
        return codes[len(calls) - 1]

    return launch, calls


def test_preemptions_are_retried_until_done():
    launch, calls = scripted([75, 75, 137, 0])
    attempts = run_with_retries(launch, RetryConfig(backoff_s=0), sleep=lambda s: None)
    assert [a.outcome for a in attempts] == [Outcome.PREEMPTED, Outcome.PREEMPTED,
                                            Outcome.INFRASTRUCTURE, Outcome.COMPLETED]
    assert calls == [1, 2, 3, 4]


def test_user_errors_are_not_retried_by_default():
    launch, calls = scripted([1, 0])
    attempts = run_with_retries(launch, RetryConfig(backoff_s=0), sleep=lambda s: None)
    assert calls == [1] and attempts[-1].outcome is Outcome.USER_ERROR


def test_budgets_are_separate():
    launch, calls = scripted([137, 75, 137, 75, 137, 0])
    policy = RetryConfig(max_infra_failures=2, max_preemptions=5, backoff_s=0)
    attempts = run_with_retries(launch, policy, sleep=lambda s: None)
    assert len(calls) == 5  # the third infrastructure failure spends that budget
    assert attempts[-1].outcome is Outcome.INFRASTRUCTURE


def test_backoff_grows_after_failures_and_preemptions_resume_at_once():
    waits = []
    launch, _ = scripted([137, 137, 75, 137, 0])
    policy = RetryConfig(backoff_s=1, backoff_max_s=3, max_infra_failures=5)
    run_with_retries(launch, policy, sleep=waits.append)
    assert waits == [1, 2, 0, 3]


def test_terminate_tree_leaves_no_descendant(tmp_path):
    # A parent that ignores SIGTERM, a child, and an orphan that left the tree (re-parented to
    # init): all of the session must be gone afterwards.
    script = "trap '' TERM; sleep 300 & (sleep 300 &) ; sleep 300"
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    time.sleep(0.5)
    tree = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == proc.pid]
    assert len(tree) >= 3
    terminate_tree(proc.pid, grace_s=1)
    proc.wait(timeout=10)
    time.sleep(0.2)
    alive = [p for p in tree if psutil.pid_exists(p) and
             psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_launcher_kills_the_tree_on_timeout(tmp_path, make_spec):
    spec = make_spec(epochs=200, checkpoint_every_steps=1000, tracking=False)
    launcher = LocalLauncher(2, shutdown_grace_s=2, python=sys.executable)
    with pytest.raises(subprocess.TimeoutExpired):
        launcher.run(spec, on_line=lambda line: None, timeout_s=8)
    time.sleep(0.5)
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(spec) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []


INDUCTOR_CACHE = f"torchinductor_{getpass.getuser()}"  # torch.compile's, in the system's tmp


def test_a_killed_launcher_leaves_nothing_in_the_temporary_folder(tmp_path, make_spec):
    """The launcher kept its stop-committed marker in a temporary folder of its own, which a
    SIGKILL (a second Ctrl-C, a takeover) left behind: one folder in /tmp per such attempt
    (64 of them on this machine). The local launcher now names the marker in the job folder."""
    from stoker.launch.local import discard_standby
    from stoker.runtime.progress import read_events

    spec = make_spec(epochs=200, checkpoint_every_steps=1000, tracking=False)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    discard_standby()  # a fresh launcher, started with this TMPDIR
    launcher = LocalLauncher(2, shutdown_grace_s=5, python=sys.executable,
                             env={"TMPDIR": str(tmp)})

    def kill_when_training():
        deadline = time.monotonic() + 120
        while not any(e.get("event") == "step" for e in read_events(spec.parent)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(launcher.process.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_training)
    killer.start()
    code = launcher.run(spec, on_line=lambda line: None, timeout_s=180)
    killer.join()
    assert code in (-9, 137)
    # nothing but torch's compile cache, one per user and meant to last: torchrun's own
    # folders were in the launcher's, which this call deletes
    assert [p.name for p in tmp.iterdir()] in ([], [INDUCTOR_CACHE])


def test_spot_falls_back_to_on_demand_after_n_preemptions():
    from stoker.config import load_pipeline_config
    from stoker.launch.supervisor import capacity_for

    config = load_pipeline_config(None, ["cost.capacity_type=spot",
                                         "retry.on_demand_after_preemptions=2"])
    assert [capacity_for(config, n) for n in range(4)] == ["spot", "spot", "on_demand",
                                                          "on_demand"]
    on_demand = load_pipeline_config(None, ["retry.on_demand_after_preemptions=1"])
    assert capacity_for(on_demand, 5) == "on_demand"
    never = load_pipeline_config(None, ["cost.capacity_type=spot"])
    assert capacity_for(never, 10) == "spot"


def test_launcher_choice_and_its_errors():
    from stoker.config import ConfigError, load_pipeline_config
    from stoker.launch.docker import DockerLauncher
    from stoker.launch.factory import make_launcher

    assert isinstance(make_launcher(load_pipeline_config(None, []), 2), LocalLauncher)
    with pytest.raises(ConfigError, match="tracking.tracking_uri: launcher.kind=docker logs"):
        load_pipeline_config(None, ["launcher.kind=docker"])
    docker = load_pipeline_config(None, ["launcher.kind=docker",
                                         "tracking.tracking_uri=http://127.0.0.1:5000"])
    with pytest.raises(ConfigError, match="launcher.docker.image: empty"):
        make_launcher(docker, 2)
    launcher = make_launcher(docker, 2, image="127.0.0.1:5000/stoker/train@sha256:abc")
    assert isinstance(launcher, DockerLauncher) and launcher.nproc_per_node == 2
    k8s = load_pipeline_config(None, ["launcher.kind=kubernetes",
                                      "tracking.tracking_uri=http://127.0.0.1:5000",
                                      "launcher.kubernetes.num_nodes=0"])
    with pytest.raises(ConfigError, match="launcher.kubernetes.num_nodes"):
        make_launcher(k8s, 8, image="registry.example/stoker/train@sha256:abc")


# The time every train.log line carries: the ranks' logging format (asctime), local time.
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "


def unstamped(path: Path) -> list[str]:
    """The lines of a train.log as they came, each checked to carry one time: a rank's log line
    its own after `[rankN]`, any other line the time Stoker added in front of it (removed)."""
    lines = []
    for line in path.read_text().splitlines():
        if re.match(rf"\[rank\d+\] {STAMP}", line):
            assert not re.match(rf"\[rank\d+\] {STAMP}{STAMP}", line), line
            lines.append(line)
        else:
            assert re.match(STAMP, line), f"no time: {line!r}"
            lines.append(line[len("2026-12-01 11:17:14,374 "):])
    return lines


def test_every_line_of_the_job_log_has_a_time_torchruns_too(tmp_path, make_spec):
    """New-user trial: torchrun's own lines in train.log had no time (the ranks' lines carry
    theirs), so no one could tell when torchrun said what. A real attempt stopped by SIGTERM
    (torchrun logs the death signal and its SIGTERM to the ranks): each line has one time in the
    ranks' format, and the Prefect log gets the lines as they came."""
    from stoker.launch.supervisor import LineLog

    spec = make_spec(epochs=200, checkpoint_every_steps=1000, tracking=False)
    forwarded: list[str] = []
    log = LineLog(spec.parent / "train.log", forwarded.append)
    log("attempt 1 on on_demand capacity")
    launcher = LocalLauncher(2, shutdown_grace_s=20, python=sys.executable)
    codes: list[int] = []
    attempt = threading.Thread(target=lambda: codes.append(
        launcher.run(spec, on_line=log, timeout_s=240)))
    attempt.start()
    deadline = time.monotonic() + 180
    while not (spec.parent / "heartbeat.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # rank 0 writes it at its first step
    os.kill(launcher.process.pid, signal.SIGTERM)
    attempt.join(timeout=120)
    log.close()
    assert codes == [75]
    text = (spec.parent / "train.log").read_text()
    lines = unstamped(spec.parent / "train.log")
    assert lines[0] == "attempt 1 on on_demand capacity"
    ranks = [line for line in lines if line.startswith("[rank")]
    torchrun = [line for line in lines if "torch/distributed/elastic" in line]
    assert ranks and torchrun, text  # both kinds, each with its time
    assert all(line in forwarded for line in ranks)
    assert re.search(rf"(?m)^{STAMP}attempt 1 on on_demand capacity$", text)
    assert all(not re.match(STAMP, line) for line in forwarded)  # Prefect stamps its own


def test_torchruns_stop_lines_stay_in_the_job_log_not_in_prefects(tmp_path):
    """QA: a normal preemption showed torchrun's `Received 15 death signal`, `Sending process
    ... closing signal SIGTERM` and `E... failed (exitcode: 75)` as warnings and errors in the
    Prefect log, beside Stoker's own "attempt 1 ended: preempted (exit 75)". `stoker logs` keeps
    them; a rank's line and any other failure of torchrun still go through."""
    from stoker.launch.supervisor import LineLog

    agent = "W1201 11:17:14.194000 5550 .venv/lib/python3.11/site-packages/torch/distributed/" \
        "elastic/"
    lines = [
        agent + "agent/server/api.py:733] Received 15 death signal, shutting down workers",
        agent + "multiprocessing/api.py:1028] Sending process 5555 closing signal SIGTERM",
        "E" + agent[1:] + "multiprocessing/api.py:1002] failed (exitcode: 75) local_rank: 0 "
        "(pid: 5556) of binary: /usr/bin/python",
        "E" + agent[1:] + "multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 "
        "(pid: 5556) of binary: /usr/bin/python",
        "[rank0] 2026-12-01 11:17:14,374 WARNING stoker.runtime: stop requested (SIGTERM)",
    ]
    forwarded: list[str] = []
    log = LineLog(tmp_path / "train.log", forwarded.append)
    for line in lines:
        log(line)
    log.close()
    assert unstamped(tmp_path / "train.log") == lines
    assert forwarded == lines[3:]


def test_torchruns_stop_lines_with_forked_ranks_stay_in_the_job_log(tmp_path):
    """QA: with forked ranks torchrun words a stop differently (`Closing process N via signal`,
    `Terminating process N via signal`) and logs the traceback of its own wait for the ranks
    (`ProcessExitedException: process 1 terminated with exit code 75`) line by line: kept in
    train.log, not passed on. So is torchrun's `failed (exitcode ...)` for an exit the rank
    named itself (2, 74, 137); a kill or a bug keeps that line, and a rank's own traceback goes
    through."""
    from stoker.launch.supervisor import LineLog

    def agent(level: str, where: str, text: str) -> str:
        return f"{level}1201 18:29:31.206000 24770 torch/{where}] {text}"

    api = "distributed/elastic/multiprocessing/api.py"
    trace = [agent("E", f"{api}:836", "Traceback (most recent call last):"),
             agent("E", f"{api}:836", '  File "/x/torch/distributed/elastic/multiprocessing/'
                   'api.py", line 791, in _poll'),
             agent("E", f"{api}:836", "    self._pc.join(-1)"),
             agent("E", f"{api}:836", "    raise ProcessExitedException("),
             agent("E", f"{api}:836", "torch.multiprocessing.spawn.ProcessExitedException: "
                   "process 1 terminated with exit code 75")]
    noise = [agent("W", f"{api}:871", "Closing process 5555 via signal SIGTERM"),
             agent("W", "multiprocessing/spawn.py:165", "Terminating process 5556 via signal "
                   "SIGTERM"),
             agent("E", f"{api}:836", "failed (exitcode: 75) local_rank: 1 (pid: 5556) of fn: "
                   "forked_rank (start_method: fork)"), *trace,
             # an exit the rank chose and named in its own line (trial: the full disk's 2
             # reached the terminal): 2 bad input, 74 storage, 137 an infrastructure failure
             *(agent("E", f"{api}:836", f"failed (exitcode: {code}) local_rank: 0 (pid: 5555) "
                     "of fn: forked_rank (start_method: fork)") for code in (2, 74, 137))]
    # a rank a signal ended: said by the attempt's end line in Stoker's words (trial: the raw
    # line reached the terminal), kept raw in train.log
    killed = agent("E", f"{api}:836", "failed (exitcode: -9) local_rank: 1 (pid: 5556) of fn: "
                   "forked_rank (start_method: fork)")
    kept = [agent("E", f"{api}:836", "failed (exitcode: 1) local_rank: 1 (pid: 5556) of fn: "
                  "forked_rank (start_method: fork)"),
            "[rank0] 2026-12-01 18:29:28,316 ERROR stoker.runtime: training failed at step 3",
            "Traceback (most recent call last):", '  File "/x/stoker/runtime/trainer.py"']
    forwarded: list[str] = []
    log = LineLog(tmp_path / "train.log", forwarded.append)
    for line in noise + [killed] + kept:
        log(line)
    log.close()
    assert unstamped(tmp_path / "train.log") == noise + [killed] + kept
    assert forwarded == kept
    assert log.killed == "local rank 1 (pid 5556) was killed by SIGKILL"
    assert describe_exit(137, killed=log.killed) == (
        "137 (SIGKILL): local rank 1 (pid 5556) was killed by SIGKILL")
    assert describe_exit(0, killed=log.killed) == "0"  # it completed anyway
    # in a container, after "[node N] "; an unknown signal number; an untrusted record
    other = LineLog(tmp_path / "other.log", forwarded.append)
    other("[node 1] " + killed.replace("exitcode: -9", "exitcode: -99"))
    assert other.killed == "local rank 1 on node 1 (pid 5556) was killed by signal 99"
    assert describe_exit(1, killed=["x"]) == "1"
    assert describe_exit(1, killed="a\x1b[2Jb" * 100).startswith("1: a[2Jb")


def test_rank_lines_reach_the_prefect_log_at_the_ranks_own_level():
    import logging

    from stoker.launch.supervisor import at_rank_level

    seen: list[tuple[int, str]] = []

    class Recorder(logging.Logger):
        def log(self, level, msg, *args, **kwargs):
            seen.append((level, msg))

    forward = at_rank_level(Recorder("t"))
    lines = ["[rank0] 2026-12-03 14:52:11,974 WARNING stoker.runtime.trainer: checkpoints held",
             "[node 1] [rank3] 2026-12-03 14:52:11,974 ERROR stoker.runtime: data.path x: gone",
             "[rank1] 2026-12-03 14:52:11,974 INFO stoker.runtime.trainer: step 5",
             # torchrun's own, glog style (trial: a rank's SIGKILL read as INFO)
             "E1204 20:04:19.123000 4242 torch/distributed/elastic/multiprocessing/api.py:882] "
             "failed (exitcode: -9) local_rank: 1 (pid: 4250) of fn: forked_rank",
             "[node 1] W1204 20:04:19.123000 4242 torch/distributed/run.py:792] ",
             "attempt 2 on spot capacity", "[rank0] WARNING without a time (a print)",
             "Traceback (most recent call last):", "I1204 20:04:19.123000 4242 torch/x.py:1] x"]
    for line in lines:
        forward(line)
    assert [level for level, _ in seen] == [logging.WARNING, logging.ERROR, logging.INFO,
                                            logging.ERROR, logging.WARNING] + [logging.INFO] * 4
    assert [msg for _, msg in seen] == lines


def test_an_attempt_leaves_no_temporary_folders_behind(make_spec, tmp_path):
    """Trial: every attempt left torchrun's `torchelastic_*` folder, and often multiprocessing's
    `pymp-*`, in /tmp (the launcher and the ranks end with os._exit, so their clean-up never
    runs). They now live in the attempt's own temporary folder, deleted when it ends."""
    import shutil
    import tempfile

    # short, as /tmp is: multiprocessing's Unix sockets in it may not pass 107 bytes
    temporaries = Path(tempfile.mkdtemp(prefix="t-", dir="/tmp"))
    spec = make_spec("temporaries", tracking=False, epochs=1, num_workers=1)
    lines: list[str] = []
    try:
        code = LocalLauncher(2, env={"TMPDIR": str(temporaries)}).run(spec, on_line=lines.append)
        left = sorted(p.name for p in temporaries.iterdir())
    finally:
        shutil.rmtree(temporaries, ignore_errors=True)
    assert code == 0, "\n".join(lines[-40:])
    assert left in ([], [INDUCTOR_CACHE])  # torch's compile cache is meant to last


def test_a_long_temporary_folder_does_not_starve_the_data_workers(make_spec, tmp_path):
    """Found while moving the temporaries: in a TMPDIR whose path leaves no room for
    multiprocessing's Unix sockets (`pymp-*/listener-*`, 107 bytes at most), a DataLoader
    worker could not hand a batch over (`AF_UNIX path too long`) and its rank waited for it
    until train.data_timeout_s, then failed the attempt. The attempt's folder then goes to /tmp.
    """
    deep = tmp_path / ("deep-" + "x" * max(1, 90 - len(str(tmp_path))))
    deep.mkdir()
    spec = make_spec("deep", tracking=False, epochs=1, num_workers=1, data_timeout_s=20)
    lines: list[str] = []
    code = LocalLauncher(2, env={"TMPDIR": str(deep)}).run(spec, on_line=lines.append)
    assert code == 0, "\n".join(lines[-40:])
    assert not any("AF_UNIX path too long" in line for line in lines)
    assert [p.name for p in deep.iterdir()] in ([], [INDUCTOR_CACHE])

"""Several nodes through the launchers (`parallel/launched.py`): torchrun agents on 127.0.0.1 stand in for nodes.

Each "node" is an agent of its own (`torch.distributed.run`, a c10d rendezvous on a free local port), as a job on two
machines would be started; a simulated SLURM job step starts the ranks with the variables srun sets. A launched job
must train exactly what hslite trains when it spawns the same ranks on one box.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FIT = [
    "recipe=quickstart",
    "model.name=cnn1d",
    "data.patch_size=1",
    "data.pca_components=0",
    "data.augment=false",
    "data.batch_size=32",
    "train.max_epochs=2",
    "train.refit=false",
    "train.progress=false",
    "output.save_map=false",
    "preflight.enabled=false",
]
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _node_cores(node: int, nodes: int) -> Callable[[], None]:
    """Pin a "node" to its share of this machine's cores, as a machine of its own would be.

    A rank's thread count follows the cores it sees (`box.threads_per_process`): unpinned, the one rank of each of
    two "nodes" would run all cores' threads, the spawned box's ranks half as many, and their sums would round apart.
    """
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // nodes)
    mine = set(cores[node * share : (node + 1) * share]) or {cores[node % len(cores)]}
    return lambda: os.sched_setaffinity(0, mine)


def _torchrun_nodes(
    out: Path, nodes: int, per_node: int, *overrides: str, agent: tuple[str, ...] = ()
) -> list[subprocess.Popen]:
    """One torchrun agent per "node", each with its own log; node ranks come from the c10d rendezvous."""
    port, agents = _free_port(), []
    for node in range(nodes):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=hslite-test",
                   "--max-restarts=0", *agent, "-m", "hslite", "fit", *FIT, f"parallel.num_nodes={nodes}",
                   f"parallel.devices={per_node}", f"output.root={out}", *overrides]  # fmt: skip
        log = (out / f"node{node}.log").open("w")
        agents.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=out,
                                       start_new_session=True, preexec_fn=_node_cores(node, nodes)))  # fmt: skip
    return agents


def _wait(agents: list[subprocess.Popen], out: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    for node, agent in enumerate(agents):
        code = agent.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert code == 0, (out / f"node{node}.log").read_text()[-4000:]


def _metrics(root: Path) -> dict:
    (run,) = [d for d in (root / "quickstart").iterdir() if d.is_dir() and "." not in d.name]
    return json.loads((run / "metrics.json").read_text())


def _one_box(out: Path, devices: int, *overrides: str) -> dict:
    command = [sys.executable, "-m", "hslite", "fit", *FIT, f"parallel.devices={devices}", f"output.root={out}",
               *overrides]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=out, timeout=400, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return _metrics(out)


@pytest.mark.parametrize(
    "nodes, per_node, layout",
    [
        pytest.param(2, 1, [], id="dp"),
        pytest.param(2, 1, ["parallel.compression=int8"], id="int8"),
        pytest.param(2, 1, ["parallel.fsdp=true"], id="fsdp"),
        # one replica per node: its shard group is the node's one rank (on one box, plain FSDP over both)
        pytest.param(2, 1, ["parallel.fsdp=true", "parallel.hybrid_shard=true"], id="hsdp"),
        # one node under torchrun is a launched job too; two ranks of a node split the channel groups
        pytest.param(
            1, 2, ["model.name=channel_vit", "parallel.chag=2", "parallel.rotation_groups=2"], id="chag2-rot2"
        ),
    ],
)
def test_torchrun_nodes_train_what_one_box_trains_with_the_same_ranks(tmp_path, nodes, per_node, layout) -> None:
    launched_root, box = tmp_path / "nodes", tmp_path / "box"
    launched_root.mkdir(), box.mkdir()
    _wait(_torchrun_nodes(launched_root, nodes, per_node, *layout), launched_root)
    launched = _metrics(launched_root)  # one run folder, written by global rank 0
    spawned = _one_box(box, nodes * per_node, *layout)
    assert launched["plan"] == {**spawned["plan"], "num_nodes": nodes, "devices": per_node}
    assert launched["optimizer_steps"] == spawned["optimizer_steps"]
    assert launched["confusion_matrix"] == spawned["confusion_matrix"]
    for key in ("OA", "AA", "kappa"):
        assert launched[key] == pytest.approx(spawned[key], abs=1e-9), key


def _slurm_rank(out: Path, rank: int, port: int, *extra: str) -> subprocess.Popen:
    """Rank `rank` of a two-node SLURM job step, started with the variables srun sets."""
    env = {**_env(), "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0",
           "SLURM_NODEID": str(rank), "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1",
           "SLURM_JOB_NAME": "hslite-test", "SLURM_JOB_ID": "4242", "SLURM_NODELIST": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    command = [sys.executable, "-m", "hslite", "fit", *FIT, "parallel.num_nodes=2", "parallel.devices=1",
               f"output.root={out}", *extra]  # fmt: skip
    log = (out / f"node{rank}.log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out,
                            preexec_fn=_node_cores(rank, 2))  # fmt: skip


def test_hybrid_sharding_shards_inside_each_node_and_trains_what_fsdp_over_every_rank_trains(tmp_path) -> None:
    launched_root, box = tmp_path / "nodes", tmp_path / "box"
    launched_root.mkdir(), box.mkdir()
    hsdp = ("parallel.fsdp=true", "parallel.hybrid_shard=true")
    _wait(_torchrun_nodes(launched_root, 2, 2, *hsdp), launched_root)
    launched = _metrics(launched_root)
    spawned = _one_box(box, 4, "parallel.fsdp=true")  # one shard group of 4
    assert launched["plan_that_ran"] == "4×cpu dp4 b32 acc1 32-true hsdp"
    # the same gradient, summed in another order (a reduce-scatter in each node, then an all-reduce across)
    for key in ("OA", "AA", "kappa"):
        assert launched[key] == pytest.approx(spawned[key], abs=5e-3), key
    # bytes a rank sends per step, per fp32 parameter: gathers and reduce-scatters over its node's 2 ranks and 1/2
    # of the gradient all-reduced over the 2 nodes (1/2·12 + 2·1/2·4/2 = 8) against 3/4·12 = 9 over all 4 ranks
    from hslite.parallel.wire_format import fsdp_wire_bytes

    ratio = launched["usage"]["computed_bytes_per_step"] / spawned["usage"]["computed_bytes_per_step"]
    assert ratio == pytest.approx(fsdp_wire_bytes(4, 4, shards=2, replicas=2) / fsdp_wire_bytes(4, 4, shards=4))
    assert ratio == pytest.approx(8 / 9)


def test_a_simulated_slurm_step_trains_what_one_box_trains(tmp_path: Path) -> None:
    slurm, box = tmp_path / "slurm", tmp_path / "box"
    slurm.mkdir(), box.mkdir()
    port = _free_port()
    _wait([_slurm_rank(slurm, rank, port) for rank in range(2)], slurm)
    launched, spawned = _metrics(slurm), _one_box(box, 2)
    assert launched["confusion_matrix"] == spawned["confusion_matrix"]


def test_a_slurm_allocation_run_without_srun_says_so_instead_of_hanging(tmp_path: Path) -> None:
    # a batch script that runs `hslite fit` itself: SLURM_NTASKS says 2, one process exists
    alone = _slurm_rank(tmp_path, 0, _free_port(), "parallel.deadlines.startup=15")
    assert alone.wait(timeout=120) != 0
    log = (tmp_path / "node0.log").read_text()
    assert "hslite: error: SLURM rank 0 of 2 waited 15 s (parallel.deadlines.startup) at 127.0.0.1:" in log, log[-3000:]
    assert "run `srun hslite fit ...` inside the allocation" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_a_world_that_is_not_the_recipes_is_one_sentence_before_any_process_group(tmp_path: Path) -> None:
    # each rank's own output in a file of its own (torchrun --redirects), apart from the agent's report of its exit
    agents = _torchrun_nodes(
        tmp_path, 1, 2, "parallel.devices=4", agent=("--log-dir", str(tmp_path / "ranks"), "-r", "3")
    )
    for agent in agents:
        agent.wait(timeout=120)
    outputs = sorted((tmp_path / "ranks").rglob("stderr.log"))
    assert len(outputs) == 2, outputs
    # the agent stops the other rank as soon as the first exits, so that one may be ended before it speaks
    said = [text for text in (output.read_text().strip() for output in outputs) if text]
    assert said, "no rank said why it stopped"
    for sentence in said:  # the later parallel.devices wins: 4 asked, 2 launched
        assert sentence == "hslite: error: torchrun started 2 process(es) on each of 1 node(s), but the recipe " \
            "asks for parallel.num_nodes=1 × parallel.devices=4. Set parallel.num_nodes=1 parallel.devices=2, or " \
            "launch 4 process(es) per node on 1 node(s).", sentence  # fmt: skip


def _rank_1_training(root: Path, epoch: int) -> int:
    """The pid of rank 1 once it trains `epoch` or later."""
    deadline, activity = time.monotonic() + 120, None
    while activity is None and time.monotonic() < deadline:
        time.sleep(0.05)  # an epoch of the quickstart can take a fifth of a second
        found = list(root.glob("quickstart/*.incomplete/ranks/rank1.json"))
        entry = json.loads(found[0].read_text()) if found else {}
        training = re.match(r"training epoch (\d+)", entry.get("doing", ""))
        activity = entry if training and int(training[1]) >= epoch else None
    assert activity is not None, (root / "node0.log").read_text()[-3000:]
    return int(activity["pid"])


def _kill_the_node_of_rank_1(root: Path, agents: list[subprocess.Popen], epoch: int) -> subprocess.Popen:
    """Once rank 1 trains `epoch` or later, SIGKILL its agent and itself, as a machine that goes down; the other."""
    rank1 = _rank_1_training(root, epoch)
    agent = int(Path(f"/proc/{rank1}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent: the agent
    for pid in (rank1, agent):
        os.kill(pid, signal.SIGKILL)
    (dead,) = [a for a in agents if a.pid == agent]
    dead.wait(timeout=10)
    (survivor,) = [a for a in agents if a.pid != agent]
    return survivor


def test_a_killed_node_ends_the_job_on_the_other_with_one_sentence_and_no_process_left(tmp_path: Path) -> None:
    agents = _torchrun_nodes(tmp_path, 2, 1, "train.max_epochs=1000")
    survivor = _kill_the_node_of_rank_1(tmp_path, agents, 1)
    killed = time.monotonic()
    assert survivor.wait(timeout=120) != 0
    ended = time.monotonic() - killed
    log = (tmp_path / f"node{agents.index(survivor)}.log").read_text()
    assert ended < 60, log[-3000:]
    assert "hslite: error: rank 1 on node" in log and "stopped answering" in log, log[-3000:]
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True, check=False).stdout.split()
    assert left == [], f"processes left: {left}"
    said = next(line for line in log.splitlines() if line.startswith("hslite: error:"))
    print(f"the job ended {ended:.1f} s after the node was killed, {len(left)} processes left; {said}")


def test_a_launched_rank_that_hangs_alive_ends_the_job_within_a_minute_named_by_the_stall_watch(tmp_path) -> None:
    # Two torchrun "nodes" on one machine: the rank on the other node watches the stopped one's heartbeat.
    agents = _torchrun_nodes(tmp_path, 2, 1, "train.max_epochs=1000")  # the collective deadline stays at 10 minutes
    os.kill(_rank_1_training(tmp_path, 1), signal.SIGSTOP)
    stopped = time.monotonic()
    codes = [agent.wait(timeout=120) for agent in agents]
    ended = time.monotonic() - stopped
    logs = "".join((tmp_path / f"node{node}.log").read_text() for node in range(2))
    assert all(code != 0 for code in codes) and ended < 60, logs[-3000:]
    assert "stopped responding: no heartbeat for 3" in logs and "so hslite ended it" in logs, logs[-3000:]
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True, check=False).stdout.split()
    assert left == [], f"processes left: {left}"
    said = next(line for line in logs.splitlines() if line.startswith("hslite: error:"))
    print(f"the job ended {ended:.1f} s after rank 1 was stopped; {said}")


@pytest.mark.parametrize(
    "layout", [pytest.param((), id="dp"), pytest.param(("parallel.fsdp=true", "parallel.hybrid_shard=true"), id="hsdp")]
)  # hybrid shards: the full-state checkpoint loads back onto the (nodes, devices) mesh
def test_a_multinode_run_resumed_after_a_lost_node_ends_as_an_uninterrupted_one(tmp_path: Path, layout) -> None:
    run, whole = tmp_path / "run", tmp_path / "whole"
    run.mkdir(), whole.mkdir()
    same = ("train.max_epochs=20", "data.batch_size=8", "train.deterministic=true", *layout)  # epochs of many steps
    agents = _torchrun_nodes(run, 2, 1, *same)
    _kill_the_node_of_rank_1(run, agents, 3)  # last.ckpt holds an epoch before
    for agent in agents:
        agent.wait(timeout=120)
    _wait(_torchrun_nodes(run, 2, 1, *same, "resume=last"), run)
    _wait(_torchrun_nodes(whole, 2, 1, *same), whole)
    resumed, uninterrupted = _metrics(run), _metrics(whole)
    assert len(resumed["resumed"]) == 1
    assert resumed["confusion_matrix"] == uninterrupted["confusion_matrix"]
    assert resumed["OA"] == uninterrupted["OA"]


def _preflight(root: Path) -> dict:
    (run,) = [d for d in (root / "quickstart").iterdir() if d.is_dir() and "." not in d.name]
    return json.loads((run / "preflight.json").read_text())


def test_the_preflight_of_a_launched_job_measures_its_links_inside_and_across_nodes_and_its_mesh(tmp_path) -> None:
    _wait(
        _torchrun_nodes(tmp_path, 2, 2, "preflight.enabled=true", "preflight.enforce=false", "preflight.fresh=true"),
        tmp_path,
    )
    report = _preflight(tmp_path)
    links = report["links"]
    assert links["intra_gbps"] > 0 and links["inter_gbps"] > 0 and links["inter_latency_us"] > 0
    assert report["bandwidth_ratio"] == pytest.approx(links["intra_gbps"] / links["inter_gbps"])
    assert report["mesh"]["nodes"] == [[0, 1], [2, 3]] and report["mesh"]["dp_groups"] == [[0, 1, 2, 3]]
    assert "is a host's own, not a network's" in report["links_note"]  # both "nodes" are this machine
    assert report["requested"] == "4×cpu dp4 b32 acc1 32-true" and report["decision"] in ("GO", "NO-GO")
    assert any(r.startswith("links and device memory measured on this job's ranks: inside a node") for r in
               report["reasons"])  # fmt: skip
    assert report["loop_seconds"] > 0 and "training-loop cost timed with this job's 4 ranks" in report["reasons"][-1]
    print(f"measured: {links}; R = {report['bandwidth_ratio']:.2f}; mesh {report['mesh']}")


def test_a_layout_the_calibrated_mapping_rule_refuses_is_refused_on_every_rank_before_training(tmp_path) -> None:
    # The team's calibration says per-layer traffic crosses no link with R ≥ 0.5: the measured R = 1 (one-rank
    # nodes, a flat network) refuses FSDP across the two nodes, and names the plan to run instead.
    profile = (
        ROOT / "hslite/preflight_check/hardware/topologies/ib_hdr.yaml"
    ).read_text() + "max_cross_node_ratio: 0.5\n"
    (tmp_path / "calibrated.yaml").write_text(profile)
    agents = _torchrun_nodes(tmp_path, 2, 1, "preflight.enabled=true", "preflight.fresh=true", "parallel.fsdp=true",
                             f"preflight.topology={tmp_path / 'calibrated.yaml'}")  # fmt: skip
    for agent in agents:
        assert agent.wait(timeout=300) != 0  # the agent reports its rank failed; the rank exits 3 (NO-GO)
    for node in range(2):
        log = (tmp_path / f"node{node}.log").read_text()
        assert "hslite: error: pre-flight NO-GO for 2×cpu dp2 b32 acc1 32-true fsdp" in log, log[-3000:]
        assert "sends FSDP's gathers and reduce-scatters across nodes, on a link 1.0× slower" in log, log[-3000:]
    assert not list(tmp_path.glob("quickstart/*")), "nothing is written before the verdict"

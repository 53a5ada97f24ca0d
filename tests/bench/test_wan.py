"""The WAN emulation of `diloco bench --only wan` (bench/diloco_bench/netns.py, delayline.py, wan.py): namespaces,
shaped links, real training across them, and nothing left behind. Needs root and iproute2, as CI has; a machine
without them fails these tests (they never skip)."""

import json
import os
import random
import re
import subprocess
from pathlib import Path

import pytest

from diloco_bench import netns, runs, wan
from diloco_bench.delayline import Schedule, parse_links
from diloco_trainer.runtime import procs
from diloco_trainer.runtime.launch import parse_exec_prefixes

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


def _ours_present(plan: netns.Plan) -> list[str]:
    return [n for n in netns.list_namespaces() if n in set(plan.namespaces())]


def _host_links_of(plan: netns.Plan) -> list[str]:
    """Links in the host's namespace that this plan's network could have left there: its interface names (the node
    end, the hub ports, the delay line's TUN) or a peer in one of its namespaces. Other host links come and go with
    whatever else runs here (a kubelet's pod veths during the e2e tier), so the test looks at these only."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    ours = re.compile(rf"^\d+: ({re.escape(netns.NODE_IF)}|p\d+|{re.escape(netns.TUN)})[@:]")
    return [line for line in out.splitlines()
            if ours.match(line) or any(ns in line for ns in plan.namespaces())]


def _run(argv: list[str], env: dict[str, str], timeout: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_a_learner_in_its_own_namespace_trains_against_a_syncer_in_another_through_the_shaped_link(tmp_path):
    learner_link, syncer_link = netns.Link(4.0, 30.0, 3.0), netns.Link(16.0, 20.0, 2.0)
    setting = wan.Setting("test", (learner_link,), syncer_link)
    plan = netns.new_plan(setting.nodes("decoupled"))
    with netns.Network(plan) as net:
        probe = netns.probe(net, "learner-0", "syncer", 150_000)
        # A round trip crosses both links twice: at least 2 * ((30 - 3) + (20 - 2)) ms of delay line.
        assert probe["rtt_s"] >= 2 * (0.027 + 0.018)
        assert probe["mbit_per_s"] <= 4.0 * 1.15  # the learner's 4 Mbit/s link is the bottleneck

        launch = wan.launch(net, setting, "decoupled")
        run_dir = tmp_path / "run"
        argv = [*launch.prefix, *procs.diloco_argv(
            "local", "--config", str(TINY), "--learners", "1", "--steps", "16", "--minutes", "4", "--plain",
            "--run-dir", str(run_dir), "--snapshots", "1", "--eval-batches", "2"), *launch.flags]
        out = _run(argv, procs.child_env(dict(launch.env)))
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert _ours_present(plan) == []

    summary = json.loads((run_dir / "summary.json").read_text())
    learner = summary["per_learner"]["learner-0"]
    assert learner["step"] == 16 and learner["acked"] > 0  # it trained, and the syncer took its work
    assert sum(summary["syncer"]["versions"].values()) > 0
    # It reached the syncer at the syncer namespace's address, i.e. through the hub and both shaped links.
    assert f"listening on http://{plan.address('syncer')}:" in (run_dir / "logs" / "syncer.log").read_text()
    assert f"--syncer http://{plan.address('syncer')}:" in (run_dir / "logs" / "learner-0.log").read_text()


@pytest.mark.slow
def test_ddp_workers_in_their_own_namespaces_meet_across_the_links_and_end_bit_identical(tmp_path):
    link = netns.Link(8.0, 10.0, 1.0)
    setting = wan.Setting("test", (link, link), link)
    plan = netns.new_plan(setting.nodes("ddp"))
    with netns.Network(plan) as net:
        launch = wan.launch(net, setting, "ddp")
        run_dir = tmp_path / "ddp"
        argv = [*procs.diloco_argv("baseline", "ddp", "--config", str(TINY), "--learners", "2", "--steps", "3",
                                   "--minutes", "4", "--plain", "--run-dir", str(run_dir), "--snapshots", "0",
                                   "--eval-batches", "2", "--log-every", "1"), *launch.flags]
        out = _run(argv, procs.child_env(dict(launch.env)))
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert _ours_present(plan) == []
    finals = [json.loads((run_dir / "learners" / f"learner-{r}" / "metrics.jsonl").read_text().splitlines()[-1])
              for r in range(2)]
    assert [f["step"] for f in finals] == [3, 3]
    assert finals[0]["param_sha256"] == finals[1]["param_sha256"]


def test_nothing_is_left_behind_when_the_run_inside_the_network_fails():
    plan = netns.new_plan([("a", netns.Link(10.0, 5.0)), ("b", netns.Link(None, 5.0))])
    assert _host_links_of(plan) == []
    with pytest.raises(RuntimeError, match="the run broke"):
        with netns.Network(plan) as net:
            assert sorted(_ours_present(plan)) == sorted(plan.namespaces())
            sleeper = subprocess.Popen([*net.launch("a"), "sleep", "300"])
            raise RuntimeError("the run broke")
    assert _ours_present(plan) == []
    # The process left running in a namespace was ended, so the namespace (and its veth) is really gone.
    assert sleeper.wait(timeout=10) != 0
    assert _host_links_of(plan) == []


def test_namespaces_of_a_bench_that_died_are_removed_by_the_next_one_and_live_ones_are_kept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale_name = f"{netns.PREFIX}{dead.pid}-beef-hub"
    live_name = f"{netns.PREFIX}{os.getpid()}-beef-hub"
    for name in (stale_name, live_name):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert netns.remove_leftovers() == [stale_name]
        present = netns.list_namespaces()
        assert stale_name not in present and live_name in present
    finally:
        for name in (stale_name, live_name):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_stale_namespaces_are_those_of_this_module_whose_creator_is_gone():
    names = ["dlwan-100-ab-hub", "dlwan-200-cd-syncer", "other-100", "dlwan-x-1-hub"]
    assert netns.stale(names, alive=lambda pid: pid == 200) == ["dlwan-100-ab-hub", "dlwan-x-1-hub"]


def test_without_root_or_iproute2_the_network_refuses_with_the_reason():
    with pytest.raises(netns.NetworkUnavailable, match="needs root"):
        netns.check_host(euid=1000)
    with pytest.raises(netns.NetworkUnavailable, match="`ip` not found"):
        netns.check_host(euid=0, find=lambda name: f"/nonexistent/{name}")
    netns.check_host()  # this machine (CI: root with iproute2) can


def test_the_delay_line_holds_a_packet_for_both_links_and_keeps_each_pairs_order():
    links = parse_links(["10.213.1.2=20,5", "10.213.2.2=40,0"])
    schedule = Schedule(links, random.Random(1))

    def packet(src: str, dst: str) -> bytes:
        return bytes([0x45]) + bytes(11) + bytes(map(int, src.split("."))) + bytes(map(int, dst.split(".")))

    now, released = 100.0, []
    for i in range(200):
        t = schedule.release(packet("10.213.1.2", "10.213.2.2"), now + i * 1e-4)
        assert 0.055 - 1e-9 <= t - (now + i * 1e-4) or released and t == released[-1]
        assert t - (now + i * 1e-4) <= 0.065 + 1e-9
        released.append(t)
    assert released == sorted(released)  # jitter never reorders a pair
    assert schedule.release(b"\x60" + bytes(39), now) is None  # not IPv4: dropped


def test_a_link_is_scaled_so_ddp_carries_the_papers_load():
    scale = wan.scaling(params=1_000_000, learners=4, step_s=0.5, sync_every=16)
    # DDP: 2*(3/4)*4 B*1e6 = 6 MB per 0.5 s step = 96 Mbit/s needed; the paper's 198 Gbps over 5 Gbps is a load of 39.6.
    assert scale["ddp_required_mbit"] == pytest.approx(96.0)
    assert scale["links"]["5 Gbps"]["rate_mbit"] == pytest.approx(96.0 / 39.6)
    assert scale["links"]["2 Gbps"]["rate_mbit"] == pytest.approx(96.0 / 99.0)
    assert "Mbit/s" in scale["text"]


def test_exec_prefixes_are_parsed_per_child_and_bad_ones_refused():
    names = ["syncer", "learner-0"]
    assert parse_exec_prefixes(["learner-0=ip netns exec 'a b'"], names) == {"learner-0": ["ip", "netns", "exec", "a b"]}
    for bad in (["learner-7=ip"], ["learner-0"], ["learner-0= "], ["syncer=x", "syncer=y"]):
        with pytest.raises(ValueError):
            parse_exec_prefixes(bad, names)


def test_a_run_keeps_its_key_unless_it_runs_over_a_network():
    plain = runs.RunSpec("ddp", 10)
    assert plain.key == runs.RunSpec("ddp", 10, network="").key
    assert plain.key != runs.RunSpec("ddp", 10, network="learners 2 Mbit/s").key
